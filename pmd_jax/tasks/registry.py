"""Task registry: ``get_task(name, **kwargs)``."""

from __future__ import annotations

from collections.abc import Callable

from pmd_jax.tasks import code, jsonl_tasks, math, mcq
from pmd_jax.tasks.base import Task, TaskError

_REGISTRY: dict[str, Callable[..., Task]] = {
    "sciq": mcq.load_sciq,
    "mmlu_science": mcq.load_mmlu_science,
    "sciknoweval": mcq.load_sciknoweval,  # path=... (user JSONL)
    "mbpp": code.load_mbpp,
    "humaneval": code.load_humaneval,
    "gsm8k": math.load_gsm8k,
    "livecodebench": code.load_livecodebench,  # path=... (user JSONL)
    # bring your own data (path=...; schemas in jsonl_tasks.py and the README)
    "jsonl_mcq": jsonl_tasks.load_jsonl_mcq,
    "jsonl_code": jsonl_tasks.load_jsonl_code,
    "jsonl_math": jsonl_tasks.load_jsonl_math,
}
PATH_TASKS = ("sciknoweval", "livecodebench", *jsonl_tasks.KINDS)  # need path=<JSONL file>


def task_names() -> list[str]:
    return sorted(_REGISTRY)


def get_task(name: str, **kwargs) -> Task:
    """Build a task by name. The tasks of ``PATH_TASKS`` need ``path=``."""
    if name not in _REGISTRY:
        raise TaskError(f"unknown task {name!r}; known tasks: {task_names()}")
    if name in PATH_TASKS and "path" not in kwargs:
        raise TaskError(f"task {name!r} needs path=<JSONL file>")
    try:
        return _REGISTRY[name](**kwargs)
    except TypeError as e:
        raise TaskError(f"bad arguments for task {name!r}: {e}") from e
