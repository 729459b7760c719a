"""The level_sequential check before use (memory/verify.py): a level's items tested together,
pooled into one anytime-valid betting test per level; apart tests of an admitted level's
items drop the ones that hurt. Decisions against the wealth formula written out, its error
rate over a whole run and its power at the default run's budget through the real decision
code (memory/power.py), and the check's arms through check_before_use."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pmd_jax.memory.config import default_memory_config, freeze_memory_config
from pmd_jax.memory.power import level_admission_rate
from pmd_jax.memory.verify import (
    BET_FRACTIONS,
    JOINT,
    EvidenceStore,
    Proposal,
    check_before_use,
    wealth,
)

WIN, LOSS, TIE = (True, False, True, True), (False, True, True, True), (True, True, True, True)
INVALID = (False, False, False, True)  # only the with-memory answer names no option


def _cfg(**kw):
    c = default_memory_config()
    c.verify.rule = "level_sequential"
    for k, v in kw.items():
        c.verify[k] = v
    return freeze_memory_config(c).verify


def direct_wealth(wins: int, losses: int) -> float:
    """The mixture wealth after ``wins`` and ``losses`` discordant pairs, written out."""
    lam = np.array([0.05 + 0.1 * i for i in range(10)])
    return float(np.mean((1 + lam) ** wins * (1 - lam) ** losses))


def test_wealth_and_admission_boundary():
    assert BET_FRACTIONS == tuple(round(0.05 + 0.1 * i, 2) for i in range(10))
    k = next(k for k in range(1, 40) if direct_wealth(k, 0) >= 20)  # wins needed, no loss
    st = EvidenceStore(_cfg())
    assert st.record_level("insight", 0, [WIN] * (k - 1) + [TIE] * 30) == ""
    lv = st.levels["insight"]
    assert math.isclose(wealth(lv.help), direct_wealth(k - 1, 0), rel_tol=1e-9)
    assert (lv.pairs, lv.wins, lv.losses) == (k - 1 + 30, k - 1, 0)  # ties counted, no bet
    assert st.record_level("insight", 1, [WIN]) == "admitted"
    assert lv.admitted_step == 1 and wealth(lv.harm) == 1.0  # the harm test restarts
    # one loss among them needs more wins
    st2 = EvidenceStore(_cfg())
    st2.record_level("behavior", 0, [LOSS] + [WIN] * k)
    assert st2.levels["behavior"].status == ("admitted" if direct_wealth(k, 1) >= 20
                                             else "pending")
    assert direct_wealth(k, 1) < 20 and st2.levels["behavior"].status == "pending"


def test_rejected_only_on_evidence_and_retired_after_admission():
    st = EvidenceStore(_cfg())
    st.record_level("insight", 0, [TIE] * 200)  # ties: no evidence either way
    assert st.levels["insight"].status == "pending"
    k = next(k for k in range(1, 40) if direct_wealth(0, 0) and direct_wealth(k, 0) >= 20)
    assert st.record_level("insight", 1, [LOSS] * k) == "rejected"
    with pytest.raises(ValueError, match="not tested any more"):
        st.record_level("insight", 2, [WIN])
    st = EvidenceStore(_cfg())
    st.record_level("behavior", 0, [WIN] * k)
    assert st.levels["behavior"].status == "admitted"
    assert st.record_level("behavior", 4, [LOSS] * (k - 1)) == ""
    assert st.record_level("behavior", 8, [LOSS]) == "retired"
    # invalid answers: rejected whatever the reward says (check_format)
    st = EvidenceStore(_cfg())
    assert st.record_level("insight", 0, [INVALID] * k) == "rejected"
    off = EvidenceStore(_cfg(check_format=False))
    assert off.record_level("insight", 0, [INVALID] * k) == ""


@pytest.mark.parametrize("coupling", [0.0, 0.8])
def test_no_effect_is_admitted_at_most_alpha_over_a_long_run(coupling):
    """Anytime validity through the real decision code: 60 tests of 5 pairs (300 pairs,
    looked at after every test), base rates spread; P(ever admitted) <= alpha (+ MC)."""
    cfg = _cfg()
    rate = level_admission_rate(cfg, 0.0, (0.1, 0.7), coupling, tests=60, replays=5,
                                sims=1500, seed=3)
    assert rate <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 1500)


def test_power_at_the_default_runs_budget():
    """The embedded default's insight level: 16 problems, each tested at its 2 later visits
    (32 joint arms) with 5 replays, base rates 0.1-0.6, arms independent (coupling 0, the
    hard case): P(admit) >= 0.8 at +0.2, <= 0.05 at 0 (issue 48, part 4)."""
    cfg = _cfg()
    assert level_admission_rate(cfg, 0.2, (0.1, 0.6), 0.0, 32, 5, sims=1000, seed=1) >= 0.8
    assert level_admission_rate(cfg, 0.0, (0.1, 0.6), 0.0, 32, 5, sims=1000, seed=2) <= 0.05


def _props(n_problems: int) -> list[list[Proposal]]:
    return [[Proposal(f"p{i}s", "insight", "strategies", f"strategy {i}"),
             Proposal(f"p{i}l", "insight", "lessons", f"lesson {i}"),
             Proposal(f"p{i}b", "behavior", "behaviors", (f"b{i}", f"do {i}"))]
            for i in range(n_problems)]


def test_check_together_then_apart():
    st = EvidenceStore(_cfg(replays=5, max_items_per_step=12))
    props = _props(3)
    calls: list[list] = []

    def run_arms(arms):  # insight joint arms always right, the rest always wrong
        calls.append(list(arms))
        return [[(sec == JOINT and val[0][0] == "strategies", True)] * 5
                for _, sec, val in arms]

    c = check_before_use(st, 0, ["A", "B", "C"], props, run_arms)
    # baselines, then one joint arm per level per problem (insight first: sorted levels)
    assert [len(x) for x in calls] == [3, 3, 3]
    assert all(a[1] is None for a in calls[0])
    first = [a for a in calls[1] if a[0] == 0][0]
    assert first[1] == JOINT and first[2] == (("behaviors", ("b0", "do 0")),)
    ins = [a for a in calls[2] if a[0] == 0][0]
    assert ins[2] == (("strategies", "strategy 0"), ("lessons", "lesson 0"))
    assert c["level_tested"] == 6 and c["tested"] == 0 and c["calls"] == 3
    lv = st.levels["insight"]
    assert lv.pairs == 15 and lv.wins == 15 and lv.status == "admitted"
    # the behavior arms tie with the baselines: no evidence, still pending (not rejected)
    assert c["level_admitted"] == 1 and st.levels["behavior"].status == "pending"
    assert st.visible("p0s") and st.visible("p2l") and not st.visible("p0b")
    counts = st.counts()
    assert counts["admitted"] == 6 and counts["pending"] == 3 and counts["levels_admitted"] == 1
    # next step: the admitted level is not due (retest_every 4); its items are tested apart,
    # each alone, and one that hurts is dropped on evidence
    calls.clear()

    def hurts(arms):
        calls.append(list(arms))
        return [[(not (sec == "strategies"), True)] * 5 for _, sec, val in arms]

    for step in range(1, 4):
        c = check_before_use(st, step, ["A", "B", "C"], props, hurts)
        assert c["level_tested"] == 3  # the pending behavior level only
    joint = [val for call in calls for _, sec, val in call if sec == JOINT]
    assert joint and all(v[0][0] == "behaviors" for v in joint)  # insight: not due again
    apart = {sec for call in calls for _, sec, _ in call if sec not in (None, JOINT)}
    assert apart == {"strategies", "lessons"}  # only the admitted level's items, alone
    assert not st.visible("p0s") and st.items["p0s"].status == "rejected"
    assert st.visible("p0l")  # a lesson that ties stays
    # state round trip
    st2 = EvidenceStore(st.cfg)
    st2.load_state_dict(st.state_dict())
    assert st2.state_dict() == st.state_dict() and st2.visible("p1l") == st.visible("p1l")


def test_budget_caps_apart_tests_after_joint_arms():
    st = EvidenceStore(_cfg(max_items_per_step=4, max_items_per_problem=4))
    st.record_level("insight", 0, [WIN] * 40)  # admitted
    props = _props(3)
    seen: list[list] = []

    def run_arms(arms):
        seen.append(list(arms))
        return [[(False, True)] * 4 for _ in arms]

    check_before_use(st, 1, ["A", "B", "C"], props, run_arms)
    item_arms = sum(len(x) for x in seen[1:])
    assert item_arms == 4  # 3 behavior joint arms + 1 apart test
    assert sum(1 for x in seen[1:] for a in x if a[1] == JOINT) == 3


def test_an_item_written_after_admission_is_shown_only_once_measured():
    """The level's evidence admits its items as they were tested together; an item proposed
    later has been in no arm: it is hidden until a replay arm (here the apart test, which
    runs before the contexts keep their items) has measured it; one the step's budget leaves
    untested stays hidden."""
    st = EvidenceStore(_cfg(max_items_per_step=1, max_items_per_problem=1))
    st.record_level("insight", 0, [WIN] * 40)  # admitted (directly: no item measured)
    ties = lambda arms: [[(False, True)] * 4 for _ in arms]  # noqa: E731
    new = Proposal("late", "insight", "lessons", "written at step 2")
    other = Proposal("later", "insight", "lessons", "also new")
    for p in (new, other):
        st.item_level[p.key] = "insight"
    assert not st.visible("late") and not st.visible("later")
    c = check_before_use(st, 2, ["A", "B"], [[new], [other]], ties)  # level not due: apart
    assert c["level_tested"] == 0 and c["tested"] == 1  # the budget: one apart test
    assert st.items["late"].tests == 1 and st.visible("late")
    assert "later" not in st.items and not st.visible("later")
    st2 = EvidenceStore(st.cfg)
    st2.load_state_dict(st.state_dict())
    assert st2.visible("late") and not st2.visible("later")
