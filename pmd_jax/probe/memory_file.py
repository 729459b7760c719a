"""A memory as the probe reads it: a run's ``memory.jsonl`` (the export every memory mode
writes at the end of a run; plain JSON, no pickles, so a memory written by another model or
shared by another user is read the same way).

What the probe takes from it, per level:
- experience: each problem's latest remembered success (``success`` rows, the highest step,
  then the highest rollout index: what ``ExperienceStore.remembered_success`` returns);
- insight: each problem's strategies and lessons, in file order (the store's order);
- behavior: the bank, with the vector each behavior is retrieved by (``key_vector``, written
  since the probe exists). A file without it (an export older than the probe) gets each
  behavior's key rebuilt from its cluster's members: the mean of their problem embeddings,
  normalised, which is what a cluster centroid is made of, but not the centroid of the round
  that wrote the behavior; :attr:`ProbeMemory.keys_rebuilt` says so and the report prints it.

A malformed line is counted (``bad_rows``) and skipped; a missing file, or one with no items,
raises :class:`MemoryFileError` naming the path.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Any


class MemoryFileError(ValueError):
    """The memory file cannot be used (missing, empty, or no row of a known level)."""


@dataclasses.dataclass(frozen=True)
class BehaviorRow:
    docid: str
    name: str
    instruction: str
    cluster_id: int
    key_vector: tuple[float, ...] | None


@dataclasses.dataclass
class ProbeMemory:
    source: str
    # problem id -> [(section, text)]: strategies first, then lessons (the teacher's order)
    insights: dict[str, list[tuple[str, str]]]
    behaviors: list[BehaviorRow]
    # cluster id -> member problem ids (the behavior rounds' clusters)
    clusters: dict[int, list[str]]
    # problem id -> its latest remembered success (response text)
    successes: dict[str, str]
    bad_rows: int = 0
    keys_rebuilt: bool = False

    def problems_with_insights(self) -> list[str]:
        return sorted(p for p, items in self.insights.items() if items)

    def summary(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "problems_with_insights": len(self.problems_with_insights()),
            "strategies": sum(s == "strategies" for v in self.insights.values() for s, _ in v),
            "lessons": sum(s == "lessons" for v in self.insights.values() for s, _ in v),
            "behaviors": len(self.behaviors),
            "clusters": len(self.clusters),
            "problems_with_a_success": len(self.successes),
            "bad_rows": self.bad_rows,
            "behavior_keys": "rebuilt from cluster members" if self.keys_rebuilt else
                             ("exported" if self.behaviors else "none"),
        }


_SECTIONS = {"strategy": "strategies", "lesson": "lessons"}


def load_memory_file(path: str | Path) -> ProbeMemory:
    """Reads ``path`` (a ``memory.jsonl``, gzipped or not, or a run folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "memory.jsonl"
    if not p.is_file():
        raise MemoryFileError(
            f"no memory file at {p}: give a run's memory.jsonl (written at the end of a run "
            "of a memory mode, e.g. --config.mode=memory_only) or the run folder")
    strategies: dict[str, list[str]] = {}
    lessons: dict[str, list[str]] = {}
    behaviors: list[BehaviorRow] = []
    clusters: dict[int, list[str]] = {}
    best: dict[str, tuple[int, int, str]] = {}
    bad = 0
    raw = p.read_bytes()
    if p.suffix == ".gz":
        raw = gzip.decompress(raw)
    for line in raw.decode("utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            level = row["level"]
            if level == "insight":
                kind = row["kind"]
                if kind not in _SECTIONS:
                    raise ValueError(kind)
                dest = strategies if kind == "strategy" else lessons
                dest.setdefault(str(row["problem_id"]), []).append(str(row["text"]))
            elif level == "behavior":
                kv = row.get("key_vector")
                behaviors.append(BehaviorRow(
                    str(row["docid"]), str(row["name"]), str(row["instruction"]),
                    int(row.get("cluster_id", -1)),
                    tuple(float(x) for x in kv) if kv else None))
            elif level == "cluster":
                clusters[int(row["cluster_id"])] = [str(m) for m in row.get("members", [])]
            elif level == "experience":
                if row.get("success"):
                    pid = str(row["problem_id"])
                    key = (int(row["step"]), int(row["rollout_index"]), str(row["response_text"]))
                    if pid not in best or key[:2] > best[pid][:2]:
                        best[pid] = key
            else:
                raise ValueError(f"level {level!r}")
        except (ValueError, KeyError, TypeError):
            bad += 1
    insights = {pid: [("strategies", t) for t in strategies.get(pid, [])]
                + [("lessons", t) for t in lessons.get(pid, [])]
                for pid in sorted(set(strategies) | set(lessons))}
    if not (insights or behaviors or best):
        raise MemoryFileError(f"{p} holds no memory item ({bad} malformed rows): nothing to "
                              "probe")
    return ProbeMemory(source=str(p), insights=insights, behaviors=behaviors,
                       clusters=clusters, successes={k: v[2] for k, v in best.items()},
                       bad_rows=bad,
                       keys_rebuilt=any(b.key_vector is None for b in behaviors))
