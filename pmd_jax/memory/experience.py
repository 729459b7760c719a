"""Level 1, experience: every rollout with provenance, and the latest successes per problem.

Eviction policy (bounded size):
- per problem at most ``max_records_per_problem`` records: the oldest *failure* of that problem
  goes first; only when it holds successes alone does its oldest success go;
- globally at most ``max_records``: the globally oldest record (insertion order) goes;
- the last few successes per problem (``SUCCESSES_KEPT``) are kept apart from these records
  and survive their eviction, so a problem solved long ago still has a remembered attempt.

As a memory level (:class:`ExperienceLevel`) it stores every rollout even when switched off
(``memory.levels.experience`` only gates the teacher context): the other levels read its
problem texts, gold-leak strings and success rates. In a teacher context it fills the
"Correct solution" part with the latest remembered success when no sibling's is given (in
control mode "random_other_problem", another problem's, only where the mode shows one).
"""

from __future__ import annotations

import html
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pmd_jax.memory.context import TeacherContext
from pmd_jax.memory.level import ContextQuery, LevelHost, MemoryLevel, StepRollouts
from pmd_jax.memory.sanitize import sanitize_text
from pmd_jax.memory.types import ExperienceItem, MemoryUpdateStats, RolloutRecord

if TYPE_CHECKING:
    from pmd_jax.memory.config import MemoryExperience

SUCCESSES_KEPT = 4
MAX_PROBLEM_CHARS = 20_000


def experience_docid(problem_id: str, step: int, rollout_index: int) -> str:
    return f"exp/{problem_id}/{step}/{rollout_index}"


