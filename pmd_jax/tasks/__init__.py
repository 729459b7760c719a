"""Problem sets and verifiers: multiple choice, sandboxed code, evaluation."""

from pmd_jax.tasks.base import LoadError, Messages, Problem, Task, TaskError, VerifyResult
from pmd_jax.tasks.code import CodeTask, extract_code, format_feedback
from pmd_jax.tasks.evaluation import (
    EvalResult,
    compare,
    evaluate,
    load_results,
    report_table,
    save_results,
)
from pmd_jax.tasks.mcq import McqTask, extract_answer
from pmd_jax.tasks.registry import get_task, task_names
from pmd_jax.tasks.sandbox import Limits, backend_info, detect_backend, run_python

__all__ = [
    "CodeTask",
    "EvalResult",
    "Limits",
    "LoadError",
    "McqTask",
    "Messages",
    "Problem",
    "Task",
    "TaskError",
    "VerifyResult",
    "backend_info",
    "compare",
    "detect_backend",
    "evaluate",
    "extract_answer",
    "extract_code",
    "format_feedback",
    "get_task",
    "load_results",
    "report_table",
    "run_python",
    "save_results",
    "task_names",
]
