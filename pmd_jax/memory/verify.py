"""Admission of model-written memory: no insight or behavior reaches a teacher context until
paired replays have shown that it helps (``memory.verify``; mode ``pmd_verified``).

Why a check at all. The policy writes the strategies, lessons and behaviors about its own
attempts; at 135M parameters much of it is noise, and under PMD's ``signal_rule="any"`` that
noise alone gives a row its teacher signal. Nothing in the paper checks an item before it
supervises the student; the neighbours that held up here each do (MEL keeps a lesson only if a
replay with it succeeds, Fast-Slow keeps a context only on the Pareto front of validation
reward).

The two candidates we weighed:

(a) a likelihood gate per row, no generation: on groups with verified successes and failures,
    the EMA teacher's log-likelihood margin of the right over the wrong responses with the
    memory context against SDPO's context. It needs a mixed group, which is exactly where
    SDPO already has a demonstration and memory matters least; it says nothing on all-fail
    groups, where the memory is the only possible signal; and a margin between two of the
    student's own responses is not what the distillation target is (the teacher's next-token
    distribution along the student's response), so it can be raised by text that makes the
    teacher worse at answering.
(b) replay admission per item (this module): the policy answers a problem in the teacher's
    own prompt format, once with the item in the context and once without, with paired
    sampling keys (same seed, prompt slot and sample index, so the two arms draw the same
    noise), and the verifier grades both. This measures what the teacher does with the item,
    on the problems it is shown for, with the current policy, and it works on all-fail groups.
    Its cost is generation (``replays`` paired samples per item test, one shared baseline arm
    per problem), bounded per step and counted. The replays sample from the sampler's weights
    (the current policy), of which the EMA teacher is a running average: the check asks
    whether the item helps the model the teacher is made of, not the teacher's exact weights.

Multiple testing: every step tests several items, each at a one-sided level near 5%, so an
item with no effect is sometimes admitted by chance; re-testing (``retest_every``) retires
most such items, and the random-memory control (``pmd_verified_random_memory``: the same check
on other problems' items) measures how often noise passes.

We chose (b). The statistic, per item, pools all its replay pairs (across steps and target
problems): a pair is a *win* when the with-item answer is correct and the without-item answer
is not, a *loss* the reverse, a tie otherwise (McNemar's discordant pairs). With ``n`` pairs,
``d = wins + losses`` and a one-sided Wilson bound ``[lo, hi]`` on the share of wins among
discordant pairs at ``z``, the effect (the change in solve rate) is estimated as
``(wins - losses) / n`` with the interval ``d / n * (2 lo - 1) .. d / n * (2 hi - 1)``. Ties
alone never admit an item.

The level: a step tests up to ``max_items_per_step`` items, so ``z`` is set for a one-sided 5%
over all of them (Bonferroni: ``z = 2.64`` for 12), not per test. At ``z = 1.645`` (5% per
test; our first setting) a seed-1 run of the SciQ grid admitted three copies of the behavior
"Fix this behavior with a specific action" on 4 wins out of 4 pairs at one problem: the item
arms of a step share one baseline arm, so a baseline that was unlucky on a problem makes every
item tested there look good at once, and the random-memory control admitted a noise item the
same way. At 2.64 it takes 7 wins and no loss (10 and 1, ...): at least two tests' worth of
pairs, so an admission needs the effect to hold at another step (a fresh baseline) too.

A second paired count tracks the answers that are not answers at all (the task's ``ok``
flag: for multiple choice, a reply that names no option): an item whose lower bound on the
*rise* in such answers is above zero is rejected whatever its reward effect, since a format
collapse was what PMD's teacher taught.

States (``Evidence.status``):

- ``pending``: tested too little to decide; never shown; tested again when next proposed.
- ``admitted``: lower bound above zero; shown. Re-tested when proposed again ``retest_every``
  steps after its last test; its pairs join the pool.
- ``rejected``: never shown again: its upper bound is at or below zero (it hurts or does
  nothing), it raises non-answers, or it reached ``max_pairs`` without being admitted.
- ``retired``: it was admitted and later evidence took its lower bound to zero or below;
  never shown again.

Evidence is keyed by the item's id and a hash of its text (a behavior rewritten by the
evolution prompt is a new item). The replays are graded attempts at the problem as well: the
loop (``teaching.check_memory``) shows a row that has no success to show its problem's first
successful replay (``replays_as_demonstrations``), so the samples the check spends also buy
what ``sdpo_matched_sampling``'s extra samples buy. Everything here is host-side
bookkeeping: the replays are generated by the loop (``pmd_jax.loop.teaching``) through the sampler
and graded by the task.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pmd_jax.memory.config import MemoryVerify

STATUSES = ("pending", "admitted", "rejected", "retired")


def evidence_key(docid: str, text: str) -> str:
    """The key of an item's evidence: its id and its text (a rewritten item starts afresh)."""
    return f"{docid}#{zlib.crc32(text.encode('utf-8')):08x}"


