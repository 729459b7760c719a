"""Guards that the other memory tests could not see broken (issue 52).

1. The check before use (memory/verify.py) decides at the CONFIGURED level and at the exact
   boundary of its rule. The scripted tests of test_memory_verify.py admit items on 3 wins and
   no loss at z = 1.645 and tie the neutral ones, so a decision on the point estimate, a
   hard-coded level or an off-by-one at a boundary passed them. Here every boundary record is
   computed from the Wilson score interval written out in this file (never by calling
   ``wilson_bounds`` / ``paired_effect``) and the records are fed through the real path:
   ``check_before_use`` with a scripted ``run_arms`` (one win, loss or tie per replay pair),
   which calls ``EvidenceStore.record`` and its decision.

   Reference: the Wilson interval of a share ``pi`` of wins among ``d = wins + losses``
   discordant pairs is the set of ``pi`` the score test does not reject,
   ``|w/d - pi| <= z sqrt(pi (1 - pi) / d)``. The effect interval is ``d/n (2 pi - 1)``, so
   its lower bound is above zero iff ``pi = 1/2`` lies below the interval, i.e.
   ``(w/d - 1/2) > z sqrt(1 / (4 d))``, i.e. ``w - l > z sqrt(d)``; its upper bound is at or
   below zero iff ``l - w >= z sqrt(d)``. (All wins: ``d > z**2``; at z = 2.64, 7 wins.)

2. The experience level never shows, as the remembered success, a success from the latest
   update step (``remembered_success_previous_steps_only``; experience.py ``_before``). The
   trainer updates the memory with step k's rollouts and then builds step k's teacher
   contexts, so a step-k success is a student's own current attempt (SDPO shows a sibling's
   success separately, and a lone success is never shown its own attempt). Checked through
   ``ProceduralMemory.teacher_context`` (the trainer's call, with ``step`` and
   ``student_response``) and through the random-memory control (``fill_control``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import pytest

from pmd_jax.memory import ProceduralMemory, RolloutRecord, default_memory_config
from pmd_jax.memory.config import MemoryVerify, freeze_memory_config
from pmd_jax.memory.context import TeacherContext
from pmd_jax.memory.verify import EvidenceStore, Proposal, check_before_use
from tests.fakes import HashEmbedder

DEFAULT = MemoryVerify()

# ============================================================================ the check
# One replay pair per letter: (with-item (correct, ok), without-item (correct, ok)).
PAIRS: dict[str, tuple[tuple[bool, bool], tuple[bool, bool]]] = {
    "W": ((True, True), (False, True)),  # win: only the with-item answer is right
    "L": ((False, True), (True, True)),  # loss: only the without-item answer is right
    "T": ((False, True), (False, True)),  # tie (both wrong, both valid answers)
    "F": ((False, False), (False, True)),  # reward tie, the item's answer is no answer
    "X": ((True, False), (False, True)),  # a win whose with-item answer is no valid answer
}


def ref_admits(wins: int, losses: int, z: float) -> bool:
    """Wilson lower bound of the paired effect above zero (module doc): ``w - l > z sqrt(d)``."""
    d = wins + losses
    return d > 0 and wins - losses > z * math.sqrt(d)


def ref_upper_at_or_below_zero(wins: int, losses: int, z: float) -> bool:
    """Wilson upper bound at or below zero, with at least one discordant pair."""
    d = wins + losses
    return d > 0 and losses - wins >= z * math.sqrt(d)


def min_wins(losses: int, z: float) -> int:
    """The fewest wins that admit an item with ``losses`` losses (reference, not our code)."""
    w = 0
    while not ref_admits(w, losses, z):
        w += 1
    return w


def min_losses(wins: int, z: float) -> int:
    """The fewest losses that reject an item with ``wins`` wins on its upper bound."""
    n = 0
    while not ref_upper_at_or_below_zero(wins, n, z):
        n += 1
    return n


def run_check(store: EvidenceStore, step: int, plans: dict[str, str]) -> dict[str, int]:
    """One ``check_before_use`` step: item ``key`` is proposed for its own problem and its
    replay pairs are ``plans[key]`` (letters of :data:`PAIRS`). Returns the step's counts."""
    keys = list(plans)
    proposals = [[Proposal(k, "insight", "strategies", f"text of {k}")] for k in keys]

    def run_arms(arms: list[tuple[int, str | None, object]]) -> list[list[tuple[bool, bool]]]:
        # the baseline arm has no section; an item arm answers as its plan says
        return [[PAIRS[c][0 if section is not None else 1] for c in plans[keys[i]]]
                for i, section, _ in arms]

    return check_before_use(store, step, [f"problem/{k}" for k in keys], proposals, run_arms)


