"""The interface every procedural-memory level implements (issue 16, item 3).

:class:`~pmd_jax.memory.memory.ProceduralMemory` holds its levels as a list (``LEVELS`` in
memory/memory.py, the one place a level is registered) and only ever talks to them through
this interface:

- ``update(batch, stats)``: take in one step's rollouts (between training steps), in list
  order; returns the seconds spent generating with the policy;
- ``fill_context(ctx, query)``: write this level's sections of one teacher context (the
  sections are keyed by level: :data:`pmd_jax.memory.context.SECTIONS`); levels fill in
  increasing ``context_rank``, which fixes the order of the control modes' RNG draws and of
  the provenance entries; ``fill_control(ctx, real, query)``: the random-memory control's
  parts, in the form of the real context ``real`` (same sections and counts);
- ``stats()`` / ``index_rebalances()``: the level's part of ``ProceduralMemory.stats()``;
- ``state_dict()`` / ``load_state_dict()``: its part of the checkpoint, under ``state_key``;
- ``export_rows()``: its rows of ``memory.jsonl`` (each with ``level=...``);
  ``html_section()``: its own section of ``memory.html``; ``html_problems()`` /
  ``html_problem(pid)``: its part of the per-problem section (in ``context_rank`` order).

A level is built as ``Level(memory)`` and reads what it needs from the memory, as
:class:`LevelHost` declares it: ``config`` (its section is ``config.<name>``, its switch
``config.levels.<name>``), ``dim``, ``extra_tokens``, ``embed``, the problem index
``problems`` and the other levels' stores (``experience``, ``insights``). The memory
imports the levels; a level does not import the memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from pmd_jax.memory.config import MemoryConfig
from pmd_jax.memory.context import TeacherContext
from pmd_jax.memory.index import ScannIndex
from pmd_jax.memory.types import MemoryUpdateStats, RolloutRecord
from pmd_jax.sampling.base import TextGenerator


@dataclasses.dataclass
class StepRollouts:
    """One step's rollouts as every level's ``update`` sees them (validated)."""

    step: int
    records: Sequence[RolloutRecord]
    by_problem: dict[str, list[RolloutRecord]]  # in first-seen order
    generator: TextGenerator | None


@dataclasses.dataclass
class ContextQuery:
    """The rollout a teacher context is built for."""

    problem_id: str
    problem_text: str
    student_response: str | None
    rng: np.random.Generator | None  # set in control mode "random_other_problem"
    # Items written from this step's rollouts or later are not shown (None: no limit): a
    # row's teacher never sees what was written about its own attempt.
    before_step: int | None = None


class ExperienceView(Protocol):
    """What the other levels read of the experience level's store (``ExperienceStore``)."""

    problem_text: dict[str, str]
    leak_strings: dict[str, list[str]]

    def success_rate(self, pid: str) -> float: ...


class InsightView(Protocol):
    """What the behavior level reads of the insight level's store (``InsightStore``)."""

    def texts(self, pid: str, kind: str) -> list[str]: ...


class LevelHost(Protocol):
    """What a level reads of the memory that holds it (``ProceduralMemory``, which imports
    the levels; a level never imports it)."""

    config: MemoryConfig
    dim: int  # the embedder's dimension
    extra_tokens: tuple[str, ...]  # memory.context.extra_control_tokens
    problems: ScannIndex  # problem embeddings, docid = problem id
    last_update_step: int

    @property
    def experience(self) -> ExperienceView: ...

    @property
    def insights(self) -> InsightView: ...

    def embed(self, texts: list[str]) -> np.ndarray: ...

    def problem_vector(self, problem_id: str, problem_text: str) -> np.ndarray: ...


class MemoryLevel:
    """Base class of a memory level; the defaults make every part optional."""

    name: ClassVar[str]  # config switch memory.levels.<name>; the JSONL rows' "level"
    state_key: ClassVar[str]  # its key in ProceduralMemory.state_dict()
    context_rank: ClassVar[int] = 0  # levels fill a teacher context in increasing rank

    def __init__(self, memory: LevelHost) -> None:
        self.memory = memory

    @property
    def enabled(self) -> bool:
        """``config.levels.<name>``: updated and shown to the teacher (ablations)."""
        return bool(getattr(self.memory.config.levels, self.name))

    def update(self, batch: StepRollouts, stats: MemoryUpdateStats) -> float:
        return 0.0

    def fill_context(self, ctx: TeacherContext, query: ContextQuery) -> None:
        return None

    def fill_control(self, ctx: TeacherContext, real: TeacherContext,
                     query: ContextQuery) -> None:
        """Control "random_other_problem": fill ``ctx`` with this level's parts in the form
        of ``real`` (the context the mode would show: same sections, as many items) and with
        other problems' content, drawn with ``query.rng``."""
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    # A level keeps its items in ``self.store`` (set in its __init__); checkpoints and the
    # retrieval index's counters are the store's.
    store: Any

    def index_rebalances(self) -> int:
        index = getattr(getattr(self, "store", None), "index", None)
        return int(index.rebalances) if index is not None else 0

    def state_dict(self) -> dict[str, Any]:
        return self.store.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.store.load_state_dict(state)

    def export_rows(self) -> Iterator[dict[str, Any]]:
        return iter(())

    def html_section(self) -> list[str]:
        return []

    def html_problems(self) -> set[str]:
        return set()

    def html_problem(self, problem_id: str) -> list[str]:
        return []