def wilson_bounds(k: int, n: int, z: float) -> tuple[float, float]:
    """Wilson score bounds of a binomial proportion ``k / n`` (``(0, 1)`` when ``n == 0``)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    z2 = z * z
    den = 1.0 + z2 / n
    mid = p + z2 / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, (mid - half) / den), min(1.0, (mid + half) / den)


def paired_effect(wins: int, losses: int, pairs: int, z: float) -> tuple[float, float, float]:
    """(estimate, low, high) of a paired difference of success rates from its discordant
    pairs (module doc): ``wins`` pairs where only the treated arm succeeded, ``losses`` where
    only the control arm did, out of ``pairs``."""
    if pairs <= 0:
        return 0.0, -1.0, 1.0
    d = wins + losses
    est = (wins - losses) / pairs
    if d == 0:
        return est, 0.0, 0.0
    lo, hi = wilson_bounds(wins, d, z)
    share = d / pairs
    return est, share * (2 * lo - 1), share * (2 * hi - 1)


# ----------------------------------------------------------------------------- sequential
# The level_sequential rule's test (ours): a betting e-process over discordant pairs. Each
# discordant pair is x = +1 (only the with-memory answer right) or -1 (only the other one);
# ties carry no information and are skipped. Under "it does not help" (P(win) <= P(loss)
# among discordant pairs) E[x] <= 0, so each factor 1 + lam * x (lam in [0, 1)) has
# expectation <= 1 and the wealth, their product, is a nonnegative supermartingale; so is
# the average over the fixed grid BET_FRACTIONS (a mixture: no bet size to tune). Ville's
# inequality: P(the wealth ever reaches 1 / alpha) <= alpha, however many pairs arrive and
# however often it is looked at (every step): evidence accumulates across steps with no
# per-step correction. The harm test is the same on -x.
BET_FRACTIONS = tuple(round(0.05 + 0.1 * i, 2) for i in range(10))


def new_wealth() -> list[float]:
    """The log-wealth of each bet fraction before any pair (wealth 1)."""
    return [0.0] * len(BET_FRACTIONS)


def bet(log_wealth: list[float], x: int) -> None:
    """One discordant pair's bet (x = +1 or -1; 0, a tie, changes nothing)."""
    if x:
        for i, lam in enumerate(BET_FRACTIONS):
            log_wealth[i] += math.log1p(lam * x)


def wealth(log_wealth: Sequence[float]) -> float:
    """The mixture's wealth: the mean of the bet fractions' wealths."""
    return sum(math.exp(w) for w in log_wealth) / len(log_wealth)


def pair_signs(w: bool, wo: bool, ok_w: bool, ok_wo: bool) -> tuple[int, int]:
    """(reward sign, invalid-answer sign) of one pair: +1 / -1 / 0 for the with-memory arm
    alone right / the other alone right / a tie; +1 when only the with-memory answer is
    invalid (the memory causes invalid answers), -1 the reverse."""
    return int(w and not wo) - int(wo and not w), int(ok_wo and not ok_w) - int(ok_w and not ok_wo)


