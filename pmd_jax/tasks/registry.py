"""Task registry: ``get_task(name, **kwargs)``."""

from __future__ import annotations

from collections.abc import Callable

from pmd_jax.tasks import code, math, mcq
from pmd_jax.tasks.base import Task, TaskError

_REGISTRY: dict[str, Callable[..., Task]] = {
    "sciq": mcq.load_sciq,
    "mmlu_science": mcq.load_mmlu_science,
    "sciknoweval": mcq.load_sciknoweval,  # path=... (user JSONL)
    "mbpp": code.load_mbpp,
    "humaneval": code.load_humaneval,
    "gsm8k": math.load_gsm8k,
    "livecodebench": code.load_livecodebench,  # path=... (user JSONL)
}


def task_names() -> list[str]:
    return sorted(_REGISTRY)


def get_task(name: str, **kwargs) -> Task:
    """Build a task by name. "sciknoweval" and "livecodebench" need ``path=``."""
    if name not in _REGISTRY:
        raise TaskError(f"unknown task {name!r}; known tasks: {task_names()}")
    if name in ("sciknoweval", "livecodebench") and "path" not in kwargs:
        raise TaskError(f"task {name!r} needs path=<JSONL file>")
    try:
        return _REGISTRY[name](**kwargs)
    except TypeError as e:
        raise TaskError(f"bad arguments for task {name!r}: {e}") from e
