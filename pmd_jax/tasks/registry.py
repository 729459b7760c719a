"""Task registry: ``get_task(name, **kwargs)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def config_kwargs(task_cfg: Any, seed: int) -> dict[str, Any]:
    """Loader keyword arguments from the run config's ``task`` section for the jsonl_* kinds,
    SciKnowEval's filters and the option shuffle of multiple choice (``wiring.build_task``
    adds these to its own; missing keys, as in an older saved config, take the defaults)."""
    name, get = task_cfg.name, task_cfg.get
    kw: dict[str, Any] = {}
    if name in ("sciq", "mmlu_science", "sciknoweval", "jsonl_mcq"):
        kw["shuffle"] = bool(get("shuffle_options", True))
    if name == "jsonl_mcq":
        kw.update(seed=int(seed), include_support=bool(get("include_support", False)))
    if name in ("jsonl_mcq", "jsonl_math"):
        kw["prompt_style"] = get("prompt_style", "reasoning")
    if name in jsonl_tasks.KINDS:
        kw.update(valid_fraction=float(get("valid_fraction", 0.1)),
                  valid_size=int(get("valid_size", 0)), split_seed=int(get("split_seed", 42)))
    if name == "sciknoweval":
        kw.update(mcq.sciknoweval_filters(
            get("sciknoweval_domain", ",".join(mcq.SKE_DOMAINS)), get("sciknoweval_level", "L3"),
            get("sciknoweval_type", ",".join(mcq.SKE_TYPES)))[0])
    return kw
