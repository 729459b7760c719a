"""The run's task from its config, without the run's checks (``build.build_task`` adds the
held-out check and the sandbox probe). ``tasks/heldout.py`` builds tasks through this, so the
tasks package never imports the start-up module above it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pmd_jax.tasks.registry import get_task, task_kwargs
from pmd_jax.tasks.splits import TransferTask

if TYPE_CHECKING:
    from pmd_jax.config.sections import TaskConfig


def load_task(t: TaskConfig, seed: int) -> Any:
    """``task.name``'s task (with ``task.path`` for bring-your-own data); with
    ``task.eval_task`` set to another task a TransferTask: "train" from task.name, the
    evaluation split from task.eval_task (e.g. MBPP -> HumanEval)."""

    kw = task_kwargs(t, t.name, int(seed))
    if t.path:
        kw["path"] = t.path
    task = get_task(t.name, **kw)
    eval_name = str(t.eval_task or "")
    if eval_name and eval_name != t.name:
        task = TransferTask(task, get_task(eval_name, **task_kwargs(t, eval_name, int(seed))))
    return task
