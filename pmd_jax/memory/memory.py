"""ProceduralMemory: the three levels, their update between steps, and teacher contexts."""

from __future__ import annotations

import html
import json
import logging
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np

from pmd_jax.memory.behavior import BehaviorBank
from pmd_jax.memory.calls import call_params, generate_first, zero_counts
from pmd_jax.memory.config import default_memory_config, validate_memory_config
from pmd_jax.memory.context import TeacherContext
from pmd_jax.memory.embedder import SentenceEmbedder, shared_embedder
from pmd_jax.memory.experience import ExperienceStore
from pmd_jax.memory.index import ScannIndex
from pmd_jax.memory.insight import InsightStore, reflection_conversation, select_attempts
from pmd_jax.memory.sanitize import sanitize_text
from pmd_jax.memory.schemas import call_token_bounds, reflection_schema
from pmd_jax.memory.types import MemoryUpdateStats, RolloutRecord
from pmd_jax.sampling.base import TextGenerator

log = logging.getLogger(__name__)

STATE_VERSION = 1


class ProceduralMemory:
    """Experience (level 1), insight (level 2) and behavior (level 3) memory.

    ``update(step, records, generator)`` runs between training steps; ``teacher_context``
    builds the teacher's user message for one rollout. ``embedder`` defaults to the
    sentence-transformers model named in ``config.embedder``.
    """

    def __init__(self, config: ml_collections.ConfigDict | None = None,
                 embedder: SentenceEmbedder | None = None) -> None:
        self.config = config if config is not None else default_memory_config()
        validate_memory_config(self.config)
        self.embedder = embedder or shared_embedder(self.config.embedder)
        self.dim = self.embedder.dim
        c = self.config
        self.extra_tokens = tuple(c.context.extra_control_tokens)
        self.experience = ExperienceStore(c.experience, c.success_threshold, self.extra_tokens)
        self.insights = InsightStore(c.insight, c.success_threshold, self.dim, c.index,
                                     self.extra_tokens)
        self.behaviors = BehaviorBank(c.behavior, self.dim, c.index, self.extra_tokens)
        self.problems = ScannIndex(self.dim, c.index)  # problem embeddings, docid = problem id
        self.last_update_step = -1
        self.history: list[dict[str, Any]] = []  # stats() per update, for plots
        self._warn_short_budgets()

    def _warn_short_budgets(self) -> None:
        """Logs a warning for a call whose max_tokens is below its schema's worst case."""
        c = self.config
        budgets = {"reflection": c.insight.sampling.max_tokens}
        budgets.update(dict.fromkeys(("summary", "extraction", "evolution"),
                                     c.behavior.sampling.max_tokens))
        if c.behavior.summary_mode != "policy":
            budgets.pop("summary")
        for call, bound in call_token_bounds(c).items():
            if call in budgets and budgets[call] < bound:
                log.warning("memory %s calls: max_tokens=%d is below the schema's worst-case "
                            "reply of ~%d tokens (memory/schemas.py); long replies will be cut "
                            "(counted as truncated)", call, budgets[call], bound)

    # ------------------------------------------------------------------------ update --
    def _embed(self, texts: list[str]) -> np.ndarray:
        return self.embedder.embed(texts)

    def is_frozen(self, step: int) -> bool:
        f = int(self.config.frozen_after_step)
        return f >= 0 and step > f

    def update(self, step: int, records: Sequence[RolloutRecord],
               generator: TextGenerator | None) -> MemoryUpdateStats:
        """Stores this step's rollouts, reflects on touched problems, evolves behaviors.

        Model output never raises here (it is counted in ``stats.counts``; counts of the
        behavior round are prefixed ``behavior/``, e.g. ``behavior/json_error``); bad records
        (not a ``RolloutRecord``, empty problem id, NaN reward) raise ValueError. The per-call
        counts (memory/calls.py: ``reflections``, ``parsed``, ``json_error``,
        ``schema_error``, ``truncated``, and under ``behavior/`` and ``behavior/<call>/``) are
        always present, 0 on a step where no call ran.
        """
        t0 = time.perf_counter()
        stats = MemoryUpdateStats(step=int(step))
        stats.merge(zero_counts())
        if self.is_frozen(step):
            stats.frozen = True
            return stats
        for r in records:
            if not isinstance(r, RolloutRecord):
                raise ValueError(f"memory.update expects RolloutRecord items, got {type(r)}")
            r.validate()
        c = self.config
        stats.merge(self.experience.add(records))
        by_pid: dict[str, list[RolloutRecord]] = {}
        for r in records:
            by_pid.setdefault(r.problem_id, []).append(r)

        te = time.perf_counter()
        new = [p for p in by_pid if p not in self.problems]
        if new:
            texts = [sanitize_text(self.experience.problem_text[p], 4000, self.extra_tokens)
                     for p in new]
            self.problems.upsert(new, self.embedder.embed(texts, query=True))
        stats.seconds["embed_problems"] = time.perf_counter() - te

        gen_s = 0.0
        if c.levels.insight and by_pid:
            shown = {p: select_attempts(rs, c.insight.max_attempts_shown, c.success_threshold)
                     for p, rs in by_pid.items()}
            pids = list(by_pid)
            convs = [reflection_conversation(self.experience.problem_text[p], *shown[p],
                                             c.insight, self.extra_tokens) for p in pids]
            params = call_params(c.insight.sampling, step, c, reflection_schema(c.insight))
            counts: Counter = Counter()
            tg = time.perf_counter()
            texts = generate_first(generator, convs, params, counts)
            gen_s += time.perf_counter() - tg
            counts.update(self.insights.ingest(step, dict(zip(pids, texts)), shown,
                                               self.experience.leak_strings, self._embed))
            stats.merge(dict(counts))

        if c.levels.behavior and self.behaviors.due(step, len(self.problems)):
            pids = self.problems.docids()
            tg = time.perf_counter()
            timed = _TimedGenerator(generator)
            counts = self.behaviors.run_round(
                step, pids, self.problems.matrix(pids), self.experience.problem_text,
                lambda p: (self.insights.texts(p, "strategy"), self.insights.texts(p, "lesson")),
                self.experience.success_rate, self.experience.leak_strings,
                timed, self._embed, memory_cfg=c)
            gen_s += timed.seconds
            stats.merge({f"behavior/{k}": v for k, v in counts.items()})
            stats.add("behavior_round")
            stats.seconds["behavior_round"] = time.perf_counter() - tg
        self.last_update_step = int(step)
        stats.seconds["generation"] = gen_s
        stats.seconds["total"] = time.perf_counter() - t0
        stats.seconds["memory_only"] = stats.seconds["total"] - gen_s
        self.history.append(dict(step=int(step), **self.stats()))
        return stats

    # --------------------------------------------------------------- teacher context --
    def _rng(self, problem_id: str) -> np.random.Generator:
        seed = zlib.crc32(f"{self.config.control_seed}/{problem_id}/{self.last_update_step}"
                          .encode())
        return np.random.default_rng(seed)

    def teacher_context(
        self,
        problem_id: str,
        problem_text: str,
        sibling_success: str | None = None,
        feedback: str | None = None,
        *,
        student_response: str | None = None,
    ) -> TeacherContext:
        """Memory-conditioned teacher context for one rollout of ``problem_id``.

        ``sibling_success``: a successful response of another rollout in the same group (the
        trainer excludes the student's own); preferred over a remembered success.
        ``student_response``: if given, a remembered success with the same text is not used.
        """
        c = self.config
        cx = c.context
        toks = self.extra_tokens
        ctx = TeacherContext(problem_text=str(problem_text), signal_rule=c.signal_rule,
                             truncation_order=tuple(cx.truncation_order),
                             max_tokens=int(cx.max_tokens),
                             inverted=c.control_mode == "inverted_lessons")
        mode = c.control_mode
        rng = self._rng(problem_id) if mode == "random_other_problem" else None

        if c.levels.insight:
            src = problem_id
            if rng is not None:
                others = [p for p in self.insights.problems() if p != problem_id]
                src = others[int(rng.integers(len(others)))] if others else None
            if src is not None:
                for kind, dest in (("strategy", ctx.strategies), ("lesson", ctx.lessons)):
                    for d in self.insights.ids(src, kind):
                        it = self.insights.items[d]
                        text = _resanitize(it.text, toks)
                        if text:
                            dest.append(text)
                            ctx.provenance.append(dict(item=d, **it.provenance.to_json()))

        if c.levels.behavior and c.behavior.top_k > 0 and self.behaviors.behaviors:
            if rng is not None:
                ids = sorted(self.behaviors.behaviors)
                pick = rng.permutation(len(ids))[: c.behavior.top_k]
                chosen = [self.behaviors.behaviors[ids[i]] for i in pick]
            else:
                q = self._problem_vector(problem_id, problem_text)
                chosen = self.behaviors.retrieve(q, c.behavior.top_k)
            for b in chosen:
                name, ins = _resanitize(b.name, toks), _resanitize(b.instruction, toks)
                if name and ins:
                    ctx.behaviors.append((name, ins))
                    ctx.provenance.append(dict(item=b.docid, **b.provenance.to_json()))

        succ = None
        if sibling_success:
            succ = sanitize_text(sibling_success, cx.max_attempt_chars, toks,
                                 drop_thinking=cx.strip_thinking)
            if succ:
                ctx.successful_attempt_source = "sibling"
        if not succ and c.levels.experience:
            src = problem_id
            if rng is not None:
                others = [p for p in self.experience.successes if p != problem_id]
                src = others[int(rng.integers(len(others)))] if others else None
            before = (self.last_update_step if c.experience.remembered_success_previous_steps_only
                      else None)
            item = self.experience.remembered_success(src, before) if src else None
            if item is not None and student_response is not None and (
                    item.response_text == sanitize_text(student_response,
                                                         c.experience.max_response_chars, toks)):
                item = None
            if item is not None:
                succ = sanitize_text(item.response_text, cx.max_attempt_chars, toks,
                                     drop_thinking=cx.strip_thinking)
                if succ:
                    ctx.successful_attempt_source = "memory"
                    ctx.provenance.append(dict(item=item.docid, **item.provenance().to_json()))
        ctx.successful_attempt = succ or None
        fb = sanitize_text(feedback or "", cx.max_feedback_chars, toks)
        if fb and not (cx.feedback_only_without_solution and ctx.successful_attempt):
            ctx.feedback = fb
        return ctx

    def _problem_vector(self, problem_id: str, problem_text: str) -> np.ndarray:
        if problem_id in self.problems:
            return self.problems.vector(problem_id)
        text = sanitize_text(problem_text, 4000, self.extra_tokens)
        return self.embedder.embed([text], query=True)[0]

    # ------------------------------------------------------------------------- stats --
    def stats(self) -> dict[str, Any]:
        ins = self.insights
        return dict(
            experience_records=len(self.experience.items),
            experience_problems=len(self.experience.by_problem),
            problems_with_success=sum(1 for v in self.experience.successes.values() if v),
            strategies=sum(1 for i in ins.items.values() if i.kind == "strategy"),
            lessons=sum(1 for i in ins.items.values() if i.kind == "lesson"),
            problems_with_insights=len(ins.problems()),
            behaviors=len(self.behaviors.behaviors),
            clusters=len(self.behaviors.centroids),
            behavior_rounds=self.behaviors.rounds,
            problem_index=len(self.problems),
            problem_index_mode=self.problems.mode,
            index_rebalances=(self.problems.rebalances + ins.index.rebalances
                              + self.behaviors.index.rebalances),
        )

    # ------------------------------------------------------------------- persistence --
    def state_dict(self) -> dict[str, Any]:
        """Plain data (dicts, lists, str, numbers, numpy arrays, bytes); exact restore."""
        return dict(
            version=STATE_VERSION, dim=self.dim, embedder=self.embedder.model_name,
            experience=self.experience.state_dict(), insights=self.insights.state_dict(),
            behaviors=self.behaviors.state_dict(), problems=self.problems.state_dict(),
            last_update_step=self.last_update_step, history=list(self.history),
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("version", -1)) != STATE_VERSION:
            raise ValueError(f"memory state version {state.get('version')!r} != {STATE_VERSION}")
        if int(state["dim"]) != self.dim:
            raise ValueError(f"memory state has embedding dim {state['dim']}, embedder {self.dim}"
                             f" ({state.get('embedder')!r} vs {self.embedder.model_name!r})")
        self.experience.load_state_dict(state["experience"])
        self.insights.load_state_dict(state["insights"])
        self.behaviors.load_state_dict(state["behaviors"])
        self.problems.load_state_dict(state["problems"])
        self.last_update_step = int(state["last_update_step"])
        self.history = list(state.get("history", []))

    # ------------------------------------------------------------------------ export --
    def _rows(self):
        for it in self.experience.items.values():
            yield dict(level="experience", **it.__dict__)
        for it in self.insights.items.values():
            yield dict(level="insight", docid=it.docid, problem_id=it.problem_id, kind=it.kind,
                       text=it.text, support=it.support, last_step=it.last_step,
                       provenance=it.provenance.to_json())
        for b in self.behaviors.behaviors.values():
            yield dict(level="behavior", docid=b.docid, name=b.name, instruction=b.instruction,
                       cluster_id=b.cluster_id, version=b.version, created_step=b.created_step,
                       updated_step=b.updated_step, provenance=b.provenance.to_json())
        for i, s in enumerate(self.behaviors.summaries):
            yield dict(level="cluster", cluster_id=i, summary=s,
                       members=self.behaviors.members.get(i, []))

    def export_jsonl(self, path: str) -> int:
        from pmd_jax import paths  # a gs:// run dir stays a URL

        return paths.write_jsonl(path, self._rows(), ensure_ascii=False)

    def export_html(self, path: str) -> None:
        e = html.escape
        bb = self.behaviors
        out = ["<!doctype html><meta charset='utf-8'><title>PMD memory</title>",
               "<style>body{font-family:sans-serif;max-width:60em;margin:auto}"
               ".prov{color:#777;font-size:80%}</style>",
               f"<h1>Procedural memory (step {self.last_update_step})</h1>",
               f"<p>{e(json.dumps(self.stats()))}</p><h2>Behaviors per cluster</h2>"]
        clusters = sorted({b.cluster_id for b in bb.behaviors.values()} | set(bb.members))
        for cid in clusters:
            summ = bb.summaries[cid] if cid < len(bb.summaries) else ""
            out.append(f"<h3>Cluster {cid}</h3><p>{e(summ)}</p><ol>")
            for b in bb.behaviors.values():
                if b.cluster_id == cid:
                    p = b.provenance
                    out.append(f"<li><b>{e(b.name)}</b>: {e(b.instruction)} <span class=prov>"
                               f"[{e(p.source)}, step {p.step}, v{b.version}, problems "
                               f"{e(', '.join(p.problem_ids[:8]))}]</span></li>")
            out.append("</ol>")
        out.append("<h2>Strategies and lessons per problem</h2>")
        pids = sorted(set(self.insights.problems()) | set(self.experience.successes))
        for pid in pids:
            text = self.experience.problem_text.get(pid, "")
            out.append(f"<h3>{e(pid)}</h3><p>{e(text[:500])}</p>")
            for kind, label in (("strategy", "Strategies"), ("lesson", "Lessons")):
                ids = self.insights.ids(pid, kind)
                if not ids:
                    continue
                out.append(f"<h4>{label}</h4><ul>")
                for d in ids:
                    it = self.insights.items[d]
                    p = it.provenance
                    out.append(f"<li>{e(it.text)} <span class=prov>[step {p.step}, rollouts "
                               f"{list(p.rollout_indices)}, rewards {list(p.rewards)}, support "
                               f"{it.support}]</span></li>")
                out.append("</ul>")
            s = self.experience.remembered_success(pid, None)
            if s is not None:
                out.append(f"<details><summary>latest success (step {s.step}, rollout "
                           f"{s.rollout_index})</summary><pre>{e(s.response_text[:2000])}</pre>"
                           "</details>")
        from pmd_jax import paths

        paths.write_text(path, "\n".join(out))


def _resanitize(text: str, control_tokens: Sequence[str]) -> str:
    """A stored item sanitised again, uncut, against this memory's control tokens.

    Items were sanitised when stored; doing it again as they enter a teacher context covers a
    state restored from a memory that was built with another tokenizer's list (or none). On an
    item already clean it is the identity.
    """
    return sanitize_text(text, max(len(text), 1), control_tokens)


class _TimedGenerator:
    """Wraps a TextGenerator and records the seconds spent generating (for stats).

    ``generate_replies`` answers with the wrapped generator's ``generate_replies`` (texts and
    finish reasons) or, for a generator that has only ``generate_texts``, with its texts.
    """

    def __init__(self, gen: TextGenerator | None) -> None:
        self.gen = gen
        self.seconds = 0.0

    def generate_replies(self, conversations, params):
        if self.gen is None:
            return []
        t = time.perf_counter()
        try:
            fn = getattr(self.gen, "generate_replies", None) or self.gen.generate_texts
            return fn(conversations, params)
        finally:
            self.seconds += time.perf_counter() - t
