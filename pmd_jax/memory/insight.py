"""Level 2, insight: the policy reflects on each touched problem's attempts.

Per problem and step: one reflection conversation showing up to ``max_attempts_shown`` correct
and incorrect attempts (contrasted when both exist), stating the reflection schema's bounds
(memory/schemas.py: items per list, characters per item). The reply is parsed defensively,
validated against that schema (``parsed`` / ``json_error`` / ``schema_error``), and its valid
items salvaged into strategies and lessons, then filtered:

- strategies are kept only if a shown attempt is a verified success, lessons only if a shown
  attempt is a verified failure (switchable);
- items containing a gold-leak string (option letter, expected output; for multiple choice
  every option's text, the distractors' too) are dropped;
- near-duplicates (cosine >= ``dedup_threshold`` with an item of the same problem and kind, or
  with an earlier item of the same reply) are not added; the existing item's support grows.
  ``dedup="exact"`` compares case- and space-normalised text instead (no embedder calls).

Per problem at most ``max_strategies_per_problem`` / ``max_lessons_per_problem`` items; the
least recently confirmed (then least supported) item is evicted first.

As a memory level (:class:`InsightLevel`) it fills the teacher context's strategies and
lessons of the rollout's problem, written from earlier steps than the rollout's (never from its
own attempt); in control mode "random_other_problem" as many items of each kind, drawn from
other problems.
"""

from __future__ import annotations

import html
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pmd_jax.memory import prompts
from pmd_jax.memory.calls import call_params, generate_first
from pmd_jax.memory.context import TeacherContext
from pmd_jax.memory.index import ScannIndex
from pmd_jax.memory.level import ContextQuery, LevelHost, MemoryLevel, StepRollouts
from pmd_jax.memory.parsing import parse_reflection
from pmd_jax.memory.sanitize import leaks_gold, resanitize, sanitize_text
from pmd_jax.memory.schemas import reflection_schema
from pmd_jax.memory.types import InsightItem, MemoryUpdateStats, Provenance, RolloutRecord
from pmd_jax.memory.verify import evidence_key

if TYPE_CHECKING:
    from pmd_jax.memory.config import MemoryIndex, MemoryInsight

KINDS = ("strategy", "lesson")


def select_attempts(
    records: Sequence[RolloutRecord], max_each: int, threshold: float
) -> tuple[list[RolloutRecord], list[RolloutRecord]]:
    good = [r for r in records if float(r.reward) >= threshold][:max_each]
    bad = [r for r in records if float(r.reward) < threshold][:max_each]
    return good, bad


