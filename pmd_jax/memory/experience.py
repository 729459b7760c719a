"""Level 1, experience: every rollout with provenance, and the latest successes per problem.

Eviction policy (bounded size):
- per problem at most ``max_records_per_problem`` records: the oldest *failure* of that problem
  goes first; only when it holds successes alone does its oldest success go;
- globally at most ``max_records``: the globally oldest record (insertion order) goes;
- the last few successes per problem (``SUCCESSES_KEPT``) are kept apart from these records
  and survive their eviction, so a problem solved long ago still has a remembered attempt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pmd_jax.memory.sanitize import sanitize_text
from pmd_jax.memory.types import ExperienceItem, RolloutRecord

SUCCESSES_KEPT = 4
MAX_PROBLEM_CHARS = 20_000


def experience_docid(problem_id: str, step: int, rollout_index: int) -> str:
    return f"exp/{problem_id}/{step}/{rollout_index}"


class ExperienceStore:
    def __init__(self, cfg: Any, success_threshold: float, extra_tokens: Sequence[str] = ()):
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
