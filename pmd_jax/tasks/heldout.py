"""Held-out evaluation checks of a run config (called by ``config.config_errors``).

A run trains on its task's "train" problems and evaluates on ``task.eval_split`` of its task,
or of ``task.eval_task`` when that is set (e.g. MBPP -> HumanEval), the first
``task.max_eval_problems`` of them (as the trainer takes them). Evaluation problems that are
also training problems (same problem id) make the "held-out" accuracy a training accuracy: the
config is refused, unless ``eval.allow_in_sample=True``; then every evaluation number of the
run is labelled "in-sample" (``tasks.evaluation``, the eval metrics, the trainer's log).

Building a task reads its problem files only (no model); the ids are cached per task config.
"""

from __future__ import annotations

import functools
import json
import os
from typing import TYPE_CHECKING, Any

import ml_collections

from pmd_jax.config.schema import freeze_section
from pmd_jax.config.sections import TaskConfig
from pmd_jax.tasks.loader import load_task
from pmd_jax.tasks.registry import get_spec, task_names, task_specs
from pmd_jax.tasks.splits import IN_SAMPLE, overlapping_ids

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig, TaskConfig


def eval_problems(t: TaskConfig, task: Any) -> list[Any]:
    """The problems the run evaluates on (as ``Trainer`` selects them)."""
    return task.problems(t.eval_split)[: t.max_eval_problems]


def eval_overlap(t: TaskConfig, task: Any) -> tuple[list[str], int]:
    """(ids both trained and evaluated on, number of evaluation problems)."""
    ev = eval_problems(t, task)
    return overlapping_ids(task.problems("train"), ev), len(ev)


def in_sample_message(cfg: RunConfig, overlap: list[str], n_eval: int) -> str:
    src = cfg.task.eval_task or cfg.task.name
    shown = ", ".join(overlap[:3]) + (", ..." if len(overlap) > 3 else "")
    return (
        f"in-sample evaluation: {len(overlap)} of the {n_eval} evaluation problems (task "
        f"{src!r}, split {cfg.task.eval_split!r}) are also training problems of task "
        f"{cfg.task.name!r} "
        f"(ids {shown}): its accuracy would be in-sample, not held-out. Evaluate on held-out "
        "problems (task.eval_split, task.eval_task, or the MBPP / GSM8K split sizes "
        "task.*_train_size / task.*_eval_size), or set eval.allow_in_sample=True to run "
        f"anyway with every evaluation number labelled {IN_SAMPLE!r}"
    )


def _int_at_least_1(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def heldout_config_errors(c: RunConfig) -> list[str]:
    """Problems with the split options, then (when there are none) the overlap check."""

    errs: list[str] = []
    t = c.task
    seed = t.split_seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        errs.append(f"task.split_seed must be an integer, got {seed!r}")
    for name, total in ((s.name, s.split_total) for s in task_specs() if s.split_total):
        tr, ev = getattr(t, f"{name}_train_size"), getattr(t, f"{name}_eval_size")
        if not (_int_at_least_1(tr) and _int_at_least_1(ev)):
            errs.append(f"task.{name}_train_size and task.{name}_eval_size must be integers "
                        f">= 1, got {tr!r} and {ev!r}")
        elif tr + ev > total:
            errs.append(f"task.{name}_train_size + task.{name}_eval_size = {tr} + {ev} = "
                        f"{tr + ev} exceeds the {total} {name} problems (the two are disjoint)")
    eval_task = t.eval_task
    if not isinstance(eval_task, str) or (eval_task and eval_task not in task_names()):
        errs.append(f"task.eval_task={eval_task!r} must be '' (the task's own held-out split) "
                    f"or a known task: {', '.join(task_names())}")
    for name in sorted({t.name, eval_task} & set(task_names())):
        styles = get_spec(name).prompt_styles  # () = the task takes no prompt style
        if styles and t.prompt_style not in styles:
            errs.append(f"task.prompt_style={t.prompt_style!r} is not one of "
                        f"{styles} (the styles of task {name!r})")
    allow = c.eval.allow_in_sample
    if not isinstance(allow, bool):
        errs.append(f"eval.allow_in_sample must be True or False, got {allow!r}")
    if errs:
        return errs
    try:
        overlap, n_eval = _cached_overlap(_task_key(c))
    except Exception as e:  # noqa: BLE001 - a task that cannot be built is a config problem
        return [f"task {t.name!r} (eval_split={t.eval_split!r}"
                + (f", eval_task={eval_task!r}" if eval_task else "")
                + f") cannot be built: {type(e).__name__}: {e}"]
    if overlap and not allow:
        return [in_sample_message(c, overlap, n_eval)]
    return []


def _task_key(c: RunConfig) -> str:
    """The config parts that decide the task's problems, as a JSON string (cache key)."""
    path = str(c.task.path or "")
    mtime = os.path.getmtime(path) if path and os.path.exists(path) else None
    return json.dumps({"task": c.task.to_dict(), "seed": c.seed, "path_mtime": mtime},
                      sort_keys=True, default=str)


@functools.lru_cache(maxsize=32)
def _cached_overlap(key: str) -> tuple[list[str], int]:
    d = json.loads(key)
    t = freeze_section(TaskConfig, ml_collections.ConfigDict(d["task"]))
    task = load_task(t, int(d["seed"]))
    try:
        return eval_overlap(t, task)
    finally:
        close = getattr(task, "close", None)
        if close is not None:
            close()