def reflection_conversation(
    problem_text: str,
    good: Sequence[RolloutRecord],
    bad: Sequence[RolloutRecord],
    cfg: MemoryInsight,
    extra_tokens: Sequence[str] = (),
) -> list[dict[str, str]]:
    blocks = []
    for n, r in enumerate(list(good) + list(bad), 1):
        verdict = prompts.VERDICT_CORRECT if n <= len(good) else prompts.VERDICT_INCORRECT
        fb = sanitize_text(r.feedback or "", cfg.max_attempt_chars // 2, extra_tokens)
        blocks.append(prompts.REFLECTION_ATTEMPT.format(
            n=n, verdict=verdict, reward=float(r.reward),
            response=sanitize_text(r.response_text, cfg.max_attempt_chars, extra_tokens,
                                   drop_thinking=True) or "(empty)",
            feedback=prompts.REFLECTION_FEEDBACK.format(feedback=fb) if fb else "",
        ))
    user = prompts.REFLECTION_USER.format(
        problem=sanitize_text(problem_text, cfg.max_problem_chars, extra_tokens),
        attempts="\n\n".join(blocks) if blocks else prompts.REFLECTION_NO_ATTEMPTS,
        contrast=prompts.REFLECTION_CONTRAST if good and bad else "",
        items=prompts.count_range(cfg.min_items_per_reflection, cfg.max_items_per_reflection)
        + " items",
        chars=prompts.count_range(cfg.min_item_chars, cfg.max_item_chars),
    )
    return [{"role": "system", "content": prompts.REFLECTION_SYSTEM},
            {"role": "user", "content": user}]


class InsightStore:
    def __init__(self, cfg: MemoryInsight, success_threshold: float, dim: int,
                 index_cfg: MemoryIndex,
                 extra_tokens: Sequence[str] = ()):
        self.cfg = cfg
        self.success_threshold = float(success_threshold)
        self.extra_tokens = tuple(extra_tokens)
        self.items: dict[str, InsightItem] = {}
        self.by_problem: dict[str, dict[str, list[str]]] = {}
        self.index = ScannIndex(dim, index_cfg)  # vectors of every item, keyed by docid
        self.next_id = 0

    def ids(self, pid: str, kind: str) -> list[str]:
        return self.by_problem.get(pid, {}).get(kind, [])

    def texts(self, pid: str, kind: str) -> list[str]:
        return [self.items[d].text for d in self.ids(pid, kind)]

    def problems(self) -> list[str]:
        return [p for p, v in self.by_problem.items() if v.get("strategy") or v.get("lesson")]

    def ingest(
        self,
        step: int,
        replies: dict[str, str],
        shown: dict[str, tuple[list[RolloutRecord], list[RolloutRecord]]],
        leak_strings: dict[str, list[str]],
        embed: Callable[[list[str]], np.ndarray],
    ) -> Counter:
        """Parses each problem's reply, filters, dedups and stores the surviving items.

        Each reply counts one of ``parsed`` / ``json_error`` / ``schema_error`` (validated
        against :func:`~pmd_jax.memory.schemas.reflection_schema`); the caller counts
        ``reflections`` and ``truncated`` (memory/calls.py).
        """
        counts: Counter = Counter()
        candidates: list[tuple[str, str, str, Provenance]] = []  # pid, kind, text, prov
        schema = reflection_schema(self.cfg)
        for pid, reply in replies.items():
            good, bad = shown[pid]
            strategies, lessons = parse_reflection(
                reply, counts, max_item_chars=self.cfg.max_item_chars,
                min_item_chars=self.cfg.min_item_chars,
                max_items=self.cfg.max_items_per_reflection, extra_tokens=self.extra_tokens,
                schema=schema)
            if self.cfg.strategies_only_from_successes and not good and strategies:
                counts["strategies_without_success"] += len(strategies)
                strategies = []
            if self.cfg.lessons_only_from_failures and not bad and lessons:
                counts["lessons_without_failure"] += len(lessons)
                lessons = []
            shown_recs = list(good) + list(bad)
            prov = Provenance("reflection", int(step), (pid,),
                              tuple(int(r.rollout_index) for r in shown_recs),
                              tuple(float(r.reward) for r in shown_recs))
            leaks = leak_strings.get(pid, [])
            for kind, items in (("strategy", strategies), ("lesson", lessons)):
                for text in items:
                    if self.cfg.drop_gold_leaks and leaks_gold(text, leaks):
                        counts["gold_leak"] += 1
                        continue
                    candidates.append((pid, kind, text, prov))
        if not candidates:
            return counts
        exact = self.cfg.dedup == "exact"
        if exact:
            vecs = np.zeros((len(candidates), self.index.dim), np.float32)
        else:
            vecs = embed([c[2] for c in candidates])
        new_ids: list[str] = []
        new_vecs: list[np.ndarray] = []
        pending: dict[tuple[str, str], list[tuple[str, np.ndarray]]] = {}
        for (pid, kind, text, prov), v in zip(candidates, vecs):
            hit = self._duplicate_of(pid, kind, text, v, pending.setdefault((pid, kind), []))
            if hit is not None:
                hit.support += 1
                hit.last_step = int(step)
                counts["duplicates"] += 1
                continue
            docid = f"ins/{pid}/{kind}/{self.next_id}"
            self.next_id += 1
            self.items[docid] = InsightItem(docid, pid, kind, text, prov, 1, int(step))
            self.by_problem.setdefault(pid, {}).setdefault(kind, []).append(docid)
            pending[(pid, kind)].append((docid, v))
            if not exact:
                new_ids.append(docid)
                new_vecs.append(v)
            counts[f"{kind}_added"] += 1
        if new_ids:
            self.index.upsert(new_ids, np.stack(new_vecs))
        evicted = self._evict()
        counts["insights_evicted"] += len(evicted)
        return counts

    def _duplicate_of(self, pid: str, kind: str, text: str, v: np.ndarray,
                      pending: list[tuple[str, np.ndarray]]) -> InsightItem | None:
        """The stored (or just added) item of this problem and kind that ``text`` repeats."""
        if self.cfg.dedup == "exact":
            key = " ".join(text.casefold().split())
            for d in self.ids(pid, kind):
                if " ".join(self.items[d].text.casefold().split()) == key:
                    return self.items[d]
            return None
        existing = [d for d in self.ids(pid, kind) if d in self.index]
        pool_ids = existing + [d for d, _ in pending]
        if not pool_ids:
            return None
        pool = np.concatenate([self.index.matrix(existing).reshape(-1, v.shape[0]),
                               np.array([pv for _, pv in pending]).reshape(-1, v.shape[0])])
        sims = pool @ v
        j = int(np.argmax(sims))
        return self.items[pool_ids[j]] if sims[j] >= self.cfg.dedup_threshold else None

    def _evict(self) -> list[str]:
        caps = {"strategy": self.cfg.max_strategies_per_problem,
                "lesson": self.cfg.max_lessons_per_problem}
        gone: list[str] = []
        for pid, kinds in self.by_problem.items():
            for kind, ids in kinds.items():
                while len(ids) > caps[kind]:
                    victim = min(ids, key=lambda d: (self.items[d].last_step,
                                                     self.items[d].support))
                    ids.remove(victim)
                    del self.items[victim]
                    gone.append(victim)
        self.index.delete(gone)
        return gone

    # --------------------------------------------------------------------- state --
    def state_dict(self) -> dict[str, Any]:
        return dict(
            items=[dict(docid=i.docid, problem_id=i.problem_id, kind=i.kind, text=i.text,
                        provenance=i.provenance.to_json(), support=i.support,
                        last_step=i.last_step) for i in self.items.values()],
            order={p: {k: list(v) for k, v in kinds.items()}
                   for p, kinds in self.by_problem.items()},
            index=self.index.state_dict(), next_id=self.next_id,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.items = {}
        for d in state["items"]:
            d = dict(d)
            d["provenance"] = Provenance.from_json(d["provenance"])
            it = InsightItem(**d)
            self.items[it.docid] = it
        self.by_problem = {p: {k: list(v) for k, v in kinds.items()}
                           for p, kinds in state["order"].items()}
        self.index.load_state_dict(state["index"])
        self.next_id = int(state["next_id"])


class InsightLevel(MemoryLevel):
    """Level 2 of :class:`~pmd_jax.memory.memory.ProceduralMemory` (memory/level.py)."""

    name = "insight"
    state_key = "insights"
    context_rank = 10  # strategies and lessons come first in the teacher text

    def __init__(self, memory: LevelHost) -> None:
        super().__init__(memory)
        c = memory.config
        self.store = InsightStore(c.insight, c.success_threshold, memory.dim, c.index,
                                  memory.extra_tokens)

    def update(self, batch: StepRollouts, stats: MemoryUpdateStats) -> float:
        """One reflection per problem of this step; returns the seconds spent generating."""
        if not (self.enabled and batch.by_problem):
            return 0.0
        mem = self.memory
        c, exp = mem.config, mem.experience
        shown = {p: select_attempts(rs, c.insight.max_attempts_shown, c.success_threshold)
                 for p, rs in batch.by_problem.items()}
        pids = list(batch.by_problem)
        convs = [reflection_conversation(exp.problem_text[p], *shown[p], c.insight,
                                         mem.extra_tokens) for p in pids]
        params = call_params("insight", c.insight.sampling, batch.step, c,
                             reflection_schema(c.insight))
        counts: Counter = Counter()
        tg = time.perf_counter()
        texts = generate_first(batch.generator, convs, params, counts)
        gen_s = time.perf_counter() - tg
        counts.update(self.store.ingest(batch.step, dict(zip(pids, texts)), shown,
                                        exp.leak_strings, mem.embed))
        stats.merge(dict(counts))
        return gen_s

    def _eligible(self, docid: str, query: ContextQuery) -> bool:
        """Written from an earlier step's rollouts than the row's (own-attempt guard)."""
        return query.before_step is None or \
            self.store.items[docid].provenance.step < query.before_step

    def _add(self, ctx: TeacherContext, dest: str, docid: str) -> None:
        it = self.store.items[docid]
        text = resanitize(it.text, self.memory.extra_tokens)
        if text:
            ctx.add_item(dest, text, evidence_key(docid, it.text),
                         dict(item=docid, **it.provenance.to_json()))

    def fill_context(self, ctx: TeacherContext, query: ContextQuery) -> None:
        """The strategies and lessons of the row's problem written before its step."""
        if not self.enabled:
            return
        for kind, dest in (("strategy", "strategies"), ("lesson", "lessons")):
            for d in self.store.ids(query.problem_id, kind):
                if self._eligible(d, query):
                    self._add(ctx, dest, d)

    def fill_control(self, ctx: TeacherContext, real: TeacherContext,
                     query: ContextQuery) -> None:
        """Control "random_other_problem": as many strategies and lessons as ``real`` holds,
        each drawn (without replacement) from the eligible items of other problems."""
        if not self.enabled or query.rng is None:
            return
        st = self.store
        for kind, dest in (("strategy", "strategies"), ("lesson", "lessons")):
            want = len(real.section(dest) or ())
            if not want:
                continue
            pool = sorted(d for d, it in st.items.items()
                          if it.kind == kind and it.problem_id != query.problem_id
                          and self._eligible(d, query))
            for i in query.rng.permutation(len(pool))[:want]:
                self._add(ctx, dest, pool[int(i)])

    def stats(self) -> dict[str, Any]:
        items = self.store.items.values()
        return dict(
            strategies=sum(1 for i in items if i.kind == "strategy"),
            lessons=sum(1 for i in items if i.kind == "lesson"),
            problems_with_insights=len(self.store.problems()),
        )

    def export_rows(self) -> Iterator[dict[str, Any]]:
        for it in self.store.items.values():
            yield dict(level="insight", docid=it.docid, problem_id=it.problem_id, kind=it.kind,
                       text=it.text, support=it.support, last_step=it.last_step,
                       provenance=it.provenance.to_json())

    def html_problems(self) -> set[str]:
        return set(self.store.problems())

    def html_problem(self, problem_id: str) -> list[str]:
        e = html.escape
        out: list[str] = []
        for kind, label in (("strategy", "Strategies"), ("lesson", "Lessons")):
            ids = self.store.ids(problem_id, kind)
            if not ids:
                continue
            out.append(f"<h4>{label}</h4><ul>")
            for d in ids:
                it = self.store.items[d]
                p = it.provenance
                out.append(f"<li>{e(it.text)} <span class=prov>[step {p.step}, rollouts "
                           f"{list(p.rollout_indices)}, rewards {list(p.rewards)}, support "
                           f"{it.support}]</span></li>")
            out.append("</ul>")
        return out