def feed(store: EvidenceStore, key: str, pairs: str, first_step: int = 1,
         chunk: int | None = None) -> int:
    """Feeds ``pairs`` to one item, ``chunk`` (default ``replays``) pairs per step, stopping
    early if it leaves ``pending``; returns the next free step."""
    chunk = chunk or int(store.cfg.replays)
    step = first_step
    for at in range(0, len(pairs), chunk):
        run_check(store, step, {key: pairs[at:at + chunk]})
        step += 1
        if store.items[key].status != "pending":
            break
    return step


def status(store: EvidenceStore, key: str) -> str:
    return store.items[key].status


def test_the_reference_matches_the_module_doc_and_scipy() -> None:
    """The boundary records the other tests use, from the score-test form above, agree with
    the module doc (z = 2.64: 7 wins and no loss, 10 and 1) and with scipy's Wilson interval
    (an implementation independent of ours) at the default level."""
    from scipy.stats import binomtest

    assert (min_wins(0, 2.64), min_wins(1, 2.64)) == (7, 10)
    z = DEFAULT.z
    level = 1 - 2 * (1 - NormalDist().cdf(z))  # scipy's two-sided level whose bounds use z
    for losses in range(4):
        w = min_wins(losses, z)
        for wins, admit in ((w, True), (w - 1, False)):
            low = binomtest(wins, wins + losses).proportion_ci(level, method="wilson").low
            assert bool(low > 0.5) is admit, (wins, losses)
    for wins in range(3):
        n = min_losses(wins, z)
        for losses, reject in ((n, True), (n - 1, False)):
            high = binomtest(wins, wins + losses).proportion_ci(level, method="wilson").high
            assert bool(high <= 0.5) is reject, (wins, losses)


def test_the_default_level_admits_at_the_boundary_record_and_not_just_below() -> None:
    """At the default z (read from MemoryVerify): the fewest wins with no loss, and with one
    loss, that the Wilson bound admits are admitted (and shown); one win fewer leaves the item
    pending (neither admitted nor rejected). Fed in tests of ``replays`` pairs, as the loop
    does."""
    z = DEFAULT.z
    store = EvidenceStore(DEFAULT)
    for losses in (0, 1):
        key = f"item-{losses}-losses"
        w = min_wins(losses, z)
        step = feed(store, key, "L" * losses + "W" * (w - 1))
        assert status(store, key) == "pending", (w - 1, losses)
        assert not store.visible(key)
        counts = run_check(store, step, {key: "W"})
        assert status(store, key) == "admitted" and counts["admitted"] == 1, (w, losses)
        assert store.visible(key) and store.items[key].admitted_step == step
        assert (store.items[key].wins, store.items[key].losses) == (w, losses)


def test_a_positive_point_estimate_alone_does_not_admit() -> None:
    """One win and no loss, and the most wins short of the boundary (6-0 at z = 2.64), have
    a positive estimate (wins - losses) / pairs but a lower bound at or below zero: not
    admitted (a decision on the estimate admitted both)."""
    z = DEFAULT.z
    for wins in (1, min_wins(0, z) - 1):
        store = EvidenceStore(DEFAULT)
        feed(store, "k", "W" * wins + "T")
        ev = store.items["k"]
        assert (ev.wins - ev.losses) / ev.pairs > 0  # the point estimate, directly
        assert ev.status == "pending" and not store.visible("k"), wins


