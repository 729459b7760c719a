"""The probe's arms: what each puts into one problem's prompt.

Every arm is the teacher's reprompt template (``loop.teaching.memory_prompt``) with one thing
changed, so that two arms differ in one thing only:

On training problems (the memory holds their items):
- ``none``: no memory text (SDPO's reprompt without a demonstration);
- ``own_insights``: the problem's own strategies and lessons (what the memory shows it);
- ``other_insights``: another problem's, matched per section in count and, among the
  problems that can match the count, the closest in total length;
- ``own_behaviors``: the ``behavior.top_k`` behaviors retrieved for the problem (the memory's
  retrieval: its embedding against each behavior's key);
- ``other_behaviors``: those retrieved for a random other training problem (same count);
- ``own_success`` (positive control): the problem's own remembered passing attempt, under
  "Correct solution:" as the memory shows it;
- ``planted`` (positive control): an item known to be true, written by the task from its gold
  (:func:`planted_item`), not by the model.

On held-out problems (never in the memory):
- ``none``; ``planted``;
- ``nearest_insights``: the strategies and lessons of the nearest training problem that has
  any (by the memory's problem embeddings); ``random_insights``: a random other training
  problem's, matched as ``other_insights`` is;
- ``nearest_behaviors``: retrieved for the held-out problem; ``random_behaviors``: as many
  drawn at random from the bank (the memory's own random control).

An arm that has nothing to show for a problem (no insights, no success, an empty bank) is
undefined there: the problem leaves that arm's contrasts, and the report counts it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from pmd_jax.memory.index import ScannIndex
from pmd_jax.probe.memory_file import ProbeMemory

TRAIN_ARMS = ("none", "own_insights", "other_insights", "own_behaviors", "other_behaviors",
              "own_success", "planted")
HELDOUT_ARMS = ("none", "nearest_insights", "random_insights", "nearest_behaviors",
                "random_behaviors", "planted")

# (problem group, arm A, arm B, role): each contrast is A minus B over the problems where
# both are defined. The first is the probe's primary contrast.
CONTRASTS: tuple[tuple[str, str, str, str], ...] = (
    ("train", "own_insights", "other_insights", "primary: content of insights"),
    ("train", "own_behaviors", "other_behaviors", "content of behaviors"),
    ("train", "own_insights", "none", "insights vs none"),
    ("train", "other_insights", "none", "another problem's insights vs none"),
    ("train", "own_behaviors", "none", "behaviors vs none"),
    ("train", "own_success", "none", "positive control"),
    ("train", "planted", "none", "positive control"),
    ("heldout", "nearest_insights", "random_insights", "retrieval of insights"),
    ("heldout", "nearest_behaviors", "random_behaviors", "retrieval of behaviors"),
    ("heldout", "nearest_insights", "none", "nearest insights vs none"),
    ("heldout", "nearest_behaviors", "none", "nearest behaviors vs none"),
    ("heldout", "planted", "none", "positive control"),
)


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One arm's memory text for one problem: list-section items and a demonstration."""

    items: tuple[tuple[str, Any], ...] = ()
    successful_attempt: str | None = None


NONE = Attempt()


def check_arms(group: str, arms: Sequence[str]) -> list[str]:
    """The arms of ``group`` in canonical order; an unknown name raises ValueError."""
    known = TRAIN_ARMS if group == "train" else HELDOUT_ARMS
    bad = [a for a in arms if a not in known]
    if bad:
        raise ValueError(f"unknown {group} arm(s) {bad}; known: {', '.join(known)}")
    want = set(arms) | {"none"}
    return [a for a in known if a in want]


def planted_item(task: Any, problem: Any) -> str | None:
    """A true item written from the task's gold (the positive control), or None.

    Tasks with options: the gold option's text ("The correct option is ..."). Code tasks with
    a reference program: the reference, as a worked solution. Other tasks: None (the arm is
    undefined there)."""
    owner = task.owner(problem) if hasattr(task, "owner") else task
    meta = getattr(problem, "meta", {}) or {}
    if "options" in meta:
        gold = str(meta.get("gold_text") or "").strip()
        if not gold and "gold_index" in meta:
            gold = str(meta["options"][int(meta["gold_index"])])
        return f'The correct option is "{gold}".' if gold else None
    ref = str(meta.get("reference") or "").strip()
    if ref and getattr(owner, "test_indices", None) is not None:
        return f"A correct program for this problem:\n```python\n{ref}\n```"
    return None


# ----------------------------------------------------------------------------- retrieval
class Retrieval:
    """Problem embeddings and the behavior bank's retrieval, as the memory does them:
    ``embed(texts, query=True)`` of the sanitised problem text, each behavior's key vector,
    a ``ScannIndex`` with the memory's index settings."""

    def __init__(self, memory: ProbeMemory, vectors: Mapping[str, np.ndarray],
                 index_cfg: Any, top_k: int) -> None:
        self.memory = memory
        self.vectors = dict(vectors)
        self.top_k = int(top_k)
        self.rows = {b.docid: b for b in memory.behaviors}
        keys: list[tuple[str, np.ndarray]] = []
        for b in memory.behaviors:
            if b.key_vector is not None:
                keys.append((b.docid, np.asarray(b.key_vector, np.float32)))
                continue
            members = [self.vectors[m] for m in memory.clusters.get(b.cluster_id, [])
                       if m in self.vectors]
            if members:  # an older export: the cluster's centroid, rebuilt
                v = np.mean(members, axis=0)
                keys.append((b.docid, (v / max(1e-12, float(np.linalg.norm(v))))
                             .astype(np.float32)))
        self.index = None
        if keys:
            dim = keys[0][1].shape[0]
            self.index = ScannIndex(dim, index_cfg)
            self.index.upsert([d for d, _ in keys], np.stack([v for _, v in keys]))
        self.with_insights = [p for p in memory.problems_with_insights() if p in self.vectors]
        self.problem_index = None
        if self.with_insights:
            self.problem_index = ScannIndex(self.vectors[self.with_insights[0]].shape[0],
                                            index_cfg)
            self.problem_index.upsert(self.with_insights,
                                      np.stack([self.vectors[p] for p in self.with_insights]))

    def behaviors_for(self, vector: np.ndarray) -> list[tuple[str, str]]:
        if self.index is None or self.top_k <= 0:
            return []
        ids, _ = self.index.search(np.asarray(vector, np.float32)[None], self.top_k)
        return [(self.rows[d].name, self.rows[d].instruction) for d in ids[0]]

    def nearest_with_insights(self, vector: np.ndarray, exclude: str | None = None
                              ) -> str | None:
        if self.problem_index is None:
            return None
        k = min(2, len(self.with_insights))
        ids, _ = self.problem_index.search(np.asarray(vector, np.float32)[None], k)
        for d in ids[0]:
            if d != exclude:
                return d
        return None


