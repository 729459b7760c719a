"""Forgetting: the policy's accuracy on an off-task retention set (``eval.retention``).

Post-training on one task can cost accuracy elsewhere. The papers PMD is compared with measure
that on an unrelated benchmark evaluated beside the task: Fast-Slow Training (arXiv
2605.12484, its forgetting evaluation) and Meta-Experience Learning (arXiv 2602.10224). Here,
at every evaluation point of a run with ``eval.retention=True``, the policy answers
``eval.retention_size`` questions of another task, memory-free, with the run's evaluation
sampling settings (``eval.*``); ``pmd_jax.loop.evaluate`` reports ``retention_accuracy`` and its
95% CI beside the task accuracy, and writes the per-(problem, seed) records to
``eval/step_*/retention.jsonl``. The plots module draws held-out accuracy against KL to the
initial policy.

The set: ``eval.retention_task`` ('' picks an off-task default: SciQ for code runs, MMLU's
science subjects for the others, SciQ for an MMLU run), asked in ``eval.retention_prompt_style``
('' = the run's own ``task.prompt_style`` where the retention task has it: the embedded
default trains SmolLM2-135M to write an option's text after an opened answer tag, and MMLU in
its loader's default style, letters after reasoning, scored it 0 of 200 at every step, a floor
that measures nothing); every split the task has, pooled,
without repeated questions and without any question of the run's training or evaluation
problems (compared on normalised question text, so a retention set drawn from the run's own
task stays disjoint); then a draw of ``eval.retention_size`` seeded by
``eval.retention_seed``, not the run seed, so that every cell of a grid sees the same
questions. Too few questions left is an error naming the sizes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pmd_jax.config.sections import RunConfig
from pmd_jax.tasks.base import TaskError
from pmd_jax.tasks.registry import get_spec, get_task

# The splits a task may have, in the order their questions are pooled.
_SPLITS = ("train", "validation", "test", "dev")


DEFAULT_RETENTION_TASK = "mmlu_science"


class RetentionError(ValueError):
    """The retention set cannot be built as configured."""


def retention_task_name(cfg: RunConfig) -> str:
    """The retention task of a run: ``eval.retention_task``, else the off-task default."""
    name = str(cfg.eval.retention_task or "")
    if name:
        return name

    spec = get_spec(cfg.task.name)  # (the task declares it; code tasks: question answering)
    return spec.retention_task or ("sciq" if spec.is_code else DEFAULT_RETENTION_TASK)


def _task_styles(name: str) -> tuple[str, ...]:
    """The prompt styles task ``name`` has (none for the code tasks)."""

    return tuple(get_spec(name).prompt_styles)


def retention_prompt_style(cfg: RunConfig) -> str:
    """The retention set's prompt style: ``eval.retention_prompt_style``, else the run's
    ``task.prompt_style`` if the retention task has it, else '' (its loader's default)."""
    style = str(getattr(cfg.eval, "retention_prompt_style", "") or "")
    if style:
        return style
    run_style = str(getattr(cfg.task, "prompt_style", "") or "")
    return run_style if run_style in _task_styles(retention_task_name(cfg)) else ""


def question_key(text: str) -> str:
    """A question compared across tasks and splits: lower case, whitespace collapsed."""
    return re.sub(r"\s+", " ", str(text)).strip().lower()


def _task_splits(task: Any) -> list[str]:
    known = getattr(task, "splits", None)
    if isinstance(known, dict):
        return [s for s in (*_SPLITS, *sorted(known)) if s in known and s != "all"]
    return list(_SPLITS)


def pooled_problems(task: Any) -> list[Any]:
    """Every problem of every split of ``task``, first occurrence of each question kept."""

    out: list[Any] = []
    seen: set[str] = set()
    for split in dict.fromkeys(_task_splits(task)):
        try:
            probs = task.problems(split)
        except (TaskError, KeyError, ValueError):
            continue  # the task has no such split
        for p in probs:
            k = question_key(p.question)
            if k not in seen:
                seen.add(k)
                out.append(p)
    return out


def draw_retention_problems(task: Any, exclude: Iterable[Any], size: int,
                            seed: int) -> list[Any]:
    """``size`` problems of ``task`` (all splits pooled) sharing no question with the
    problems ``exclude``, drawn with ``seed`` (sorted by id: the same set whatever the pool's
    order)."""
    banned = {question_key(p.question) for p in exclude}
    pool = sorted((p for p in pooled_problems(task) if question_key(p.question) not in banned),
                  key=lambda p: str(p.id))
    if len(pool) < size:
        raise RetentionError(
            f"eval.retention_size={size} but task {getattr(task, 'name', '?')!r} has only "
            f"{len(pool)} questions that are not training or evaluation questions of the run")
    idx = np.random.default_rng(seed).permutation(len(pool))[:size]
    return [pool[i] for i in sorted(idx)]


@functools.cache
def _load(name: str, prompt_style: str) -> Any:
    return get_task(name, **({"prompt_style": prompt_style} if prompt_style else {}))


def retention_set(cfg: RunConfig, run_problems: Sequence[Any]) -> tuple[Any, list[Any]]:
    """(the retention task, its problems) for a run whose training and evaluation problems are
    ``run_problems``. The task is loaded once per process, with its loader's defaults (the
    same options and option order in every cell) but the prompt style
    (:func:`retention_prompt_style`)."""
    task = _load(retention_task_name(cfg), retention_prompt_style(cfg))
    e = cfg.eval
    return task, draw_retention_problems(task, run_problems, int(e.retention_size),
                                         int(e.retention_seed))