@pytest.mark.parametrize("z", [1.645, 2.0, 3.0])
def test_the_configured_level_is_the_one_applied(z: float) -> None:
    """A non-default ``z`` moves the boundary to where the Wilson bound at that ``z`` puts it
    (3, 5, 10 wins with no loss at z = 1.645, 2.0, 3.0; at 2.0 four wins give a lower bound of
    exactly zero, which does not admit): one win fewer stays pending, the boundary record is
    admitted. A level hard-coded to 1.645 or 2.64 fails one of these."""
    cfg = DEFAULT.replace(z=z, max_pairs=10_000)  # (3.0 needs 13 pairs with one loss)
    w = min_wins(0, z)
    assert w == {1.645: 3, 2.0: 5, 3.0: 10}[z]
    store = EvidenceStore(cfg)
    step = feed(store, "k", "W" * (w - 1))
    assert status(store, "k") == "pending"
    run_check(store, step, {"k": "W"})
    assert status(store, "k") == "admitted"
    # with one loss too
    w1 = min_wins(1, z)
    store = EvidenceStore(cfg)
    step = feed(store, "k", "L" + "W" * (w1 - 1))
    assert status(store, "k") == "pending"
    run_check(store, step, {"k": "W"})
    assert status(store, "k") == "admitted"


@pytest.mark.parametrize("z", [DEFAULT.z, 2.0])
def test_rejected_when_the_upper_bound_reaches_zero_and_not_before(z: float) -> None:
    """Rejected at once when the upper bound is at or below zero: the fewest losses (with no
    win, and with one win) that put it there reject; one loss fewer stays pending. At z = 2.0
    four losses give an upper bound of exactly zero: rejected (at or below)."""
    cfg = DEFAULT.replace(z=z, max_pairs=10_000)  # only the upper bound can reject here
    if z == 2.0:
        assert min_losses(0, z) == 4
    for wins in (0, 1):
        n = min_losses(wins, z)
        store = EvidenceStore(cfg)
        step = feed(store, "k", "W" * wins + "L" * (n - 1))
        assert status(store, "k") == "pending", (wins, n - 1)
        counts = run_check(store, step, {"k": "L"})
        assert status(store, "k") == "rejected" and counts["rejected"] == 1, (wins, n)
        assert store.items["k"].ended_step == step and not store.visible("k")


def test_max_pairs_rejects_at_exactly_max_pairs_and_ties_alone_never_decide() -> None:
    """Ties alone leave both bounds at zero and decide nothing; an undecided item is rejected
    when its pairs reach ``max_pairs`` (not before), at the default and at another value."""
    for max_pairs in (DEFAULT.max_pairs, 5):
        cfg = DEFAULT.replace(max_pairs=max_pairs)
        store = EvidenceStore(cfg)
        step = feed(store, "ties", "T" * (max_pairs - 1))
        assert status(store, "ties") == "pending" and store.items["ties"].pairs == max_pairs - 1
        run_check(store, step, {"ties": "T"})
        assert status(store, "ties") == "rejected", max_pairs
        # an item with some evidence either way, still undecided, goes the same way
        store = EvidenceStore(cfg)
        step = feed(store, "mixed", ("WL" + "T" * max_pairs)[: max_pairs - 1])
        assert status(store, "mixed") == "pending"
        run_check(store, step, {"mixed": "T"})
        assert status(store, "mixed") == "rejected"


def test_admission_is_decided_before_max_pairs() -> None:
    """An item whose admitting win is its ``max_pairs``-th pair is admitted, not rejected."""
    z = DEFAULT.z
    w = min_wins(0, z)
    cfg = DEFAULT.replace(max_pairs=w + 2)
    store = EvidenceStore(cfg)
    step = feed(store, "k", "TT" + "W" * (w - 1))
    assert status(store, "k") == "pending" and store.items["k"].pairs == cfg.max_pairs - 1
    run_check(store, step, {"k": "W"})
    assert status(store, "k") == "admitted"


