"""Level 3, behaviors: a bank of reusable name/instruction pairs over semantic clusters.

A round (every ``every_n_steps`` steps, once ``min_problems`` problems are known):

1. cluster all known problem embeddings with scikit-learn (KMeans or MiniBatchKMeans);
2. summarise each cluster (extractive: size, success rate and the problems nearest the
   centroid; or "policy": the policy writes one or two sentences as ``{"summary": ...}``,
   and the extractive summary stays where its reply gives none);
3. gather evidence per cluster: the problems nearest the centroid with their strategies and
   lessons;
4. while the bank is empty: the extraction prompt, 3-8 behaviors per cluster; afterwards the
   evolution prompt per cluster (retrieve-then-decide): the existing behaviors nearest the
   cluster (ScaNN) are shown with all cluster summaries, and new/update/remove actions apply.

Every model call states its schema's bounds in the prompt, sends the schema when
``structured_output`` is on (memory/schemas.py, memory/calls.py), and its replies are counted
per call type: ``summary/``, ``extraction/``, ``evolution/`` + ``reflections``, ``parsed``,
``json_error``, ``schema_error``, ``truncated``, and the same five summed over the round.

Behaviors are indexed in ScaNN by their cluster centroid (default; teacher retrieval ranks
behaviors by similarity of the problem to the centroid they were extracted for) or by their
own text embedding. When the bank exceeds ``max_bank_size`` the least recently updated
behavior is evicted first.

As a memory level (:class:`BehaviorLevel`) it fills the teacher context's numbered behaviors:
the ``top_k`` nearest the rollout's problem among those last written before the rollout's step
(in control mode "random_other_problem": as many, drawn from the others).
"""

from __future__ import annotations

import html
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pmd_jax.memory import prompts
from pmd_jax.memory.calls import (
    BEHAVIOR_CALLS,
    COUNT_KEYS,
    TimedGenerator,
    call_params,
    generate_first,
)
from pmd_jax.memory.context import TeacherContext
from pmd_jax.memory.index import ScannIndex
from pmd_jax.memory.level import ContextQuery, LevelHost, MemoryLevel, StepRollouts
from pmd_jax.memory.parsing import normalize_name, parse_actions, parse_behaviors, parse_summary
from pmd_jax.memory.sanitize import (
    echoes_prompt,
    leaks_gold,
    resanitize,
    sanitize_text,
    without_shared_preamble,
)
from pmd_jax.memory.schemas import evolution_schema, extraction_schema, summary_schema
from pmd_jax.memory.types import Behavior, MemoryUpdateStats, Provenance
from pmd_jax.memory.verify import evidence_key
from pmd_jax.sampling.base import TextGenerator

if TYPE_CHECKING:
    from pmd_jax.memory.config import MemoryBehavior, MemoryConfig, MemoryIndex


