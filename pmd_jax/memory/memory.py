"""ProceduralMemory: its levels (a list), their update between steps, and teacher contexts.

The levels (memory/level.py's interface) are registered in ``LEVELS`` below, in the order
they update, checkpoint and export; they fill a teacher context in ``context_rank`` order.
Adding a level: one module with a :class:`~pmd_jax.memory.level.MemoryLevel` subclass (its
teacher-context part, if any, via :func:`~pmd_jax.memory.context.register_section`), one line
in ``LEVELS``, and its config section and switch in memory/config.py (``MemoryLevels``).
"""

from __future__ import annotations

import html
import json
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from pmd_jax.memory.behavior import BehaviorBank, BehaviorLevel
from pmd_jax.memory.calls import zero_counts
from pmd_jax.memory.config import (
    MemoryConfig,
    validate_memory_config,
)
from pmd_jax.memory.context import TeacherContext
from pmd_jax.memory.embedder import SentenceEmbedder, shared_embedder
from pmd_jax.memory.experience import MAX_PROBLEM_CHARS, ExperienceLevel, ExperienceStore
from pmd_jax.memory.index import ScannIndex
from pmd_jax.memory.insight import InsightLevel, InsightStore
from pmd_jax.memory.level import ContextQuery, MemoryLevel, StepRollouts
from pmd_jax.memory.sanitize import sanitize_text
from pmd_jax.memory.schemas import call_token_bounds
from pmd_jax.memory.types import MemoryUpdateStats, RolloutRecord
from pmd_jax.memory.verify import EvidenceStore, evidence_key
from pmd_jax.run import paths  # a gs:// run dir stays a URL
from pmd_jax.sampling.base import TextGenerator
from pmd_jax.sampling.seeds import derive_seed

log = logging.getLogger(__name__)

STATE_VERSION = 1

# The levels, in update / checkpoint / export order: the one place a level is registered.
LEVELS: tuple[type[MemoryLevel], ...] = (ExperienceLevel, InsightLevel, BehaviorLevel)