def test_a_rise_in_non_answers_rejects_from_its_boundary_and_blocks_admission() -> None:
    """Non-answers: an item is rejected when the lower bound on the rise in invalid answers is
    above zero (the fewest format losses the Wilson bound needs; one fewer stays pending),
    unless ``check_format`` is off; and a record that would admit on reward is rejected when
    its wins come with that many non-answers."""
    z = DEFAULT.z
    f = min_wins(0, z)  # the rise's bound: format losses play the wins' part
    store = EvidenceStore(DEFAULT)
    step = feed(store, "k", "F" * (f - 1))
    assert status(store, "k") == "pending"
    run_check(store, step, {"k": "F"})
    assert status(store, "k") == "rejected"
    off = EvidenceStore(DEFAULT.replace(check_format=False))
    feed(off, "k", "F" * f)
    assert status(off, "k") == "pending"
    store = EvidenceStore(DEFAULT)
    feed(store, "k", "X" * f)  # f wins (admitting on reward alone), each one a non-answer
    assert status(store, "k") == "rejected" and store.items["k"].wins == f


@pytest.mark.parametrize("z", [DEFAULT.z, 2.0, 1.645])
def test_every_record_is_decided_as_the_wilson_rule_says(z: float) -> None:
    """Every record up to 12 wins and 12 losses, given in one test (so only the rule, not the
    order, decides): admitted iff the reference lower bound is above zero, rejected iff its
    upper bound is at or below zero, pending otherwise (max_pairs out of reach)."""
    cfg = DEFAULT.replace(z=z, max_pairs=10_000)
    for wins in range(13):
        for losses in range(13):
            store = EvidenceStore(cfg)
            run_check(store, 1, {"k": "W" * wins + "L" * losses + "T"})
            want = ("admitted" if ref_admits(wins, losses, z) else
                    "rejected" if ref_upper_at_or_below_zero(wins, losses, z) else "pending")
            assert status(store, "k") == want, (wins, losses, z)


def test_an_admitted_item_is_retired_when_its_lower_bound_falls_to_zero() -> None:
    """Re-tested after ``retest_every`` steps: an admitted item keeps its status while the
    reference lower bound stays above zero and is retired on the loss that takes it to zero or
    below (at z = 2.0, 12 wins and 4 losses: exactly zero)."""
    for z in (DEFAULT.z, 2.0):
        cfg = DEFAULT.replace(z=z, max_pairs=10_000)
        wins = 12
        keep = max(n for n in range(wins) if ref_admits(wins, n, z))  # the most losses kept
        if z == 2.0:
            assert keep == 3  # 12 - 4 == 2 * sqrt(16): a lower bound of exactly zero
        store = EvidenceStore(cfg)
        step = feed(store, "k", "W" * wins, chunk=wins)
        assert status(store, "k") == "admitted"
        every = int(cfg.retest_every)
        for _ in range(keep):
            step += every
            run_check(store, step, {"k": "L"})
            assert status(store, "k") == "admitted"
        step += every
        counts = run_check(store, step, {"k": "L"})
        assert status(store, "k") == "retired" and counts["retired"] == 1
        assert not store.visible("k")


# ======================================================================= experience guard
PROBLEMS = {"P": "Which gas do plants take in?", "Q": "What is the SI unit of resistance?"}
# per step: (problem, response, reward) in rollout order; P succeeds at every step, Q only at
# step 2 (the latest update step of the tests below)
ROLLOUTS: dict[int, list[tuple[str, str, float]]] = {
    0: [("P", "P solved at step 0", 1.0), ("Q", "Q failed at step 0", 0.0)],
    1: [("P", "P solved at step 1", 1.0), ("P", "P failed at step 1", 0.0),
        ("Q", "Q failed at step 1", 0.0)],
    2: [("P", "P solved at step 2", 1.0), ("P", "P failed at step 2", 0.0),
        ("Q", "Q solved at step 2", 1.0), ("Q", "Q failed at step 2", 0.0)],
    3: [("P", "P failed at step 3", 0.0), ("Q", "Q failed at step 3", 0.0)],
}


