"""Tests written for the mutants that survived the mutation pass (docs/mutation.md): each
holds a number the check reports, or a branch it takes, to an independent reference."""

from __future__ import annotations

import pytest
from scipy.stats import binomtest

from pmd_jax.memory.config import MemoryVerify
from pmd_jax.memory.verify import (
    EvidenceStore,
    Proposal,
    check_before_use,
    item_text,
    paired_effect,
    select_tests,
    wilson_bounds,
)


def _reference(wins: int, losses: int, pairs: int, z: float) -> tuple[float, float, float]:
    """The paired effect written out: the estimate (wins - losses) / pairs; the interval the
    discordant share d / n times (2 pi - 1) over scipy's Wilson interval pi of wins among the
    d discordant pairs (two-sided at the level whose one-sided z is ``z``)."""
    from statistics import NormalDist

    d = wins + losses
    est = (wins - losses) / pairs
    if d == 0:
        return est, 0.0, 0.0
    conf = 1 - 2 * (1 - NormalDist().cdf(z))
    ci = binomtest(wins, d).proportion_ci(confidence_level=conf, method="wilson")
    return est, d / pairs * (2 * ci.low - 1), d / pairs * (2 * ci.high - 1)


@pytest.mark.parametrize("z", [1.645, 2.64])
@pytest.mark.parametrize("wins, losses, ties",
                         [(1, 0, 0), (0, 1, 0), (1, 0, 3), (3, 1, 4), (0, 5, 2), (7, 0, 5),
                          (2, 2, 0), (10, 1, 1)])
def test_paired_effect_is_the_written_out_formula(wins, losses, ties, z):
    """The estimate is the difference of the arms' solve rates (wins - losses) / pairs (a
    sum in its place survived), and the bounds follow scipy's Wilson interval, one pair
    included (a mutant that treated one pair as none survived)."""
    pairs = wins + losses + ties
    assert paired_effect(wins, losses, pairs, z) == pytest.approx(
        _reference(wins, losses, pairs, z), abs=1e-9)


def test_an_item_never_tested_has_no_estimate_and_the_widest_interval():
    """No pairs: estimate 0 and the interval [-1, 1] (every effect still possible), which is
    what memory.jsonl shows for a proposed, untested item."""
    assert paired_effect(0, 0, 0, 2.64) == (0.0, -1.0, 1.0)
    assert paired_effect(0, 0, -1, 2.64) == (0.0, -1.0, 1.0)


# ----------------------------------------------------------------------------- the store
def _store(**kw) -> EvidenceStore:
    return EvidenceStore(MemoryVerify(enabled=True, **kw))


def test_wilson_bounds_against_scipy_from_one_pair():
    from statistics import NormalDist

    assert wilson_bounds(0, 0, 2.64) == (0.0, 1.0)  # no trials: nothing known
    conf = 1 - 2 * (1 - NormalDist().cdf(2.64))
    for k, n in [(0, 1), (1, 1), (1, 2), (5, 7)]:
        ci = binomtest(k, n).proportion_ci(confidence_level=conf, method="wilson")
        assert wilson_bounds(k, n, 2.64) == pytest.approx((ci.low, ci.high), abs=1e-9)


def test_a_record_keeps_its_level_text_counts_steps_and_problems():
    """Every field of a record that memory.jsonl / memory.html report and the state saves:
    the item's level (a behavior's evidence is a behavior's, not the default insight's), its
    text (the first given), the pair counts of both kinds, the number of tests, the first and
    last tested steps (step 0 included), and the problems it was tested on (each once, at
    most 16)."""
    st = _store()
    # (with correct, without correct, with ok, without ok)
    st.record("k", "behavior", 0, "p0", [(True, False, True, False), (False, False, False, True),
                                        (True, True, True, True)], text="Name: do it")
    st.record("k", "behavior", 3, "p0", [(False, True, True, True)], text="other")
    ev = st.items["k"]
    assert (ev.level, ev.text) == ("behavior", "Name: do it")
    assert (ev.pairs, ev.wins, ev.losses) == (4, 1, 1)
    assert (ev.format_wins, ev.format_losses) == (1, 1)
    assert (ev.tests, ev.first_tested_step, ev.last_tested_step) == (2, 0, 3)
    assert ev.problems == ["p0"]
    st2 = _store(max_pairs=1000)
    for i in range(20):
        st2.record("m", "insight", 1, f"p{i}", [(False, False, True, True)])
    assert st2.items["m"].problems == [f"p{i}" for i in range(16)]
    assert st2.items["m"].first_tested_step == 1
    with pytest.raises(ValueError, match=r"evidence 'x' is rejected: it is not tested"):
        st3 = _store(max_pairs=1)
        st3.record("x", "insight", 0, "p", [(False, False, True, True)])
        st3.record("x", "insight", 1, "p", [(False, False, True, True)])


