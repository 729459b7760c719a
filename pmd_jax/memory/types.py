"""Plain data the memory takes in and gives out. No model, task or JAX types here."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class RolloutRecord:
    """One verified rollout, filled by the trainer (the memory never imports tasks)."""

    problem_id: str
    problem_text: str
    step: int
    rollout_index: int
    response_text: str
    reward: float
    feedback: str = ""
    leak_strings: list[str] = dataclasses.field(default_factory=list)

    def validate(self) -> None:
        if not isinstance(self.problem_id, str) or not self.problem_id:
            raise ValueError(f"RolloutRecord.problem_id must be a non-empty str: {self!r:.200}")
        if not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"RolloutRecord.step must be an int >= 0, got {self.step!r}")
        if not isinstance(self.rollout_index, int) or self.rollout_index < 0:
            raise ValueError(
                f"RolloutRecord.rollout_index must be an int >= 0, got {self.rollout_index!r}"
            )
        try:
            r = float(self.reward)
        except (TypeError, ValueError):
            raise ValueError(f"RolloutRecord.reward must be a number, got {self.reward!r}")
        if not r == r:  # NaN
            raise ValueError(f"RolloutRecord.reward is NaN for problem {self.problem_id}")


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where an item came from: which problems, step, rollouts (indices) and their rewards."""

    source: str  # "rollout" | "reflection" | "extraction" | "evolution"
    step: int
    problem_ids: tuple[str, ...]
    rollout_indices: tuple[int, ...] = ()
    rewards: tuple[float, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return dict(
            source=self.source,
            step=self.step,
            problem_ids=list(self.problem_ids),
            rollout_indices=list(self.rollout_indices),
            rewards=list(self.rewards),
        )

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Provenance:
        return cls(
            source=str(d["source"]),
            step=int(d["step"]),
            problem_ids=tuple(str(p) for p in d["problem_ids"]),
            rollout_indices=tuple(int(i) for i in d.get("rollout_indices", ())),
            rewards=tuple(float(r) for r in d.get("rewards", ())),
        )


@dataclasses.dataclass
class ExperienceItem:
    """Level 1: one stored rollout (sanitised, capped)."""

    docid: str
    problem_id: str
    step: int
    rollout_index: int
    response_text: str
    reward: float
    feedback: str
    success: bool
    seq: int  # global insertion order, for FIFO eviction

    def provenance(self) -> Provenance:
        return Provenance("rollout", self.step, (self.problem_id,), (self.rollout_index,),
                          (self.reward,))


@dataclasses.dataclass
class InsightItem:
    """Level 2: one strategy (what worked) or lesson (recurring mistake) for one problem."""

    docid: str
    problem_id: str
    kind: str  # "strategy" | "lesson"
    text: str
    provenance: Provenance
    support: int = 1  # times this item (or a near-duplicate) was reflected
    last_step: int = 0


@dataclasses.dataclass
class Behavior:
    """Level 3: a reusable name/instruction pair attached to a semantic cluster."""

    docid: str
    name: str
    instruction: str
    cluster_id: int
    provenance: Provenance
    created_step: int
    updated_step: int
    version: int = 1


@dataclasses.dataclass
class MemoryUpdateStats:
    step: int
    frozen: bool = False
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + int(n)

    def merge(self, counts: dict[str, int]) -> None:
        for k, v in counts.items():
            self.add(k, v)
