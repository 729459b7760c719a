"""The rollout phase's data: the problem stream and a step's rollout record.

:class:`ProblemStream` draws the training problems: each epoch is a seeded permutation of them;
the cursor (epoch, position) is all the state there is, so a restored run draws exactly the
batches it would have drawn. :class:`StepBatch` is what one step's rollouts carry through the
loop (sampled, then verified, then turned into teacher prompts and a train batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from pmd_jax.sampling.base import Rollouts

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



@dataclasses.dataclass(frozen=True)
class Verdicts:
    """What verification made of a step's rollouts: one task result per rollout (reward,
    feedback, ...) in rollout order, and the rewards as ``[B, G]``."""

    results: list[Any]
    rewards: np.ndarray


@dataclasses.dataclass
class StepBatch:
    """Host-side record of one step's rollouts (prompt-major, G rollouts per problem).

    ``messages``: each problem's prompt as the task writes it (``task.prompt``, computed once
    when the problems are drawn; the student's rollout prompt may add to it, e.g. fast_slow's
    context). ``rewards`` / ``results`` are empty until :meth:`verified` gives the verified
    batch."""

    problems: list[Any]
    student_prompts: list[list[int]]
    rollouts: Rollouts
    texts: list[str]
    rewards: np.ndarray  # [B, G]
    results: list[Any]
    step: int = -1  # the training step these rollouts are for
    weights_version: int = 0  # the policy version (published step) that sampled them
    skipped: int = 0  # problems skipped for over-long prompts while drawing this batch
    sample_seconds: float = 0.0  # wall time of the generate() call (wherever it ran)
    prefetched: bool = False  # sampled during the previous step (rollout.overlap)
    messages: list[Any] = dataclasses.field(default_factory=list)

    def verified(self, v: Verdicts) -> StepBatch:
        """This batch with its verdicts (a new record; this one is unchanged)."""
        return dataclasses.replace(self, results=list(v.results), rewards=v.rewards)


@dataclasses.dataclass
class Drawn:
    """A step's problems and prompts, drawn from the data stream (main thread) before the
    generate() call, which may run in the background sampler thread."""

    step: int
    problems: list[Any]
    prefixes: list[str]
    prompts: list[list[int]]
    skipped: int
    messages: list[Any]  # each problem's task prompt (StepBatch.messages)