def add_pairs(rec: Any, outcomes: Iterable[tuple[bool, bool, bool, bool]],
              help_wealth: list[float] | None = None) -> None:
    """Counts pairs ``(with_correct, without_correct, with_ok, without_ok)`` into ``rec`` (a
    LevelEvidence or Evidence: pairs, wins, losses, format counts) and bets them on its harm
    and invalid-answer tests, and on ``help_wealth`` when given."""
    for w, wo, ok_w, ok_wo in outcomes:
        x, y = pair_signs(w, wo, ok_w, ok_wo)
        rec.pairs += 1
        rec.wins += int(x > 0)
        rec.losses += int(x < 0)
        rec.format_wins += int(y < 0)
        rec.format_losses += int(y > 0)
        if help_wealth is not None:
            bet(help_wealth, x)
        bet(rec.harm, -x)
        bet(rec.format_harm, y)


@dataclasses.dataclass
class LevelEvidence:
    """level_sequential: the pooled replay record of one memory level (its items shown
    together, one arm per problem and step) and its anytime-valid tests."""

    level: str
    pairs: int = 0
    wins: int = 0
    losses: int = 0
    format_wins: int = 0
    format_losses: int = 0
    tests: int = 0
    help: list[float] = dataclasses.field(default_factory=new_wealth)
    harm: list[float] = dataclasses.field(default_factory=new_wealth)  # since admission
    format_harm: list[float] = dataclasses.field(default_factory=new_wealth)
    status: str = "pending"
    admitted_step: int = -1
    ended_step: int = -1
    last_tested_step: int = -1

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for k in ("help", "harm", "format_harm"):
            out[k] = wealth(out.pop(k))
        out["estimate"] = (self.wins - self.losses) / self.pairs if self.pairs else 0.0
        return out


@dataclasses.dataclass
class Evidence:
    """The paired replay record of one memory item (module doc)."""

    key: str
    level: str  # "insight" | "behavior"
    pairs: int = 0
    wins: int = 0  # only the with-item answer was correct
    losses: int = 0  # only the without-item answer was correct
    format_wins: int = 0  # only the with-item answer was a valid answer
    format_losses: int = 0  # only the without-item answer was a valid answer
    tests: int = 0
    first_tested_step: int = -1
    last_tested_step: int = -1
    status: str = "pending"
    admitted_step: int = -1
    ended_step: int = -1  # rejected / retired at
    problems: list[str] = dataclasses.field(default_factory=list)  # tested on (first 16)
    text: str = ""  # the item as shown (for memory.jsonl / memory.html)
    # level_sequential: its harm and invalid-answer tests when tested apart (log-wealth)
    harm: list[float] = dataclasses.field(default_factory=new_wealth)
    format_harm: list[float] = dataclasses.field(default_factory=new_wealth)

    def interval(self, z: float) -> tuple[float, float, float]:
        return paired_effect(self.wins, self.losses, self.pairs, z)

    def format_interval(self, z: float) -> tuple[float, float, float]:
        """The change in the rate of *invalid* answers (positive: the item causes them)."""
        return paired_effect(self.format_losses, self.format_wins, self.pairs, z)

    @property
    def visible(self) -> bool:
        return self.status == "admitted"

    @property
    def open(self) -> bool:
        """Whether it may still be tested (pending or admitted)."""
        return self.status in ("pending", "admitted")

    def to_json(self, z: float) -> dict[str, Any]:
        est, lo, hi = self.interval(z)
        fest, flo, _ = self.format_interval(z)
        out = dataclasses.asdict(self)
        out["harm"], out["format_harm"] = wealth(self.harm), wealth(self.format_harm)
        out.update(estimate=est, low=lo, high=hi, invalid_answer_effect=fest,
                   invalid_answer_low=flo)
        return out