def test_counts_count_every_status():
    st = _store(z=1.645, max_pairs=4)
    st.record("a", "insight", 0, "p", [(True, False, True, True)] * 3)  # admitted
    st.record("b", "insight", 0, "p", [(True, False, True, True)] * 3)  # admitted
    st.record("c", "insight", 0, "p", [(False, False, True, True)] * 4)  # rejected (max_pairs)
    st.record("d", "insight", 0, "p", [(False, False, True, True)])  # pending
    assert st.counts() == {"pending": 1, "admitted": 2, "rejected": 1, "retired": 0}


def test_due_at_the_same_step_retest_every_and_never():
    """A pending item tested at step s is due again from step s + 1, not at s; an admitted
    one every ``retest_every`` steps (1: the next step), never with 0."""
    for every, due_next in ((1, True), (0, False)):
        st = _store(z=1.645, retest_every=every)
        st.record("p", "insight", 2, "q", [(False, False, True, True)])
        assert not st.due("p", 2) and st.due("p", 3)
        st.record("a", "insight", 2, "q", [(True, False, True, True)] * 3)
        assert st.items["a"].status == "admitted"
        assert st.due("a", 3) is due_next and not st.due("a", 2)
    assert _store().due("never-seen", 0)


def test_an_older_state_without_items_or_problems_loads():
    st = _store()
    st.load_state_dict({})
    assert st.items == {}
    st.record("k", "insight", 0, "p", [(True, False, True, True)])
    d = st.state_dict()
    del d["items"][0]["problems"]
    st2 = _store()
    st2.load_state_dict(d)
    assert st2.items["k"].problems == [] and st2.items["k"].wins == 1


def test_item_text_of_a_behavior_and_of_a_string():
    assert item_text(("Check units", "Convert before comparing.")) == \
        "Check units: Convert before comparing."
    assert item_text(["a", "b"]) == "a: b"
    assert item_text("a strategy") == "a strategy"
    assert item_text(("only one",)) == "('only one',)"
    assert item_text(("a", "b", "c")) == "('a', 'b', 'c')"


def _props(pid: int, n: int) -> list[Proposal]:
    return [Proposal(f"p{pid}i{j}", "insight", "strategies", f"item {pid}.{j}")
            for j in range(n)]


@pytest.mark.parametrize("budget", [1, 2, 3, 5])
def test_select_tests_takes_the_budget_round_robin_untested_first(budget):
    """``max_items_per_step`` items in all, taken round-robin over the problems (depth 0 of
    every problem, then depth 1, ...), at most ``max_items_per_problem`` each; an item tested
    before goes after the untested ones, the longest untested first; a key proposed for two
    problems is tested once."""
    st = _store(max_items_per_step=budget, max_items_per_problem=2)
    props = [_props(0, 3), _props(1, 3)]
    got = select_tests(st, 5, props)
    want_round_robin = [[], []]
    for k in range(budget):
        depth, i = divmod(k, 2)
        if depth < 2:
            want_round_robin[i].append(props[i][depth])
    assert got == want_round_robin
    # tested items rank after untested ones (the oldest test first)
    st2 = _store(max_items_per_step=12, max_items_per_problem=3)
    st2.record("p0i0", "insight", 3, "x", [(False, False, True, True)])
    st2.record("p0i1", "insight", 1, "x", [(False, False, True, True)])
    assert [p.key for p in select_tests(st2, 5, [_props(0, 3)])[0]] == ["p0i2", "p0i1", "p0i0"]
    dup = [[props[0][0]], [props[0][0]]]
    assert select_tests(_store(), 5, dup) == [[props[0][0]], []]


