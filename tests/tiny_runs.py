"""The tiny end-to-end runs several test modules launch: the real entry point
(``python -m pmd_jax.main``) on a tiny random Llama with SmolLM2's tokenizer and real SciQ data.

One persistent XLA compilation cache per test session (a temporary folder, never the user's
~/.cache): every run launched with :func:`cmd` (``train.compilation_cache_dir``) or with the
environment of :func:`run_env` (jax's own variables) reads and writes it, so a program the
session compiled once is loaded by the later runs, as a user's restarted run does.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    # the loop with its whole memory path, every item supervising (the embedded default's own
    # mode is pmd_verified); a test's own --config.mode comes later and wins
    "--config.mode=pmd",
    "--config.model.random_init=tiny-llama",
    "--config.rollout.problems_per_step=2",
    "--config.rollout.n=2",
    "--config.rollout.max_tokens=12",
    "--config.rollout.max_prompt_tokens=320",
    "--config.task.max_eval_problems=2",
    "--config.eval.n=1",
    "--config.eval.max_tokens=8",
    "--config.train.steps=3",
    "--config.train.checkpoint_every=1",
    "--config.train.eval_every=-1",
    "--config.train.eval_at_start=False",
    "--config.train.kl_initial_every=1",  # every step's KL: the resume tests compare it
    "--config.memory.behavior.every_n_steps=2",
    "--config.memory.behavior.min_problems=2",
    "--config.memory.insight.sampling.max_tokens=16",
    "--config.memory.behavior.sampling.max_tokens=16",
    "--config.teacher_prompt.max_tokens=768",
    "--config.distill.loss.topk=8",
    # The random model never answers right, so without feedback no sample is reprompted and
    # the loss is 0: feedback gives every sample a teacher signal, and a full learning rate
    # from step 0 makes every update (and so every resume mismatch) visible.
    "--config.teacher_prompt.include_feedback=True",
    "--config.distill.optim.warmup_steps=0",
    "--config.distill.optim.lr=1e-3",
]


# The session's cache folder, made by the first process that asks (the pytest process, or
# the xdist controller when tests/conftest.py calls jax_cache_dir() at start-up) and passed to
# the xdist workers it starts through the environment, so every worker's runs share it.
SESSION_CACHE_ENV = "PMD_JAX_TEST_XLA_CACHE"


@functools.cache
def jax_cache_dir() -> Path:
    """This session's compilation cache (a temporary folder, not the user's ~/.cache), one
    for all xdist workers; removed when the process that made it exits."""
    given = os.environ.get(SESSION_CACHE_ENV)
    if given:
        return Path(given)
    path = Path(tempfile.mkdtemp(prefix="pmd_jax_test_xla_cache_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ[SESSION_CACHE_ENV] = str(path)
    return path


def cache_flags() -> list[str]:
    """Config flags that point a run at the session's cache, caching every program."""
    return [f"--config.train.compilation_cache_dir={jax_cache_dir()}",
            "--config.train.compilation_cache_min_compile_secs=0"]


def cmd(run_dir: Path, *extra: str) -> list[str]:
    """The tiny run's command line; skips the calling test (or fixture) with the install
    command when SmolLM2, whose tokenizer the run reads, is not installed."""
    __tracebackhide__ = True  # a skip is reported at the caller's line
    from tests.host import smollm2_gguf  # (imports jax: not at this module's import)

    smollm2_gguf()
    return [sys.executable, "-m", "pmd_jax.main", "--config=configs/smollm2_sciq.py",
            f"--config.run_dir={run_dir}", *TINY, *cache_flags(), *extra]


# XLA:CPU code generation for the in-process tests (set in conftest.py before jax starts):
# LLVM at -O0. Compiling dominates them (in tests/distill, tests/models and tests/sampling,
# 590 s of 880 s were XLA backend compiles, 2,422 programs, almost none compiled twice), and
# -O0 took tests/distill/test_step.py from 112 s to 70 s (-O1: 79 s). The HLO passes, hence
# the programs' buffers and fusions, are the same; matmuls call the same library kernels;
# only the generated loops are slower, which tiny test shapes do not feel. Elementwise math
# can differ in the last bit (jax.random.normal's init did, by 1 ulp in 4% of elements), so a
# test that compares bitwise with a run's output builds its reference in a child (see
# test_retention._initial_export). The runs tests start (child_env) keep XLA's default: they
# run longer than they compile, and -O0 took the two-process loop fixture from 173 s to 649 s.
# PMD_TEST_XLA_OPT=default: no -O0 at all.
_CODEGEN = ("--xla_backend_optimization_level=0",)


def codegen_flags() -> list[str]:
    """The in-process tests' code generation flags (none with PMD_TEST_XLA_OPT=default)."""
    return [] if os.environ.get("PMD_TEST_XLA_OPT") == "default" else list(_CODEGEN)


def child_env(devices: int | None = None) -> dict[str, str]:
    """``os.environ`` for a subprocess: the session's XLA flags without its fake device count
    and without the in-process -O0, so the child sees this machine's real devices (or
    ``devices`` fake CPU ones) and compiles as a user's run does."""
    env = dict(os.environ)
    session_only = ("--xla_force_host_platform_device_count", *_CODEGEN)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(session_only)]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def env() -> dict[str, str]:
    # The run must see this machine's real devices (child_env), a distributed run's PMD_*
    # variables must not leak in, and jax's own cache variables would override the cache
    # flags above.
    env = {k: v for k, v in child_env().items()
           if not k.startswith(("PMD_", "JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def train_records(run_dir: Path) -> list[dict]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return [r for r in recs if r["kind"] == "train"]


def final_params(run_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted((run_dir / "final_hf").glob("*.safetensors")):
        out.update(load_file(f))
    return out


_RUNS: dict[tuple[str, ...], Path] = {}


def run_once(tmp_path_factory, name: str, *extra: str) -> Path:
    """One complete run per set of extra flags per session (test_trainer.py's clean run is
    test_trainer_overlap.py's reference)."""
    if extra not in _RUNS:
        run_dir = tmp_path_factory.mktemp(name)
        p = subprocess.run(cmd(run_dir, *extra), cwd=ROOT, env=env(), capture_output=True,
                           text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-4000:]
        _RUNS[extra] = run_dir
    return _RUNS[extra]


def run_env() -> dict[str, str]:
    """:func:`env` plus jax's cache variables pointing at the session's cache, for runs that
    are not started with :func:`cmd`'s flags (a Trainer built in a ``python -c`` script)."""
    return {**env(), "JAX_COMPILATION_CACHE_DIR": str(jax_cache_dir()),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def embedded_default() -> Any:
    """The embedded default's ConfigDict (configs/smollm2_sciq.py), as the entry point loads it."""
    from pmd_jax.config.cli import load_config_file

    return load_config_file(str(ROOT / "configs" / "smollm2_sciq.py"))


def mode_knob_errors(tmp_path: Path, mode: str, key: str, value: Any) -> list[str]:
    """The config errors of the embedded default in ``mode`` with ``<mode>.<key> = value``
    (``key`` may be ``section.knob``), after apply_mode, as ``main`` checks it."""
    from pmd_jax.config import apply_mode
    from pmd_jax.config.validate import config_errors

    c = embedded_default()
    c.mode, c.run_dir = mode, str(tmp_path / "run")
    node = c[mode]
    *path, last = key.split(".")
    for part in path:
        node = node[part]
    node[last] = value
    return config_errors(apply_mode(c))
