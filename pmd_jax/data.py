"""Deterministic problem stream with a resumable cursor.

Each epoch is a seeded permutation of the training problems; the cursor (epoch, position) is
all the state there is, so a restored run draws exactly the batches it would have drawn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")


@dataclasses.dataclass
class DataCursor:
    epoch: int = 0
    position: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> DataCursor:
        return cls(int(d["epoch"]), int(d["position"]))


class ProblemStream(Generic[T]):
    """Draws batches of problems epoch by epoch in a seeded order (no problem repeats within
    an epoch; a batch that crosses an epoch boundary continues into the next permutation)."""

    def __init__(self, items: Sequence[T], seed: int, cursor: DataCursor | None = None) -> None:
        if not items:
            raise ValueError("ProblemStream needs at least one problem")
        self.items = list(items)
        self.seed = int(seed)
        self.cursor = cursor or DataCursor()

    def _order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        return rng.permutation(len(self.items))

    def next_batch(self, size: int) -> list[T]:
        out: list[T] = []
        while len(out) < size:
            order = self._order(self.cursor.epoch)
            take = min(size - len(out), len(order) - self.cursor.position)
            idx = order[self.cursor.position : self.cursor.position + take]
            out.extend(self.items[i] for i in idx)
            self.cursor.position += take
            if self.cursor.position >= len(order):
                self.cursor = DataCursor(self.cursor.epoch + 1, 0)
        return out


def select_demonstrations(
    rewards: np.ndarray, threshold: float, exclude_self: bool = True
) -> np.ndarray:
    """For rewards [B, G], the index of the demonstration each rollout's teacher sees, or -1.

    The demonstration is the first successful rollout (reward >= threshold) of the same group;
    with ``exclude_self`` a rollout never gets its own attempt (SDPO's
    ``dont_reprompt_on_self_success``), so a lone success gets -1.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [groups, rollouts], got shape {rewards.shape}")
    success = rewards >= threshold
    b, g = rewards.shape
    out = np.full((b, g), -1, dtype=np.int64)
    for i in range(b):
        wins = np.flatnonzero(success[i])
        for j in range(g):
            cands = wins[wins != j] if exclude_self else wins
            if cands.size:
                out[i, j] = int(cands[0])
    return out