class ProceduralMemory:
    """Experience (level 1), insight (level 2) and behavior (level 3) memory.

    ``update(step, records, generator)`` runs between training steps; ``teacher_context``
    builds the teacher's user message for one rollout. ``embedder`` defaults to the
    sentence-transformers model named in ``config.embedder``. ``levels`` holds one instance of
    each class in ``LEVELS``; ``experience`` / ``insights`` / ``behaviors`` are the built-in
    levels' stores.
    """

    def __init__(self, config: MemoryConfig | None = None,
                 embedder: SentenceEmbedder | None = None) -> None:
        if config is not None and not isinstance(config, MemoryConfig):
            raise TypeError(
                f"ProceduralMemory takes a frozen MemoryConfig, got {type(config).__name__}; "
                "freeze an edited ConfigDict with "
                "pmd_jax.memory.config.freeze_memory_config(c)")
        self.config: MemoryConfig = config if config is not None else MemoryConfig()
        validate_memory_config(self.config)
        self.embedder = embedder or shared_embedder(self.config.embedder)
        self.dim = self.embedder.dim
        c = self.config
        self.extra_tokens = tuple(c.context.extra_control_tokens)
        self.levels: list[MemoryLevel] = [cls(self) for cls in LEVELS]
        self.problems = ScannIndex(self.dim, c.index)  # problem embeddings, docid = problem id
        # the check before use (memory/verify.py): each item's replay evidence
        self.evidence = EvidenceStore(c.verify)
        self.last_update_step = -1
        self.history: list[dict[str, Any]] = []  # stats() per update, for plots
        self._warn_short_budgets()

    def level(self, name: str) -> MemoryLevel:
        """The level registered as ``name`` ("experience", "insight", "behavior", ...)."""
        for lvl in self.levels:
            if lvl.name == name:
                return lvl
        raise KeyError(f"no memory level {name!r}; levels: {[lv.name for lv in self.levels]}")

    @property
    def experience(self) -> ExperienceStore:
        return self.level("experience").store  # type: ignore[attr-defined]

    @property
    def insights(self) -> InsightStore:
        return self.level("insight").store  # type: ignore[attr-defined]

    @property
    def behaviors(self) -> BehaviorBank:
        return self.level("behavior").store  # type: ignore[attr-defined]

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
    def embed(self, texts: list[str]) -> np.ndarray:
        """Item embeddings (not queries), for the levels' dedup and retrieval keys."""
        return self.embedder.embed(texts)

    def is_frozen(self, step: int) -> bool:
        f = int(self.config.frozen_after_step)
        return f >= 0 and step > f

    def update(self, step: int, records: Sequence[RolloutRecord],
               generator: TextGenerator | None) -> MemoryUpdateStats:
        """Indexes this step's new problems, then updates each level in ``LEVELS`` order
        (experience stores the rollouts, insight reflects on touched problems, behavior
        evolves the bank when a round is due).

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
        by_pid: dict[str, list[RolloutRecord]] = {}
        for r in records:
            by_pid.setdefault(r.problem_id, []).append(r)
        batch = StepRollouts(step=step, records=records, by_problem=by_pid, generator=generator)

        te = time.perf_counter()
        new = [p for p in by_pid if p not in self.problems]
        if new:  # a problem's text: its latest record's (as the experience level keeps it)
            texts = [sanitize_text(str(by_pid[p][-1].problem_text)[:MAX_PROBLEM_CHARS], 4000,
                                   self.extra_tokens) for p in new]
            self.problems.upsert(new, self.embedder.embed(texts, query=True))
        stats.seconds["embed_problems"] = time.perf_counter() - te

        gen_s = 0.0
        for lvl in self.levels:
            gen_s += lvl.update(batch, stats)
        self.last_update_step = int(step)
        stats.seconds["generation"] = gen_s
        stats.seconds["total"] = time.perf_counter() - t0
        stats.seconds["memory_only"] = stats.seconds["total"] - gen_s
        self.history.append(dict(step=int(step), **self.stats()))
        return stats

    # --------------------------------------------------------------- teacher context --
    def _rng(self, problem_id: str) -> np.random.Generator:
        return np.random.default_rng(derive_seed("memory.control", int(self.config.control_seed),
                                                  str(problem_id), int(self.last_update_step)))

    def teacher_context(
        self,
        problem_id: str,
        problem_text: str,
        sibling_success: str | None = None,
        feedback: str | None = None,
        *,
        student_response: str | None = None,
        step: int | None = None,
    ) -> TeacherContext:
        """Memory-conditioned teacher context for one rollout of ``problem_id``.

        ``sibling_success``: a successful response of another rollout in the same group (the
        trainer excludes the student's own); preferred over a remembered success.
        ``student_response``: if given, a remembered success with the same text is not used.
        ``step``: the rollout's training step; with ``context.previous_steps_only`` the levels
        show only items written from earlier steps' rollouts (None: every item, as an
        evaluation with memory does). Each level fills its own parts, in ``context_rank``
        order. In control mode "random_other_problem" the context has the form of the one the
        mode would show (the same sections with as many items) and other problems' content.
        """
        c = self.config
        cx = c.context
        before = int(step) if step is not None and cx.previous_steps_only else None
        query = ContextQuery(problem_id=problem_id, problem_text=problem_text,
                             student_response=student_response, rng=None, before_step=before)
        ranked = sorted(self.levels, key=lambda lv: lv.context_rank)
        ctx = self._base_context(problem_text, sibling_success)
        for lvl in ranked:
            lvl.fill_context(ctx, query)
        if c.control_mode == "random_other_problem":
            real, ctx = ctx, self._base_context(problem_text, sibling_success)
            query.rng = self._rng(problem_id)
            for lvl in ranked:
                lvl.fill_control(ctx, real, query)
        fb = sanitize_text(feedback or "", cx.max_feedback_chars, self.extra_tokens)
        if fb and not (cx.feedback_only_without_solution and ctx.successful_attempt):
            ctx.feedback = fb
        return ctx

    def _base_context(self, problem_text: str, sibling_success: str | None) -> TeacherContext:
        """A context with the problem and the sibling's success (if any), no memory yet."""
        c = self.config
        cx = c.context
        ctx = TeacherContext(problem_text=str(problem_text), signal_rule=c.signal_rule,
                             truncation_order=tuple(cx.truncation_order),
                             max_tokens=int(cx.max_tokens),
                             inverted=c.control_mode == "inverted_lessons")
        if sibling_success:
            succ = sanitize_text(sibling_success, cx.max_attempt_chars, self.extra_tokens,
                                 drop_thinking=cx.strip_thinking)
            if succ:
                ctx.successful_attempt = succ
                ctx.successful_attempt_source = "sibling"
        return ctx

    def problem_vector(self, problem_id: str, problem_text: str) -> np.ndarray:
        """A problem's embedding: from the problem index, or embedded now (not stored)."""
        if problem_id in self.problems:
            return self.problems.vector(problem_id)
        text = sanitize_text(problem_text, 4000, self.extra_tokens)
        return self.embedder.embed([text], query=True)[0]

    # ------------------------------------------------------------------------- stats --
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for lvl in self.levels:
            out.update(lvl.stats())
        out.update(
            problem_index=len(self.problems),
            problem_index_mode=self.problems.mode,
            index_rebalances=(self.problems.rebalances
                              + sum(lvl.index_rebalances() for lvl in self.levels)),
        )
        return out

    # ------------------------------------------------------------------- persistence --
    def state_dict(self) -> dict[str, Any]:
        """Plain data (dicts, lists, str, numbers, numpy arrays, bytes); exact restore."""
        out: dict[str, Any] = dict(version=STATE_VERSION, dim=self.dim,
                                   embedder=self.embedder.model_name)
        out.update((lvl.state_key, lvl.state_dict()) for lvl in self.levels)
        out.update(problems=self.problems.state_dict(), evidence=self.evidence.state_dict(),
                   last_update_step=self.last_update_step, history=list(self.history))
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("version", -1)) != STATE_VERSION:
            raise ValueError(f"memory state version {state.get('version')!r} != {STATE_VERSION}")
        if int(state["dim"]) != self.dim:
            raise ValueError(f"memory state has embedding dim {state['dim']}, embedder {self.dim}"
                             f" ({state.get('embedder')!r} vs {self.embedder.model_name!r})")
        for lvl in self.levels:
            lvl.load_state_dict(state[lvl.state_key])
        self.problems.load_state_dict(state["problems"])
        self.evidence.load_state_dict(state.get("evidence"))  # (absent before issue 35)
        self.last_update_step = int(state["last_update_step"])
        self.history = list(state.get("history", []))

    # ------------------------------------------------------------------------ export --
    def _rows(self) -> Iterator[dict[str, Any]]:
        """The levels' rows; an insight's or behavior's row carries its replay evidence
        (``evidence``: None when never tested)."""
        z = self.evidence.z
        for lvl in self.levels:
            for row in lvl.export_rows():
                key = self._row_key(row)
                if key is not None:
                    ev = self.evidence.items.get(key)
                    row["evidence"] = ev.to_json(z) if ev is not None else None
                yield row

    @staticmethod
    def _row_key(row: dict[str, Any]) -> str | None:
        if row.get("level") == "insight":
            return evidence_key(row["docid"], row["text"])
        if row.get("level") == "behavior":
            return evidence_key(row["docid"], f"{row['name']}\n{row['instruction']}")
        return None

    def _html_evidence(self) -> list[str]:
        """The check before use: admitted items, then the rejected and retired ones apart."""
        e = html.escape
        z = self.evidence.z
        evs = sorted(self.evidence.items.values(), key=lambda v: (v.status, v.key))
        if not evs and not self.evidence.levels:
            return []
        out = ["<h2>Check before use (paired replays)</h2>",
               f"<p>{e(json.dumps(self.evidence.counts()))}</p>"]
        for lv in self.evidence.levels.values():  # level_sequential: the pooled tests
            j = lv.to_json()
            out.append(f"<p>level {e(lv.level)}: <b>{e(lv.status)}</b>, {lv.pairs} pairs "
                       f"({lv.wins} won / {lv.losses} lost), wealth for help "
                       f"{j['help']:.3g}, for harm {j['harm']:.3g} (decides at "
                       f"{self.evidence.threshold:.3g})</p>")
        for title, statuses in (("Admitted (shown to the teacher)", ("admitted",)),
                                ("Pending (not shown)", ("pending",)),
                                ("Rejected or retired (never shown)", ("rejected", "retired"))):
            rows = [v for v in evs if v.status in statuses]
            if not rows:
                continue
            out.append(f"<h3>{e(title)}: {len(rows)}</h3><ul>")
            for v in rows:
                est, lo, hi = v.interval(z)
                out.append(f"<li>{e(v.text[:300])} <span class=prov>[{e(v.level)}, {v.status}"
                           f", effect {est:+.2f} [{lo:+.2f}, {hi:+.2f}], {v.pairs} pairs "
                           f"({v.wins} won / {v.losses} lost), last tested step "
                           f"{v.last_tested_step}]</span></li>")
            out.append("</ul>")
        return out

    def export_jsonl(self, path: str) -> int:
        return paths.write_jsonl(path, self._rows(), ensure_ascii=False)

    def export_html(self, path: str) -> None:
        """The levels' own sections (in ``LEVELS`` order), then one section per problem with
        each level's part (in ``context_rank`` order)."""
        e = html.escape
        out = ["<!doctype html><meta charset='utf-8'><title>PMD memory</title>",
               "<style>body{font-family:sans-serif;max-width:60em;margin:auto}"
               ".prov{color:#777;font-size:80%}</style>",
               f"<h1>Procedural memory (step {self.last_update_step})</h1>"]
        head = f"<p>{e(json.dumps(self.stats()))}</p>"
        sections = [line for lvl in self.levels for line in lvl.html_section()]
        out.append(head + (sections[0] if sections else ""))  # one line, as before issue 16
        out.extend(sections[1:])
        out.extend(self._html_evidence())
        out.append("<h2>Strategies and lessons per problem</h2>")
        ranked = sorted(self.levels, key=lambda lv: lv.context_rank)
        pids = sorted(set().union(*(lvl.html_problems() for lvl in self.levels)))
        for pid in pids:
            text = self.experience.problem_text.get(pid, "")
            out.append(f"<h3>{e(pid)}</h3><p>{e(text[:500])}</p>")
            for lvl in ranked:
                out.extend(lvl.html_problem(pid))

        paths.write_text(path, "\n".join(out))