def cluster_problems(vecs: np.ndarray, cfg: MemoryBehavior) -> tuple[np.ndarray, np.ndarray]:
    """(labels [n], unit-norm centroids [c, d]) from scikit-learn k-means."""
    # lazy: scikit-learn only for the behavior level's clustering
    from sklearn.cluster import KMeans, MiniBatchKMeans

    n = len(vecs)
    k = max(1, min(int(cfg.num_clusters), n // max(1, int(cfg.min_cluster_size)), n))
    if cfg.cluster_algo == "minibatch_kmeans":
        km = MiniBatchKMeans(n_clusters=k, random_state=cfg.cluster_seed, n_init=3,
                             batch_size=1024)
    else:
        km = KMeans(n_clusters=k, random_state=cfg.cluster_seed, n_init=3)
    labels = km.fit_predict(vecs.astype(np.float64))
    cent = km.cluster_centers_.astype(np.float32)
    cent /= np.maximum(np.linalg.norm(cent, axis=1, keepdims=True), 1e-12)
    return labels.astype(np.int64), cent


class BehaviorBank:
    def __init__(self, cfg: MemoryBehavior, dim: int, index_cfg: MemoryIndex,
                 extra_tokens: Sequence[str] = ()):
        self.cfg = cfg
        self.dim = dim
        self.extra_tokens = tuple(extra_tokens)
        self.behaviors: dict[str, Behavior] = {}
        self.by_name: dict[str, str] = {}
        self.anchors: dict[str, np.ndarray] = {}  # centroid a behavior was last written for
        self.index = ScannIndex(dim, index_cfg)
        self.centroids = np.zeros((0, dim), np.float32)
        self.summaries: list[str] = []
        self.members: dict[int, list[str]] = {}
        self.rounds = 0
        self.last_round_step = -1
        self.next_id = 0

    def due(self, step: int, num_problems: int) -> bool:
        if num_problems < self.cfg.min_problems:
            return False
        return self.last_round_step < 0 or step - self.last_round_step >= self.cfg.every_n_steps

    # ------------------------------------------------------------------- retrieval --
    def retrieve(self, query: np.ndarray, k: int) -> list[Behavior]:
        if k <= 0 or not self.behaviors:
            return []
        ids, _ = self.index.search(query[None], k)
        return [self.behaviors[d] for d in ids[0] if d in self.behaviors]

    # ----------------------------------------------------------------------- round --
    def run_round(
        self,
        step: int,
        pids: Sequence[str],
        vecs: np.ndarray,
        problem_text: dict[str, str],
        evidence: Callable[[str], tuple[list[str], list[str]]],
        success_rate: Callable[[str], float],
        leak_strings: dict[str, list[str]],
        generator: TextGenerator | None,
        embed: Callable[[list[str]], np.ndarray],
        *,
        memory_cfg: MemoryConfig,
    ) -> Counter:
        """One clustering + summary + extraction-or-evolution round; returns its counts.

        ``memory_cfg``: the whole memory config, for ``structured_output`` and
        ``stop_token_ids``.
        """
        cfg = self.cfg
        mcfg = memory_cfg
        counts: Counter = Counter()
        per_call: dict[str, Counter] = {c: Counter() for c in BEHAVIOR_CALLS}
        labels, cent = cluster_problems(vecs, cfg)
        members: dict[int, list[str]] = {}
        for c in range(len(cent)):
            idx = np.flatnonzero(labels == c)
            order = idx[np.argsort(-(vecs[idx] @ cent[c]), kind="stable")]
            members[c] = [pids[i] for i in order]
        self.centroids, self.members = cent, members
        counts["clusters"] = len(cent)
        # the problems as the summaries and evidence show them: without the instructions
        # that every problem of the run opens with
        problem_text = without_shared_preamble(problem_text)
        self.summaries = self._summaries(step, members, problem_text, success_rate, generator,
                                         mcfg, per_call["summary"])
        evid = {c: self._evidence(m, problem_text, evidence) for c, m in members.items()}
        cluster_leaks = {c: [s for p in m for s in leak_strings.get(p, [])]
                         for c, m in members.items()}
        clusters = sorted(members)
        bounds: dict[str, Any] = dict(
            max_name_chars=cfg.max_name_chars, min_name_chars=cfg.min_name_chars,
            max_instruction_chars=cfg.max_instruction_chars,
            min_instruction_chars=cfg.min_instruction_chars, extra_tokens=self.extra_tokens)
        if not self.behaviors:
            call, schema = "extraction", extraction_schema(cfg)
            convs = [self._extraction_conv(self.summaries[c], evid[c]) for c in clusters]
            cc = per_call[call]
            replies = generate_first(generator, convs, call_params(call, cfg.sampling, step,
                                                                   mcfg, schema), cc)
            asked = self._instructions(call)
            for c, reply in zip(clusters, replies):
                items = parse_behaviors(reply, cc, max_items=cfg.max_behaviors, schema=schema,
                                        **bounds)
                if len(items) < cfg.min_behaviors:
                    cc["too_few_behaviors"] += 1
                for name, instr in items:
                    self._apply(step, c, "new", name, instr, members[c], "extraction",
                                cluster_leaks[c], cc, asked)
        else:
            call, schema = "evolution", evolution_schema(cfg)
            convs = []
            for c in clusters:
                existing = self.retrieve(cent[c], cfg.retrieve_for_evolution)
                convs.append(self._evolution_conv(c, evid[c], existing))
            cc = per_call[call]
            replies = generate_first(generator, convs, call_params(call, cfg.sampling, step,
                                                                   mcfg, schema), cc)
            asked = self._instructions(call)
            for c, reply in zip(clusters, replies):
                for a in parse_actions(reply, cc, max_items=cfg.max_actions, schema=schema,
                                       **bounds):
                    self._apply(step, c, a.action, a.name, a.instruction, members[c],
                                "evolution", cluster_leaks[c], cc, asked)
        for name, cc in per_call.items():
            counts.update(cc)  # the round's totals, per-item counts included
            for k in COUNT_KEYS:
                counts[f"{name}/{k}"] = cc[k]
        self._evict(counts)
        self._reindex(embed)
        self.rounds += 1
        self.last_round_step = int(step)
        return counts

    def _summaries(self, step, members, problem_text, success_rate, generator, mcfg, counts):
        cfg = self.cfg
        out = []
        for c in sorted(members):
            m = members[c]
            ex = "; ".join(sanitize_text(problem_text.get(p, ""), 120, self.extra_tokens)
                           for p in m[:3])
            rate = float(np.mean([success_rate(p) for p in m])) if m else 0.0
            out.append(sanitize_text(prompts.SUMMARY_EXTRACTIVE.format(
                n=len(m), rate=rate, examples=ex), cfg.max_summary_chars, self.extra_tokens))
        if cfg.summary_mode == "policy" and members:
            schema = summary_schema(cfg)
            chars = prompts.count_range(cfg.min_summary_chars, cfg.max_summary_chars)
            convs = []
            for c in sorted(members):
                probs = "\n".join("- " + sanitize_text(problem_text.get(p, ""),
                                                       cfg.max_evidence_chars, self.extra_tokens)
                                  for p in members[c][:cfg.max_problems_per_cluster_prompt])
                convs.append([{"role": "system", "content": prompts.SUMMARY_SYSTEM},
                              {"role": "user", "content": prompts.SUMMARY_USER.format(
                                  problems=probs, chars=chars)}])
            params = call_params("summary", cfg.sampling, step, mcfg, schema)
            for i, reply in enumerate(generate_first(generator, convs, params, counts)):
                s = parse_summary(reply, counts, max_chars=cfg.max_summary_chars,
                                  min_chars=cfg.min_summary_chars,
                                  extra_tokens=self.extra_tokens, schema=schema,
                                  plain_text=not mcfg.structured_output)
                if s:
                    out[i] = s  # otherwise the extractive summary stays as the fallback
                else:
                    counts["empty_summary"] += 1
        return out

    def _evidence(self, m, problem_text, evidence) -> str:
        cfg = self.cfg
        lines = []
        for p in m[: cfg.max_problems_per_cluster_prompt]:
            strat, less = evidence(p)
            cap = cfg.max_evidence_chars

            def join(xs: list[str]) -> str:
                return sanitize_text("; ".join(xs), cap, self.extra_tokens)

            lines.append(prompts.EVIDENCE_PROBLEM.format(
                problem=sanitize_text(problem_text.get(p, ""), cap, self.extra_tokens),
                strategies=prompts.EVIDENCE_STRATEGIES.format(items=join(strat)) if strat else "",
                lessons=prompts.EVIDENCE_LESSONS.format(items=join(less)) if less else "",
            ))
        return "\n".join(lines)

    def _bounds_text(self) -> dict[str, str]:
        """The extraction / evolution schemas' string bounds, as the prompts state them."""
        b = self.cfg
        return dict(name_chars=prompts.count_range(b.min_name_chars, b.max_name_chars),
                    instruction_chars=prompts.count_range(b.min_instruction_chars,
                                                          b.max_instruction_chars))

    def _extraction_conv(self, summary: str, evidence: str) -> list[dict[str, str]]:
        user = prompts.EXTRACTION_USER.format(
            summary=summary, evidence=evidence,
            count=prompts.count_range(self.cfg.min_behaviors, self.cfg.max_behaviors),
            **self._bounds_text())
        return [{"role": "system", "content": prompts.EXTRACTION_SYSTEM},
                {"role": "user", "content": user}]

    def _evolution_conv(self, c: int, evidence: str, existing: list[Behavior]):
        # This cluster's summary first, then the others.
        order = [c] + [i for i in range(len(self.summaries)) if i != c]
        summaries = "\n".join(f"- {self.summaries[i]}" for i in order)
        ex = "\n".join(prompts.EXISTING_BEHAVIOR.format(name=b.name, instruction=b.instruction)
                       for b in existing) or prompts.NO_EXISTING
        user = prompts.EVOLUTION_USER.format(
            summaries=summaries, evidence=evidence, existing=ex,
            count=prompts.count_range(0, self.cfg.max_actions), **self._bounds_text())
        return [{"role": "system", "content": prompts.EVOLUTION_SYSTEM},
                {"role": "user", "content": user}]

    def _instructions(self, call: str) -> str:
        """The call's own instructions as the model read them, without the cluster's
        summaries, evidence or existing behaviors (what a prompt echo copies)."""
        if call == "extraction":
            conv = self._extraction_conv("", "")
        else:
            user = prompts.EVOLUTION_USER.format(
                summaries="", evidence="", existing="",
                count=prompts.count_range(0, self.cfg.max_actions), **self._bounds_text())
            conv = [{"content": prompts.EVOLUTION_SYSTEM}, {"content": user}]
        return "\n".join(m["content"] for m in conv)

    def _apply(self, step, c, action, name, instr, members, source, leaks, counts,
               asked: str = "") -> None:
        key = normalize_name(name)
        if action != "remove" and leaks_gold(f"{name} {instr}", leaks):
            counts["gold_leak"] += 1
            return
        if action != "remove" and asked and echoes_prompt(instr, asked):
            counts["prompt_echo"] += 1  # the request handed back, not a behavior
            return
        prov = Provenance(source, int(step), tuple(members))
        docid = self.by_name.get(key)
        if action == "remove":
            if docid is None:
                counts["remove_unknown"] += 1
                return
            del self.behaviors[docid]
            del self.by_name[key]
            self.anchors.pop(docid, None)
            counts["behaviors_removed"] += 1
            return
        if docid is not None:  # "update", or "new" reusing an existing name
            b = self.behaviors[docid]
            if action == "new":
                counts["new_existing_name"] += 1
            b.instruction, b.cluster_id, b.provenance = instr, int(c), prov
            b.updated_step, b.version = int(step), b.version + 1
            self.anchors[docid] = self.centroids[c].copy()
            counts["behaviors_updated"] += 1
            return
        if action == "update":
            counts["update_unknown"] += 1  # treated as new
        docid = f"beh/{self.next_id}"
        self.next_id += 1
        self.behaviors[docid] = Behavior(docid, name, instr, int(c), prov, int(step), int(step))
        self.by_name[key] = docid
        self.anchors[docid] = self.centroids[c].copy()
        counts["behaviors_new"] += 1

    def _evict(self, counts: Counter) -> None:
        while len(self.behaviors) > self.cfg.max_bank_size:
            victim = min(self.behaviors.values(), key=lambda b: (b.updated_step, b.docid))
            del self.behaviors[victim.docid]
            del self.by_name[normalize_name(victim.name)]
            self.anchors.pop(victim.docid, None)
            counts["behaviors_evicted"] += 1

    def _reindex(self, embed: Callable[[list[str]], np.ndarray]) -> None:
        gone = [d for d in self.index.docids() if d not in self.behaviors]
        self.index.delete(gone)
        ids = list(self.behaviors)
        if not ids:
            return
        anchors = np.stack([self.anchors[d] for d in ids])
        if len(self.centroids):  # behaviors belong to the nearest current cluster
            for d, c in zip(ids, np.argmax(anchors @ self.centroids.T, axis=1)):
                self.behaviors[d].cluster_id = int(c)
        if self.cfg.key == "text":
            vecs = embed([f"{self.behaviors[d].name}: {self.behaviors[d].instruction}"
                          for d in ids])
        else:
            vecs = anchors
        self.index.upsert(ids, vecs)

    # --------------------------------------------------------------------- state --
    def state_dict(self) -> dict[str, Any]:
        return dict(
            behaviors=[dict(docid=b.docid, name=b.name, instruction=b.instruction,
                            cluster_id=b.cluster_id, provenance=b.provenance.to_json(),
                            created_step=b.created_step, updated_step=b.updated_step,
                            version=b.version) for b in self.behaviors.values()],
            anchors_ids=list(self.anchors),
            anchors=(np.stack(list(self.anchors.values())) if self.anchors
                     else np.zeros((0, self.dim), np.float32)),
            index=self.index.state_dict(), centroids=self.centroids.copy(),
            summaries=list(self.summaries),
            members={str(c): list(m) for c, m in self.members.items()},
            rounds=self.rounds, last_round_step=self.last_round_step, next_id=self.next_id,
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.behaviors, self.by_name = {}, {}
        for d in state["behaviors"]:
            d = dict(d)
            d["provenance"] = Provenance.from_json(d["provenance"])
            b = Behavior(**d)
            self.behaviors[b.docid] = b
            self.by_name[normalize_name(b.name)] = b.docid
        av = np.asarray(state["anchors"], np.float32).reshape(-1, self.dim)
        self.anchors = {str(d): v.copy() for d, v in zip(state["anchors_ids"], av)}
        self.index.load_state_dict(state["index"])
        self.centroids = np.asarray(state["centroids"], np.float32).reshape(-1, self.dim)
        self.summaries = list(state["summaries"])
        self.members = {int(c): list(m) for c, m in state["members"].items()}
        self.rounds = int(state["rounds"])
        self.last_round_step = int(state["last_round_step"])
        self.next_id = int(state["next_id"])


class BehaviorLevel(MemoryLevel):
    """Level 3 of :class:`~pmd_jax.memory.memory.ProceduralMemory` (memory/level.py)."""

    name = "behavior"
    state_key = "behaviors"
    context_rank = 20  # after the strategies and lessons, before the solution

    def __init__(self, memory: LevelHost) -> None:
        super().__init__(memory)
        c = memory.config
        self.store = BehaviorBank(c.behavior, memory.dim, c.index, memory.extra_tokens)

    def update(self, batch: StepRollouts, stats: MemoryUpdateStats) -> float:
        """A behavior round when one is due; returns the seconds spent generating."""
        mem = self.memory
        if not (self.enabled and self.store.due(batch.step, len(mem.problems))):
            return 0.0
        c, exp, ins = mem.config, mem.experience, mem.insights
        pids = mem.problems.docids()
        tg = time.perf_counter()
        timed = TimedGenerator(batch.generator)
        counts = self.store.run_round(
            batch.step, pids, mem.problems.matrix(pids), exp.problem_text,
            lambda p: (ins.texts(p, "strategy"), ins.texts(p, "lesson")),
            exp.success_rate, exp.leak_strings, timed, mem.embed, memory_cfg=c)
        stats.merge({f"behavior/{k}": v for k, v in counts.items()})
        stats.add("behavior_round")
        stats.seconds["behavior_round"] = time.perf_counter() - tg
        return timed.seconds

    def _eligible(self, b: Behavior, query: ContextQuery) -> bool:
        """Last written from an earlier step's evidence than the row's (own-attempt guard)."""
        return query.before_step is None or b.updated_step < query.before_step

    def _add(self, ctx: TeacherContext, b: Behavior) -> None:
        toks = self.memory.extra_tokens
        name, ins = resanitize(b.name, toks), resanitize(b.instruction, toks)
        if name and ins:
            ctx.add_item("behaviors", (name, ins),
                         evidence_key(b.docid, f"{b.name}\n{b.instruction}"),
                         dict(item=b.docid, **b.provenance.to_json()))

    def fill_context(self, ctx: TeacherContext, query: ContextQuery) -> None:
        """The ``top_k`` behaviors nearest the row's problem, written before its step."""
        top_k = self.memory.config.behavior.top_k
        bank = self.store
        if not (self.enabled and top_k > 0 and bank.behaviors):
            return
        q = self.memory.problem_vector(query.problem_id, query.problem_text)
        # retrieve past the ineligible ones (written this step), then keep top_k
        k = top_k if query.before_step is None else len(bank.behaviors)
        chosen = [b for b in bank.retrieve(q, k) if self._eligible(b, query)]
        for b in chosen[:top_k]:
            self._add(ctx, b)

    def fill_control(self, ctx: TeacherContext, real: TeacherContext,
                     query: ContextQuery) -> None:
        """Control "random_other_problem": as many behaviors as ``real`` holds, drawn at
        random from the eligible bank instead of retrieved for the problem (a small bank
        cannot hold as many others as the problem's nearest, so the draw may repeat them)."""
        want = len(real.behaviors)
        if not (self.enabled and want and query.rng is not None):
            return
        pool = sorted(d for d, b in self.store.behaviors.items() if self._eligible(b, query))
        for i in query.rng.permutation(len(pool))[:want]:
            self._add(ctx, self.store.behaviors[pool[int(i)]])

    def stats(self) -> dict[str, Any]:
        bank = self.store
        return dict(behaviors=len(bank.behaviors), clusters=len(bank.centroids),
                    behavior_rounds=bank.rounds)

    def export_rows(self) -> Iterator[dict[str, Any]]:
        bank = self.store
        for b in bank.behaviors.values():
            # key_vector: what the bank retrieves it by (behavior.key), so that a reader of
            # memory.jsonl (pmd_jax/probe) retrieves behaviors for a problem as the memory does
            key = (bank.index.vector(b.docid).tolist() if b.docid in bank.index else None)
            yield dict(level="behavior", docid=b.docid, name=b.name, instruction=b.instruction,
                       cluster_id=b.cluster_id, version=b.version, created_step=b.created_step,
                       updated_step=b.updated_step, provenance=b.provenance.to_json(),
                       key_vector=key)
        for i, s in enumerate(bank.summaries):
            yield dict(level="cluster", cluster_id=i, summary=s, members=bank.members.get(i, []))

    def html_section(self) -> list[str]:
        e = html.escape
        bb = self.store
        out = ["<h2>Behaviors per cluster</h2>"]
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
        return out