def test_check_before_use_counts_calls_arms_and_transitions():
    """One call for the baselines plus one per slot depth, arms = baseline arms + item arms,
    and each transition counted once per item; the problem tested on is recorded."""
    st = _store(z=1.645, max_items_per_problem=2, max_items_per_step=12, max_pairs=3)
    props = [_props(0, 2), _props(1, 1)]

    def run_arms(arms):  # every item arm right, every baseline wrong: 3 wins each
        return [[(a[1] is not None, True)] * 3 for a in arms]

    counts = check_before_use(st, 0, ["A", "B"], props, run_arms)
    assert (counts["calls"], counts["arms"]) == (3, 2 + 3)
    assert (counts["tested"], counts["admitted"]) == (3, 3)
    assert st.items["p1i0"].problems == ["B"] and st.items["p0i1"].problems == ["A"]


def test_below_z_1_one_discordant_loss_rejects_and_no_text_stays_empty():
    """z may be any positive level: at z = 0.9 one loss alone (l - w = 1 >= z sqrt(1))
    puts the upper bound below zero and rejects; a record given no text keeps none."""
    st = _store(z=0.9)
    assert st.record("k", "insight", 0, "p", [(False, True, True, True)]) == "rejected"
    assert st.items["k"].text == ""
    assert st.record("t", "insight", 0, "p", [(False, False, True, True)]) == ""


def test_an_untested_item_goes_before_one_tested_at_step_0():
    st = _store(max_items_per_step=1, max_items_per_problem=1)
    props = _props(0, 2)
    st.record(props[0].key, "insight", 0, "x", [(False, False, True, True)])
    assert select_tests(st, 1, [props]) == [[props[1]]]


def test_run_arms_must_grade_every_replay_of_every_arm():
    """A sampler that returned fewer replays for an item arm than for its baseline would pair
    the wrong samples: refused (zip strict), not silently shortened."""
    st = _store(z=1.645)

    def short(arms):
        return [[(True, True)] * (2 if a[1] is None else 1) for a in arms]

    with pytest.raises(ValueError):
        check_before_use(st, 0, ["A"], [_props(0, 1)], short)


# ----------------------------------------------------------------- the experience control
def test_the_control_adds_no_success_where_the_real_context_shows_none():
    """random_other_problem replaces a remembered success, never adds one: Q's real context
    at step 2 shows none (its only success is of the latest step), so its control shows none
    either, though P has earlier successes to draw."""
    from tests.memory.test_memory_guards import context, experience_memory, shown, update_through

    mem = experience_memory()
    update_through(mem, [0, 1, 2])
    assert shown(context(mem, "Q", 2)) == (None, None, [])
    mem.config = mem.config.replace(control_mode="random_other_problem")
    assert shown(context(mem, "Q", 2)) == (None, None, [])


def test_the_control_draws_the_other_problems_success_from_an_earlier_step():
    """The drawn problem's success must be from an earlier step too: P succeeds again at the
    latest update step (4); Q's control at step 4 shows P's step-2 success, not step 4's."""
    from pmd_jax.memory import RolloutRecord
    from tests.memory.test_memory_guards import (
        PROBLEMS,
        context,
        experience_memory,
        shown,
        update_through,
    )

    mem = experience_memory()
    update_through(mem, [0, 1, 2, 3])
    mem.update(4, [RolloutRecord("P", PROBLEMS["P"], 4, 0, "P solved at step 4", 1.0, ""),
                   RolloutRecord("Q", PROBLEMS["Q"], 4, 1, "Q failed at step 4", 0.0,
                                 "Wrong.")], None)
    assert shown(context(mem, "Q", 4))[1] == "memory"  # the real one shows Q's step-2 success
    mem.config = mem.config.replace(control_mode="random_other_problem")
    assert shown(context(mem, "Q", 4)) == ("P solved at step 2", "memory", ["exp/P/2/0"])
