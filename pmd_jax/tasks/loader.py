"""The run's task from its config, without the run's checks (``build.build_task`` adds the
held-out check and the sandbox probe). ``tasks/heldout.py`` builds tasks through this, so the
tasks package never imports the start-up module above it."""

from __future__ import annotations

from typing import Any


def load_task(cfg: Any) -> Any:
    """``task.name``'s task (with ``task.path`` for bring-your-own data); with
    ``task.eval_task`` set to another task a TransferTask: "train" from task.name, the
    evaluation split from task.eval_task (e.g. MBPP -> HumanEval)."""
    from pmd_jax.tasks.registry import get_task, task_kwargs
    from pmd_jax.tasks.splits import TransferTask

    kw = task_kwargs(cfg.task, cfg.task.name, int(cfg.seed))
    if cfg.task.path:
        kw["path"] = cfg.task.path
    task = get_task(cfg.task.name, **kw)
    eval_name = str(cfg.task.eval_task or "")
    if eval_name and eval_name != cfg.task.name:
        task = TransferTask(task, get_task(eval_name, **task_kwargs(cfg.task, eval_name,
                                                                      int(cfg.seed))))
    return task