class EvidenceStore:
    """Every item's :class:`Evidence`, the admission rule, and its per-step counters."""

    def __init__(self, cfg: MemoryVerify) -> None:
        self.cfg = cfg
        self.items: dict[str, Evidence] = {}
        # level_sequential: each level's pooled evidence, and the level of every item proposed
        self.levels: dict[str, LevelEvidence] = {}
        self.item_level: dict[str, str] = {}
        # level_sequential: items that have been in a replay arm (joint or apart): only those
        # are shown, so an item written after its level's admission is measured first
        self.measured: set[str] = set()

    @property
    def sequential(self) -> bool:
        return getattr(self.cfg, "rule", "item_wilson") == "level_sequential"

    @property
    def threshold(self) -> float:
        """level_sequential: the wealth at which a test decides (1 / alpha)."""
        return 1.0 / float(self.cfg.alpha)

    @property
    def z(self) -> float:
        return float(self.cfg.z)

    def get(self, key: str, level: str = "insight") -> Evidence:
        ev = self.items.get(key)
        if ev is None:
            ev = self.items[key] = Evidence(key, level)
        return ev

    def visible(self, key: str) -> bool:
        ev = self.items.get(key)
        if self.sequential:  # its level admitted, itself in a replay arm, and not dropped
            lv = self.levels.get(self.item_level.get(key, ""))
            return (lv is not None and lv.status == "admitted" and key in self.measured
                    and (ev is None or ev.status not in ("rejected", "retired")))
        return ev is not None and ev.visible

    # --------------------------------------------------------------- level_sequential --
    def level(self, name: str) -> LevelEvidence:
        lv = self.levels.get(name)
        if lv is None:
            lv = self.levels[name] = LevelEvidence(name)
        return lv

    def level_due(self, name: str, step: int) -> bool:
        """Whether a level's joint arms run at ``step``: every step while pending, every
        ``retest_every`` steps once admitted (0: never again), never once decided."""
        lv = self.levels.get(name)
        if lv is None or lv.status == "pending":
            return lv is None or lv.last_tested_step < step
        if lv.status == "admitted":
            every = int(self.cfg.retest_every)
            return every > 0 and step - lv.last_tested_step >= every
        return False

    def record_level(self, name: str, step: int,
                     outcomes: Iterable[tuple[bool, bool, bool, bool]]) -> str:
        """Adds one joint arm's pairs to level ``name`` and applies the rule: admitted when
        the help test's wealth reaches 1 / alpha (and the invalid-answer test has not);
        rejected (pending) or retired (admitted) when the harm test's does (the harm test
        restarts at admission) or the invalid-answer test's does (check_format). Returns
        the transition or ""."""
        lv = self.level(name)
        if lv.status not in ("pending", "admitted"):
            raise ValueError(f"level {name!r} is {lv.status}: it is not tested any more")
        add_pairs(lv, outcomes, lv.help)
        lv.tests += 1
        lv.last_tested_step = int(step)
        thr = self.threshold
        bad_format = bool(self.cfg.check_format) and wealth(lv.format_harm) >= thr
        if lv.status == "pending":
            if wealth(lv.help) >= thr and not bad_format:
                lv.status, lv.admitted_step = "admitted", int(step)
                lv.harm = new_wealth()  # a fresh test of harm from here on
                return "admitted"
            if bad_format or wealth(lv.harm) >= thr:
                lv.status, lv.ended_step = "rejected", int(step)
                return "rejected"
            return ""
        if bad_format or wealth(lv.harm) >= thr:
            lv.status, lv.ended_step = "retired", int(step)
            return "retired"
        return ""

    def record_apart(self, key: str, level: str, step: int, problem_id: str,
                     outcomes: Iterable[tuple[bool, bool, bool, bool]], text: str = "") -> str:
        """An item of an admitted level tested alone: its pairs, and "rejected" when its own
        harm (or invalid-answer) test reaches 1 / alpha; else ""."""
        ev = self.get(key, level)
        if text and not ev.text:
            ev.text = text
        if not ev.open:
            raise ValueError(f"evidence {key!r} is {ev.status}: it is not tested any more")
        add_pairs(ev, outcomes)
        ev.tests += 1
        if ev.first_tested_step < 0:
            ev.first_tested_step = int(step)
        ev.last_tested_step = int(step)
        if problem_id not in ev.problems and len(ev.problems) < 16:
            ev.problems.append(problem_id)
        thr = self.threshold
        if wealth(ev.harm) >= thr or (bool(self.cfg.check_format)
                                      and wealth(ev.format_harm) >= thr):
            ev.status, ev.ended_step = "rejected", int(step)
            return "rejected"
        return ""

    def due(self, key: str, step: int) -> bool:
        """Whether an item proposed at ``step`` should be tested now."""
        ev = self.items.get(key)
        if ev is None or ev.status == "pending":
            return ev is None or ev.last_tested_step < step
        if ev.status == "admitted":
            every = int(self.cfg.retest_every)
            return every > 0 and step - ev.last_tested_step >= every
        return False

    def record(self, key: str, level: str, step: int, problem_id: str,
               outcomes: Iterable[tuple[bool, bool, bool, bool]], text: str = "") -> str:
        """Adds one test's pairs ``(with_correct, without_correct, with_ok, without_ok)`` and
        applies the rule; returns the transition (``"admitted"``, ``"rejected"``,
        ``"retired"``, or ``""`` for none)."""
        ev = self.get(key, level)
        if text and not ev.text:
            ev.text = text
        if not ev.open:
            raise ValueError(f"evidence {key!r} is {ev.status}: it is not tested any more")
        for w, wo, ok_w, ok_wo in outcomes:
            ev.pairs += 1
            ev.wins += int(w and not wo)
            ev.losses += int(wo and not w)
            ev.format_wins += int(ok_w and not ok_wo)
            ev.format_losses += int(ok_wo and not ok_w)
        ev.tests += 1
        if ev.first_tested_step < 0:
            ev.first_tested_step = int(step)
        ev.last_tested_step = int(step)
        if problem_id not in ev.problems and len(ev.problems) < 16:
            ev.problems.append(problem_id)
        return self._decide(ev, step)

    def _decide(self, ev: Evidence, step: int) -> str:
        z = self.z
        _, lo, hi = ev.interval(z)
        _, flo, _ = ev.format_interval(z)
        harms_format = bool(self.cfg.check_format) and flo > 0.0
        if ev.status == "admitted":
            if lo <= 0.0 or harms_format:
                ev.status, ev.ended_step = "retired", int(step)
                return "retired"
            return ""
        if lo > 0.0 and not harms_format:
            ev.status, ev.admitted_step = "admitted", int(step)
            return "admitted"
        # hi <= 0 (with at least one discordant pair: all ties leave hi at 0 too) or format
        # harm: rejected at once; otherwise after max_pairs pairs without admission.
        if harms_format or (hi <= 0.0 and ev.wins + ev.losses > 0) or \
                ev.pairs >= int(self.cfg.max_pairs):
            ev.status, ev.ended_step = "rejected", int(step)
            return "rejected"
        return ""

    def counts(self) -> dict[str, int]:
        """Items per status; with level_sequential an item proposed and not dropped counts
        as admitted while its level is, as pending otherwise, and the levels' statuses are
        counted too (``levels_<status>``)."""
        out = dict.fromkeys(STATUSES, 0)
        if not self.sequential:
            for ev in self.items.values():
                out[ev.status] += 1
            return out
        for key in self.item_level:
            item = self.items.get(key)
            if item is not None and item.status in ("rejected", "retired"):
                out[item.status] += 1
            else:
                out["admitted" if self.visible(key) else "pending"] += 1
        for st in STATUSES:
            out[f"levels_{st}"] = sum(lv.status == st for lv in self.levels.values())
        return out

    # --------------------------------------------------------------------- state --
    def state_dict(self) -> dict[str, Any]:
        return {"items": [dataclasses.asdict(ev) for ev in self.items.values()],
                "levels": [dataclasses.asdict(lv) for lv in self.levels.values()],
                "item_level": dict(self.item_level), "measured": sorted(self.measured)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.items, self.levels = {}, {}
        for d in (state or {}).get("items", []):
            ev = Evidence(**{**d, "problems": list(d.get("problems", []))})
            self.items[ev.key] = ev
        for d in (state or {}).get("levels", []):  # (absent before level_sequential)
            lv = LevelEvidence(**d)
            self.levels[lv.level] = lv
        self.item_level = dict((state or {}).get("item_level", {}))
        self.measured = set((state or {}).get("measured", []))


# ----------------------------------------------------------------------------- the check
@dataclasses.dataclass(frozen=True)
class Proposal:
    """One memory item proposed for the teacher contexts of one problem of the step."""

    key: str
    level: str
    section: str  # the TeacherContext list section it goes to
    value: Any  # its entry there (a str, or a (name, instruction) pair)


# (correct, ok) of one replay sample; an arm is (problem index, section, value): the section
# and value of the item in the context, (None, None) for the baseline without memory, or
# (JOINT, ((section, value), ...)) for several items shown together (level_sequential). A
# call's arms are sampled as prompts 0, 1, ... of one generate call, in list order.
Outcome = tuple[bool, bool]
Arm = tuple[int, str | None, Any]
RunArms = Callable[[list[Arm]], list[list[Outcome]]]
JOINT = "*"


def item_text(value: Any) -> str:
    """An item's text as shown: a behavior's (name, instruction) as "name: instruction"."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return f"{value[0]}: {value[1]}"
    return str(value)


def select_tests(store: EvidenceStore, step: int,
                 proposals: Sequence[Sequence[Proposal]]) -> list[list[Proposal]]:
    """Which proposed items to test now, per problem (module doc): due items only, untested
    ones first, then the longest untested; at most ``max_items_per_problem`` per problem and
    ``max_items_per_step`` in all, taken round-robin over the problems."""
    cfg = store.cfg

    def rank(p: Proposal) -> tuple[int, int]:
        ev = store.items.get(p.key)
        return (0, 0) if ev is None else (1, ev.last_tested_step)

    queues: list[list[Proposal]] = []
    seen: set[str] = set()
    for props in proposals:
        q = []
        for p in props:
            if p.key not in seen and store.due(p.key, step):
                seen.add(p.key)
                q.append(p)
        q.sort(key=rank)
        queues.append(q[: int(cfg.max_items_per_problem)])
    out: list[list[Proposal]] = [[] for _ in queues]
    budget = int(cfg.max_items_per_step)
    depth = 0
    while budget > 0 and any(depth < len(q) for q in queues):
        for i, q in enumerate(queues):
            if depth < len(q) and budget > 0:
                out[i].append(q[depth])
                budget -= 1
        depth += 1
    return out


def check_before_use(store: EvidenceStore, step: int, problem_ids: Sequence[str],
                     proposals: Sequence[Sequence[Proposal]], run_arms: RunArms
                     ) -> dict[str, int]:
    """Tests the due items of this step's problems with paired replays and updates their
    evidence; returns the step's counts (``tested``, ``admitted``, ``rejected``,
    ``retired``, ``calls``, ``arms``).

    ``proposals[i]``: the items proposed for problem ``problem_ids[i]``. ``run_arms`` runs
    one generate call over a list of arms (``replays`` samples each, sampling keys folded
    from the arm's position and the sample index, the same seed in every call of the step)
    and grades them. Calls are slots: slot 0 holds every tested problem's baseline (no
    memory), slot k the k-th tested item of each problem. Problems are ordered by how many
    items they test (most first), so the problems of slot k are a prefix of slot 0's and each
    item's arm sits at the same position as its problem's baseline: a pair shares its keys.
    """
    if store.sequential:
        return _check_levels(store, step, problem_ids, proposals, run_arms)
    tests = select_tests(store, step, proposals)
    order = sorted((i for i, t in enumerate(tests) if t), key=lambda i: -len(tests[i]))
    counts = dict.fromkeys(("tested", "admitted", "rejected", "retired", "calls", "arms"), 0)
    if not order:
        return counts
    base = run_arms([(i, None, None) for i in order])
    counts["calls"] += 1
    counts["arms"] += len(order)
    for k in range(len(tests[order[0]])):
        slot = [i for i in order if k < len(tests[i])]  # a prefix of ``order``
        arms: list[Arm] = [(i, tests[i][k].section, tests[i][k].value) for i in slot]
        got = run_arms(arms)
        counts["calls"] += 1
        counts["arms"] += len(arms)
        for pos, i in enumerate(slot):
            p = tests[i][k]
            pairs = [(w[0], wo[0], w[1], wo[1]) for w, wo in zip(got[pos], base[pos],
                                                                strict=True)]
            moved = store.record(p.key, p.level, step, problem_ids[i], pairs,
                                 text=item_text(p.value))
            counts["tested"] += 1
            if moved:
                counts[moved] += 1
    return counts


def _run_slots(arms_of: list[list[Arm]], run_arms: RunArms, counts: dict[str, int]
               ) -> tuple[list[int], list[list[Outcome]], list[list[list[Outcome]]]]:
    """Runs each listed problem's baseline and arms as slots (call 0: the baselines; call k:
    each problem's k-th arm), problems ordered by how many arms they have (most first) so
    that every call's problems are a prefix of the baselines' and each arm sits at its
    problem's baseline position (the same sampling keys). Returns the order, the baselines'
    outcomes and each problem's arms' outcomes (by problem index)."""
    order = sorted((i for i, a in enumerate(arms_of) if a), key=lambda i: -len(arms_of[i]))
    got: list[list[list[Outcome]]] = [[] for _ in arms_of]
    if not order:
        return order, [], got
    base = run_arms([(i, None, None) for i in order])
    counts["calls"] += 1
    counts["arms"] += len(order)
    for k in range(len(arms_of[order[0]])):
        slot = [i for i in order if k < len(arms_of[i])]
        out = run_arms([arms_of[i][k] for i in slot])
        counts["calls"] += 1
        counts["arms"] += len(slot)
        for pos, i in enumerate(slot):
            got[i].append(out[pos])
    return order, base, got


def _check_levels(store: EvidenceStore, step: int, problem_ids: Sequence[str],
                  proposals: Sequence[Sequence[Proposal]], run_arms: RunArms
                  ) -> dict[str, int]:
    """level_sequential (module doc of the rule at ``BET_FRACTIONS``): together, then apart.

    Together: for each problem and each level whose test is due, one joint arm with every
    item proposed for that problem at that level, in the order the context shows them; its
    pairs with the problem's baseline go to the level's pooled test. Apart: the items of an
    admitted level, each alone (due, untested first, within ``max_items_per_problem`` and
    ``max_items_per_step``), into the item's own harm test. Counts: ``level_tested``,
    ``level_admitted`` / ``level_rejected`` / ``level_retired``, and for items ``tested``
    (apart) and ``rejected``; ``calls`` and ``arms`` as for the per-item rule."""
    counts = dict.fromkeys(("tested", "admitted", "rejected", "retired", "calls", "arms",
                            "level_tested", "level_admitted", "level_rejected",
                            "level_retired"), 0)
    for props in proposals:
        for p in props:
            store.item_level.setdefault(p.key, p.level)
    due = {lv for props in proposals for lv in {p.level for p in props}
           if store.level_due(lv, step)}
    joint: list[list[tuple[str, Arm]]] = [[] for _ in proposals]
    for i, props in enumerate(proposals):
        for lv in sorted({p.level for p in props} & due):
            items = tuple((p.section, p.value) for p in props if p.level == lv)
            joint[i].append((lv, (i, JOINT, items)))
    # apart: items of admitted levels, not yet decided alone (the per-item queue rules)
    admitted = {name for name, lv in store.levels.items() if lv.status == "admitted"}
    apart_props = [[p for p in props if p.level in admitted] for props in proposals]
    apart = select_tests(store, step, apart_props)
    # the step's arms stay within max_items_per_step: the joint arms first, then apart ones
    room = int(store.cfg.max_items_per_step) - sum(len(j) for j in joint)
    for i in range(len(apart)):
        keep = max(0, min(len(apart[i]), room))
        apart[i], room = apart[i][:keep], room - keep
    arms_of: list[list[Arm]] = [[a for _, a in joint[i]] + [(i, p.section, p.value)
                                                             for p in apart[i]]
                                for i in range(len(proposals))]
    order, base, got = _run_slots(arms_of, run_arms, counts)
    if not order:
        return counts
    pos_of = {i: pos for pos, i in enumerate(order)}
    for i in order:
        b = base[pos_of[i]]
        for k, (lv, _) in enumerate(joint[i]):
            pairs = [(w[0], wo[0], w[1], wo[1]) for w, wo in zip(got[i][k], b, strict=True)]
            if store.level(lv).status not in ("pending", "admitted"):
                continue  # decided earlier in this step (another problem's pairs)
            moved = store.record_level(lv, step, pairs)
            store.measured.update(p.key for p in proposals[i] if p.level == lv)
            counts["level_tested"] += 1
            if moved:
                counts[f"level_{moved}"] += 1
        for k, p in enumerate(apart[i], start=len(joint[i])):
            pairs = [(w[0], wo[0], w[1], wo[1]) for w, wo in zip(got[i][k], b, strict=True)]
            moved = store.record_apart(p.key, p.level, step, problem_ids[i], pairs,
                                       text=item_text(p.value))
            store.measured.add(p.key)
            counts["tested"] += 1
            if moved:
                counts[moved] += 1
    return counts