class ExperienceStore:
    def __init__(self, cfg: MemoryExperience, success_threshold: float,
                 extra_tokens: Sequence[str] = ()):
        self.cfg = cfg
        self.success_threshold = float(success_threshold)
        self.extra_tokens = tuple(extra_tokens)
        self.items: OrderedDict[str, ExperienceItem] = OrderedDict()
        self.by_problem: dict[str, list[str]] = {}
        self.successes: dict[str, list[ExperienceItem]] = {}
        self.problem_text: dict[str, str] = {}
        self.leak_strings: dict[str, list[str]] = {}
        self.seq = 0

    def add(self, records: Sequence[RolloutRecord]) -> dict[str, int]:
        counts = {"records_added": 0, "records_evicted": 0}
        for r in records:
            pid = r.problem_id
            self.problem_text[pid] = str(r.problem_text)[:MAX_PROBLEM_CHARS]
            leaks = [s for s in r.leak_strings if isinstance(s, str) and s.strip()]
            if leaks:
                known = self.leak_strings.setdefault(pid, [])
                known.extend(s for s in leaks if s not in known)
            docid = experience_docid(pid, r.step, r.rollout_index)
            reward = float(r.reward)
            item = ExperienceItem(
                docid=docid, problem_id=pid, step=int(r.step), rollout_index=int(r.rollout_index),
                response_text=sanitize_text(r.response_text, self.cfg.max_response_chars,
                                            self.extra_tokens),
                reward=reward,
                feedback=sanitize_text(r.feedback or "", self.cfg.max_feedback_chars,
                                       self.extra_tokens),
                success=reward >= self.success_threshold, seq=self.seq,
            )
            self.seq += 1
            if docid in self.items:
                self._remove(docid)
            self.items[docid] = item
            self.by_problem.setdefault(pid, []).append(docid)
            counts["records_added"] += 1
            if item.success:
                kept = [s for s in self.successes.get(pid, []) if s.docid != docid] + [item]
                kept.sort(key=lambda s: (s.step, s.seq))
                self.successes[pid] = kept[-SUCCESSES_KEPT:]
            counts["records_evicted"] += self._evict_problem(pid)
        while len(self.items) > self.cfg.max_records:
            oldest = next(iter(self.items))
            self._remove(oldest)
            counts["records_evicted"] += 1
        return counts

    def _remove(self, docid: str) -> None:
        item = self.items.pop(docid)
        ids = self.by_problem.get(item.problem_id, [])
        if docid in ids:
            ids.remove(docid)
        if not ids:
            self.by_problem.pop(item.problem_id, None)

    def _evict_problem(self, pid: str) -> int:
        n = 0
        ids = self.by_problem.get(pid, [])
        while len(ids) > self.cfg.max_records_per_problem:
            fails = [d for d in ids if not self.items[d].success]
            victim = min(fails or ids, key=lambda d: self.items[d].seq)
            self._remove(victim)
            ids = self.by_problem.get(pid, [])
            n += 1
        return n

    def records(self, pid: str) -> list[ExperienceItem]:
        return [self.items[d] for d in self.by_problem.get(pid, [])]

    def remembered_success(self, pid: str, before_step: int | None) -> ExperienceItem | None:
        """The latest remembered success, from a step < ``before_step`` when given."""
        for s in reversed(self.successes.get(pid, [])):
            if before_step is None or s.step < before_step:
                return s
        return None

    def success_rate(self, pid: str) -> float:
        recs = self.records(pid)
        return sum(r.success for r in recs) / len(recs) if recs else 0.0

    # --------------------------------------------------------------------- state --
    @staticmethod
    def _item_json(it: ExperienceItem) -> dict[str, Any]:
        return dict(it.__dict__)

    def state_dict(self) -> dict[str, Any]:
        return dict(
            items=[self._item_json(it) for it in self.items.values()],
            successes={p: [self._item_json(s) for s in v] for p, v in self.successes.items()},
            problem_text=dict(self.problem_text),
            leak_strings={p: list(v) for p, v in self.leak_strings.items()},
            seq=self.seq,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.items = OrderedDict()
        self.by_problem = {}
        for d in state["items"]:
            it = ExperienceItem(**d)
            self.items[it.docid] = it
            self.by_problem.setdefault(it.problem_id, []).append(it.docid)
        self.successes = {p: [ExperienceItem(**d) for d in v]
                          for p, v in state["successes"].items()}
        self.problem_text = dict(state["problem_text"])
        self.leak_strings = {p: list(v) for p, v in state["leak_strings"].items()}
        self.seq = int(state["seq"])


class ExperienceLevel(MemoryLevel):
    """Level 1 of :class:`~pmd_jax.memory.memory.ProceduralMemory` (memory/level.py)."""

    name = "experience"
    state_key = "experience"
    context_rank = 30  # after insight and behavior: the teacher text's order of parts

    def __init__(self, memory: LevelHost) -> None:
        super().__init__(memory)
        c = memory.config
        self.store = ExperienceStore(c.experience, c.success_threshold, memory.extra_tokens)

    def update(self, batch: StepRollouts, stats: MemoryUpdateStats) -> float:
        stats.merge(self.store.add(batch.records))  # always: the other levels read it
        return 0.0

    def _before(self) -> int | None:
        mem = self.memory
        return (mem.last_update_step
                if mem.config.experience.remembered_success_previous_steps_only else None)

    def _show(self, ctx: TeacherContext, item: Any) -> None:
        cx, toks = self.memory.config.context, self.memory.extra_tokens
        succ = sanitize_text(item.response_text, cx.max_attempt_chars, toks,
                             drop_thinking=cx.strip_thinking)
        if succ:
            ctx.successful_attempt = succ
            ctx.successful_attempt_source = "memory"
            ctx.provenance.append(dict(item=item.docid, **item.provenance().to_json()))

    def fill_context(self, ctx: TeacherContext, query: ContextQuery) -> None:
        """The latest remembered success, unless a sibling's is shown (or it is the student's
        own response)."""
        if ctx.successful_attempt or not self.enabled:
            return
        c, toks = self.memory.config, self.memory.extra_tokens
        item = self.store.remembered_success(query.problem_id, self._before())
        if item is not None and query.student_response is not None and (
                item.response_text == sanitize_text(query.student_response,
                                                     c.experience.max_response_chars, toks)):
            item = None
        if item is not None:
            self._show(ctx, item)

    def fill_control(self, ctx: TeacherContext, real: TeacherContext,
                     query: ContextQuery) -> None:
        """Control "random_other_problem": a remembered success of another problem, only where
        the mode shows a remembered success (a sibling's is SDPO's signal: kept as is)."""
        if (ctx.successful_attempt or not self.enabled or query.rng is None
                or real.successful_attempt_source != "memory"):
            return
        before = self._before()
        others = sorted(p for p in self.store.successes if p != query.problem_id
                        and self.store.remembered_success(p, before) is not None)
        if others:
            pid = others[int(query.rng.integers(len(others)))]
            self._show(ctx, self.store.remembered_success(pid, before))

    def stats(self) -> dict[str, Any]:
        st = self.store
        return dict(
            experience_records=len(st.items),
            experience_problems=len(st.by_problem),
            problems_with_success=sum(1 for v in st.successes.values() if v),
        )

    def export_rows(self) -> Iterator[dict[str, Any]]:
        for it in self.store.items.values():
            yield dict(level="experience", **it.__dict__)

    def html_problems(self) -> set[str]:
        return set(self.store.successes)

    def html_problem(self, problem_id: str) -> list[str]:
        s = self.store.remembered_success(problem_id, None)
        if s is None:
            return []
        e = html.escape
        return [f"<details><summary>latest success (step {s.step}, rollout "
                f"{s.rollout_index})</summary><pre>{e(s.response_text[:2000])}</pre>"
                "</details>"]
