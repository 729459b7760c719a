"""``mode=mel`` in the mode registry (:mod:`pmd_jax.modes`): GRPO plus the kept lessons' NLL
(:mod:`pmd_jax.modes.mel.lessons`); after the verification of a step its reflections on right/wrong
pairs and the replay filter run as the mode's host work, and the kept lessons join the train
batch as lesson rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pmd_jax.modes import ModeRuntime, ModeSpec, register_mode
from pmd_jax.modes.mel import lessons

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig


class MelRuntime(ModeRuntime):
    """The step's lessons, made by :meth:`host_work` and turned into rows by
    :meth:`extra_rows` for the same step."""

    work_name = "mel"

    def __init__(self, cfg: RunConfig, model: Any, task: Any) -> None:
        self.cfg, self.model, self.task = cfg, model, task
        self._step: Any = None  # lessons.StepLessons of the step being built

    def host_work(self, step: int, sb: Any, memory: Any, textgen: Any) -> dict[str, float]:
        self._step = lessons.run_step(self.cfg, self.model, self.task, textgen.sampler, sb)
        return dict(self._step.stats)

    def extra_rows(self, sb: Any, row_multiple: int) -> dict[str, Any]:
        done, self._step = self._step, None
        if done is None:
            return {}
        return lessons.lesson_rows(self.cfg, self.model, self.task, sb, done.kept,
                                   row_multiple)


def _runtime(cfg: RunConfig, model: Any, task: Any, train_problems: Sequence[Any],
             eval_problems: Sequence[Any]) -> MelRuntime:
    return MelRuntime(cfg, model, task)


MEL = register_mode(ModeSpec(
    name="mel", teacher="none", default_loss="mel", lesson_rows=True, needs_groups=True,
    runtime=_runtime,
    doc="Meta-Experience Learning: GRPO plus the NLL of lessons the policy wrote on its "
        "right/wrong pairs and that a replay confirmed."))