def experience_memory(previous_steps_only: bool = True) -> ProceduralMemory:
    """A memory with the experience level only (no reflection, no behavior round: no
    generator), the hash embedder (no model)."""
    c = default_memory_config()
    c.levels.insight = False
    c.levels.behavior = False
    c.experience.remembered_success_previous_steps_only = previous_steps_only
    return ProceduralMemory(freeze_memory_config(c), embedder=HashEmbedder())


def update_through(mem: ProceduralMemory, steps: Sequence[int]) -> None:
    for step in steps:
        records = []
        for j, (pid, text, reward) in enumerate(ROLLOUTS[step]):
            records.append(RolloutRecord(pid, PROBLEMS[pid], step, j, text, reward,
                                         "" if reward else "Wrong."))
        mem.update(step, records, None)


def context(mem: ProceduralMemory, pid: str, step: int) -> TeacherContext:
    """The teacher context the trainer asks for at ``step`` for a failed row of ``pid``
    (no sibling success passed: only the memory can show one)."""
    return mem.teacher_context(pid, PROBLEMS[pid], None, "Wrong.",
                               student_response=f"{pid} failed at step {step}", step=step)


def shown(ctx: TeacherContext) -> tuple[str | None, str | None, list[str]]:
    items = [p["item"] for p in ctx.provenance if str(p.get("item", "")).startswith("exp/")]
    return ctx.successful_attempt, ctx.successful_attempt_source, items


def test_a_success_of_the_latest_update_step_is_not_the_remembered_success() -> None:
    """After the update with step 2's rollouts, step 2's teacher contexts show P's step-1
    success (the latest from an earlier step, the step just before), not its step-2 success,
    and show Q, whose only success is from step 2, none, with or without the student's
    response and step; one update later those step-2 successes are shown. With the guard off
    the step-2 success is shown at once (so the store does hold it)."""
    mem = experience_memory()
    update_through(mem, [0, 1, 2])
    assert mem.last_update_step == 2
    assert mem.experience.remembered_success("Q", None).response_text == "Q solved at step 2"
    assert shown(context(mem, "P", 2)) == ("P solved at step 1", "memory", ["exp/P/1/0"])
    assert shown(context(mem, "Q", 2)) == (None, None, [])
    bare = mem.teacher_context("Q", PROBLEMS["Q"])  # no step, no student response
    assert bare.successful_attempt is None and not bare.has_signal
    update_through(mem, [3])
    assert shown(context(mem, "P", 3)) == ("P solved at step 2", "memory", ["exp/P/2/0"])
    assert shown(context(mem, "Q", 3)) == ("Q solved at step 2", "memory", ["exp/Q/2/2"])
    off = experience_memory(previous_steps_only=False)
    update_through(off, [0, 1, 2])
    assert shown(context(off, "Q", 2)) == ("Q solved at step 2", "memory", ["exp/Q/2/2"])


def test_the_random_memory_control_draws_no_success_of_the_latest_update_step() -> None:
    """Control "random_other_problem" (``fill_control``): where the real context shows a
    remembered success (P at step 2: its step-1 one) the control shows another problem's,
    from an earlier step only; Q's only success is from step 2, so at step 2 there is none to
    draw, and after one more update it is the one drawn."""
    mem = experience_memory()
    update_through(mem, [0, 1, 2])
    assert shown(context(mem, "P", 2))[1] == "memory"  # the real context shows memory
    mem.config = mem.config.replace(control_mode="random_other_problem")
    assert shown(context(mem, "P", 2)) == (None, None, [])
    update_through(mem, [3])
    assert shown(context(mem, "P", 3)) == ("Q solved at step 2", "memory", ["exp/Q/2/2"])
