"""Taking the step-0 evaluation from another run instead of running it again
(``eval.reuse_from``).

Before its first update a run evaluates its initial weights. In a grid every cell starts from
the same weights and evaluates the same problems with the same settings, so every cell's
step-0 evaluation gives the same results (the sampler's randomness comes from ``eval.seeds``,
not the run seed); on the Qwen2.5-Coder MBPP grid that is 16 minutes a cell (164 HumanEval
problems and 100 retention questions) spent to reproduce a file. With ``eval.reuse_from`` set
to a folder of other runs (a grid's scratch folder), a run takes the results of one whose
*evaluation key* equals its own, and only then.

The key is a SHA-256 over what the evaluation reads: the initial weights' bytes (every array,
with its shape and dtype), the config sections that shape the evaluation's sampling and
problems (``model``, ``rollout``, ``eval`` with ``reuse_from`` left out, ``task``), the
prompts of the evaluation problems and of the retention questions, and the package's version
and Python sources (a code change evaluates again).
A run with ``eval.reuse_from`` writes its key beside its step-0 results
(``eval/step_000000/eval_key.json``, with the memory-free metrics of its evaluation record),
after the evaluation is complete, so a run killed mid-evaluation is never taken.

Only the memory-free evaluation is taken: a mode that also evaluates with its memory or a
deployed context (``ModeSpec.eval_with_memory``, ``ModeRuntime.eval_context``) evaluates
itself, and so does a run of several processes (the key would need every process's shards).
The taken record says where it came from (``eval_reused_from``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

import pmd_jax
from pmd_jax.loop.retention import retention_set

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig

log = logging.getLogger("pmd_jax")

KEY_FILE = "eval_key.json"
# The files of a step-0 evaluation that are memory-free (the task's and the retention set's).
RESULT_FILES = ("results.jsonl", "retention.jsonl")
# The metrics of an evaluation record that come from those files.
MEMORY_FREE_METRICS = (
    "accuracy", "accuracy_ci_low", "accuracy_ci_high", "num_problems", "in_sample",
    "retention_accuracy", "retention_accuracy_ci_low", "retention_accuracy_ci_high",
    "retention_num_problems", "retention_task", "retention_prompt_style")
KEY_SECTIONS = ("model", "rollout", "eval", "task")


def evaluation_key(cfg: RunConfig, params: Any, prompts: Iterable[Any]) -> str:
    """The key of a step-0 evaluation: weights, config sections, prompts, version."""

    h = hashlib.sha256()
    sections = {name: getattr(cfg, name).to_dict() for name in KEY_SECTIONS}
    sections["eval"].pop("reuse_from", None)
    h.update(json.dumps({"version": getattr(pmd_jax, "__version__", ""),
                         "source": source_digest(), **sections},
                        sort_keys=True, default=str).encode())
    leaves = jax.tree_util.tree_leaves_with_path(params)
    for path, leaf in leaves:
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{jax.tree_util.keystr(path)}|{a.shape}|{a.dtype}".encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    for p in prompts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
    return h.hexdigest()


@functools.cache
def source_digest() -> str:
    """SHA-256 of the package's Python sources: the sampler, the tasks' prompts and graders
    all live there, and the version string does not change between commits, so a grid resumed
    after a code change evaluates again rather than take results of the old code."""

    root = Path(pmd_jax.__file__).parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def start_key(cfg: RunConfig, spec: Any, runtime: Any, params: Any, task: Any,
              problems: Sequence[Any]) -> str | None:
    """The key of this run's step-0 evaluation, or None where none is taken or written:
    ``eval.reuse_from`` unset, a mode that evaluates with its memory (``spec``) or a deployed
    context (``runtime``), or several processes."""

    if (not cfg.eval.reuse_from or spec.eval_with_memory or runtime.eval_context() is not None
            or jax.process_count() > 1):
        return None
    return evaluation_key(cfg, params, problems_read(cfg, task, problems))


def taken(cfg: RunConfig, key: str | None, out_dir: Path, run_dir: Path) -> dict | None:
    """The step-0 evaluation of another run with this ``key`` (its files copied into
    ``out_dir``), or None when there is none to take."""
    if key is None:
        return None
    donor = find(cfg.eval.reuse_from, key, run_dir)
    if donor is None:
        log.info("step-0 evaluation: no run under %s has this one's key; evaluating",
                 cfg.eval.reuse_from)
        return None
    log.info("step-0 evaluation taken from %s (the same weights, settings and problems)",
             donor.parents[1])
    return take(donor, out_dir)


def find(root: str | Path, key: str, own_dir: Path) -> Path | None:
    """The step-0 evaluation folder of a run under ``root`` (its subfolders, or ``root``
    itself) whose key is ``key`` and whose result files are all there; None if none."""
    root = Path(root)
    for kf in sorted([*root.glob(f"*/eval/step_000000/{KEY_FILE}"),
                      *root.glob(f"eval/step_000000/{KEY_FILE}")]):
        folder = kf.parent
        if folder.resolve() == (own_dir / "eval" / "step_000000").resolve():
            continue
        try:
            info = json.loads(kf.read_text())
        except (OSError, ValueError):
            continue
        if info.get("key") == key and all(
                (folder / f).is_file() for f in info.get("files", ())):
            return folder
    return None


def take(donor: Path, out_dir: Path) -> dict[str, Any]:
    """Copies the donor's memory-free result files into ``out_dir``; returns its record's
    memory-free metrics and where they came from."""
    info = json.loads((donor / KEY_FILE).read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in info["files"]:
        shutil.copyfile(donor / f, out_dir / f)
    shutil.copyfile(donor / KEY_FILE, out_dir / KEY_FILE)
    return {**info["metrics"], "eval_reused_from": str(donor.parents[1])}


def write_key(out_dir: Path, key: str, res: dict[str, Any]) -> None:
    """Records a finished step-0 evaluation's key, files and memory-free metrics (written last
    and atomically: its presence means the evaluation is complete)."""
    files = [f for f in RESULT_FILES if (out_dir / f).is_file()]
    info = {"key": key, "files": files,
            "metrics": {k: res[k] for k in MEMORY_FREE_METRICS if k in res}}
    tmp = out_dir / (KEY_FILE + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.replace(out_dir / KEY_FILE)


def problems_read(cfg: RunConfig, task: Any, problems: Sequence[Any]) -> list[Any]:
    """What the evaluation reads of its problems, for the key: each evaluation problem's id,
    prompt and gold (its answer or tests), then the retention questions' (eval.retention)."""
    out = [(str(p.id), task.prompt(p), p.gold) for p in problems]
    if cfg.eval.retention:
        rtask, rprobs = retention_set(cfg, [*task.problems("train"), *problems])
        out += [(str(p.id), rtask.prompt(p), p.gold) for p in rprobs]
    return out