def matched_items(own: Sequence[tuple[str, Any]], pool: Mapping[str, Sequence[tuple[str, Any]]],
                  exclude: set[str], order: Sequence[str]) -> list[tuple[str, Any]] | None:
    """Another problem's items matched to ``own``: as many of each section (its first ones),
    from the donor (not in ``exclude``) whose picked items are closest to ``own`` in total
    characters; ties go to the donor earlier in ``order`` (a seeded permutation). None when
    no donor has enough items of every section."""
    need = Counter(section for section, _ in own)
    length = sum(len(str(v)) for _, v in own)
    best: tuple[int, list[tuple[str, Any]]] | None = None
    for pid in order:
        if pid in exclude or pid not in pool:
            continue
        picked: list[tuple[str, Any]] = []
        for section, n in need.items():
            have = [it for it in pool[pid] if it[0] == section][:n]
            if len(have) < n:
                break
            picked.extend(have)
        else:
            gap = abs(sum(len(str(v)) for _, v in picked) - length)
            if best is None or gap < best[0]:
                best = (gap, picked)
    return best[1] if best is not None else None


def build_attempts(group: str, arms: Sequence[str], pids: Sequence[str], memory: ProbeMemory,
                   retrieval: Retrieval, vectors: Mapping[str, np.ndarray],
                   planted: Callable[[str], str | None], rng: np.random.Generator
                   ) -> tuple[dict[str, list[Attempt | None]], dict[str, Any]]:
    """Per arm, one :class:`Attempt` per problem of ``pids`` (None where the arm is undefined),
    and diagnostics (the behaviors' overlap between the arms of a behavior contrast)."""
    out: dict[str, list[Attempt | None]] = {a: [] for a in arms}
    pool = {p: memory.insights[p] for p in retrieval.with_insights}
    overlap: list[float] = []
    donors = sorted(pool)
    for pid in pids:
        order = [donors[int(i)] for i in rng.permutation(len(donors))]
        vec = vectors[pid]
        own_ins = memory.insights.get(pid, []) if group == "train" else []
        own_beh = retrieval.behaviors_for(vec)
        nearest = (retrieval.nearest_with_insights(vec, exclude=pid) if group == "heldout"
                   else None)
        near_ins = list(memory.insights.get(nearest, [])) if nearest else []
        other_pid = None
        others = [p for p in vectors if p != pid and p in retrieval.vectors and p in pool]
        if others:
            other_pid = sorted(others)[int(rng.integers(len(others)))]
        for arm in arms:
            att: Attempt | None
            if arm == "none":
                att = NONE
            elif arm == "own_insights":
                att = Attempt(tuple(own_ins)) if own_ins else None
            elif arm == "other_insights":
                m = matched_items(own_ins, pool, {pid}, order) if own_ins else None
                att = Attempt(tuple(m)) if m else None
            elif arm in ("own_behaviors", "nearest_behaviors"):
                att = (Attempt(tuple(("behaviors", b) for b in own_beh)) if own_beh else None)
            elif arm == "other_behaviors":
                other = (retrieval.behaviors_for(retrieval.vectors[other_pid])
                         if other_pid else [])[:len(own_beh)]
                att = (Attempt(tuple(("behaviors", b) for b in other))
                       if own_beh and len(other) == len(own_beh) else None)
                if att is not None:
                    overlap.append(len(set(own_beh) & set(other)) / len(own_beh))
            elif arm == "random_behaviors":
                bank = [(b.name, b.instruction) for b in memory.behaviors]
                pick = [bank[int(i)] for i in rng.permutation(len(bank))[:len(own_beh)]]
                att = (Attempt(tuple(("behaviors", b) for b in pick))
                       if own_beh and len(pick) == len(own_beh) else None)
                if att is not None:
                    overlap.append(len(set(own_beh) & set(pick)) / len(own_beh))
            elif arm == "own_success":
                s = memory.successes.get(pid)
                att = Attempt(successful_attempt=s) if s else None
            elif arm == "planted":
                text = planted(pid)
                att = Attempt((("strategies", text),)) if text else None
            elif arm == "nearest_insights":
                att = Attempt(tuple(near_ins)) if near_ins else None
            elif arm == "random_insights":
                ex = {pid} | ({nearest} if nearest else set())
                m = matched_items(near_ins, pool, ex, order) if near_ins else None
                att = Attempt(tuple(m)) if m else None
            else:
                raise ValueError(f"unknown arm {arm!r}")
            out[arm].append(att)
    diag = {"behavior_overlap_mean": float(np.mean(overlap)) if overlap else None}
    return out, diag
