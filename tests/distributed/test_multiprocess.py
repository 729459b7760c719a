"""Two local JAX processes (jax.distributed on CPU) == one process with the same devices.

The test launches ``tests/distributed/mp_worker.py`` three times at once:

* two processes joined by ``jax.distributed`` (coordinator on 127.0.0.1, a free port, the
  ``PMD_COORDINATOR`` / ``PMD_NUM_PROCESSES`` / ``PMD_PROCESS_ID`` variables read by
  :func:`pmd_jax.run.distributed.maybe_initialize`), 2 fake CPU devices each;
* one plain process with 4 fake CPU devices (the reference).

Each builds the same ``(data=1, fsdp=2, tensor=2)`` mesh over all 4 global devices; in the
two-process job the ``fsdp`` axis spans the processes (so FSDP all-gathers, gradient
reductions and the batch split cross the process boundary through JAX's CPU collectives,
gloo, the default ``jax_cpu_collectives_implementation`` in jax 0.10), and ``tensor`` stays
inside a process. Both run two SDPO steps of ``TrainStep`` on ``tiny-llama`` from the same
seed and batch, then publish trained params to a ``WeightStore`` where each process writes
only the shards it owns.

Checks: metrics per step and the full trained params (``process_allgather``) of the
two-process job equal the single-process ones, both processes of the job agree bit for bit,
training really moved every tensor, each process owned half of the shards of the sharded
arrays, and the store read back (in the workers and here, with checksums) equals the
single-process trained params exactly.

Tolerance: observed bitwise equal with jax/jaxlib 0.10.2. The single-process reference
reduces across devices inside XLA, the two-process job reduces through gloo; with two
participants per reduction the sums are the same, but a collective library is free to pick
another summation order, so metrics and params are compared with ``rtol=1e-6, atol=1e-9``
(float32 rounding of a reordered sum of a handful of terms), which is still far below the
per-step update (``lr=1e-3``; checked to be > 1e-4 for every tensor). Reading the store back
is plain I/O and is compared exactly.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pmd_jax.sampling.weight_store import WeightStore
from tests.tiny_runs import child_env

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "mp_worker.py"
TIMEOUT_S = 480.0  # whole launch; ~1 min on a quiet 2-core machine, ~2 min on a busy one
RTOL, ATOL = 1e-6, 1e-9


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_env(devices: int, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in child_env(devices).items() if not k.startswith("PMD_")}
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: the worker and children
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def _run_all(jobs: list[tuple[str, list[str], dict[str, str], Path]], timeout: float) -> None:
    """Start every job at once; fail (killing the rest) on the first error or the timeout."""
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for name, args, env, log in jobs:
            fh = open(log, "wb")  # noqa: SIM115 - closed below
            logs.append((name, fh, log))
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), *args], env=env, cwd=str(REPO), stdout=fh,
                stderr=subprocess.STDOUT, start_new_session=True,
            ))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            bad = [(jobs[i][0], c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad or all(c == 0 for c in codes) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if not bad and not all(c == 0 for c in codes):
            bad = [(jobs[i][0], "timeout") for i, c in enumerate(codes) if c is None]
    finally:
        _kill(procs)
        for _, fh, _ in logs:
            fh.close()
    if bad:
        tails = "\n".join(
            f"--- {name} (last lines of {log.name}):\n"
            + "\n".join(log.read_text(errors="replace").splitlines()[-25:])
            for name, _, log in logs
        )
        pytest.fail(f"worker(s) failed: {bad}\n{tails}")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, object]:
    tmp = tmp_path_factory.mktemp("multiprocess")
    port = _free_port()
    jobs = []
    for pid in range(2):
        env = _child_env(2, {
            "PMD_COORDINATOR": f"127.0.0.1:{port}",
            "PMD_NUM_PROCESSES": "2",
            "PMD_PROCESS_ID": str(pid),
        })
        args = [str(tmp / "multi"), str(tmp / "store_multi")]
        jobs.append((f"process {pid} of 2", args, env, tmp / f"multi_p{pid}.log"))
    args = [str(tmp / "single"), str(tmp / "store_single")]
    jobs.append(("single process", args, _child_env(4, {}), tmp / "single.log"))
    t0 = time.monotonic()
    _run_all(jobs, TIMEOUT_S)
    print(f"three workers took {time.monotonic() - t0:.1f}s")
    return {
        "single": dict(np.load(tmp / "single" / "result_p0.npz")),
        "p0": dict(np.load(tmp / "multi" / "result_p0.npz")),
        "p1": dict(np.load(tmp / "multi" / "result_p1.npz")),
        "store_multi": tmp / "store_multi",
    }


def _keys(r: dict, prefix: str) -> list[str]:
    return sorted(k for k in r if k.startswith(prefix))


def test_topology(results):
    single, p0, p1 = results["single"], results["p0"], results["p1"]
    assert int(single["num_processes"]) == 1 and int(single["num_devices"]) == 4
    for r in (p0, p1):
        assert int(r["num_processes"]) == 2 and int(r["num_devices"]) == 4
    # mesh (data=1, fsdp=2, tensor=2): fsdp crosses the process boundary, tensor does not
    np.testing.assert_array_equal(p0["mesh_process"], [[[0, 0], [1, 1]]])
    np.testing.assert_array_equal(single["mesh_process"], np.zeros((1, 2, 2)))


def test_two_processes_agree_bitwise(results):
    p0, p1 = results["p0"], results["p1"]
    keys = _keys(p0, "metric/") + _keys(p0, "param/") + _keys(p0, "store/")
    assert keys == _keys(p1, "metric/") + _keys(p1, "param/") + _keys(p1, "store/")
    for k in keys:
        np.testing.assert_array_equal(p1[k], p0[k], err_msg=k)


def test_two_process_training_equals_single_process(results):
    single, multi = results["single"], results["p0"]
    metric_keys = _keys(single, "metric/")
    assert len(metric_keys) == 2 * len(_keys(single, "metric/0/")) > 0
    assert metric_keys == _keys(multi, "metric/")
    for k in metric_keys:
        np.testing.assert_allclose(multi[k], single[k], rtol=RTOL, atol=ATOL, err_msg=k)
    for step in (0, 1):
        assert float(single[f"metric/{step}/finite"]) == 1.0
        assert float(single[f"metric/{step}/skipped"]) == 0.0
        assert float(single[f"metric/{step}/kl"]) > 0.0
    param_keys = _keys(single, "param/")
    assert param_keys == _keys(multi, "param/") and "param/embed" in param_keys
    for k in param_keys:
        assert multi[k].shape == single[k].shape, k
        np.testing.assert_allclose(multi[k], single[k], rtol=RTOL, atol=ATOL, err_msg=k)
        # the two Adam steps (lr 1e-3) moved every tensor far more than the tolerance
        moved = float(single["update_max/" + k.removeprefix("param/")])
        assert moved > 1e-4, (k, moved)


def test_weight_store_each_process_writes_its_shards(results):
    single, p0, p1 = results["single"], results["p0"], results["p1"]
    # sharded arrays: 4 shards, 2 owned by each process; the replicated one: process 0 only
    for name in ("embed", "layers.q", "layers.down"):
        assert int(single[f"owned_shards/{name}"]) == 4, name
        assert int(p0[f"owned_shards/{name}"]) == 2, name
        assert int(p1[f"owned_shards/{name}"]) == 2, name
    assert int(p0["owned_shards/final_norm"]) == 1 and int(p1["owned_shards/final_norm"]) == 0
    assert int(p0["store_processes"]) == 2

    # read back here, in a process without jax.distributed, checksums verified
    arrays, manifest = WeightStore(results["store_multi"]).read(verify=True)
    assert manifest.version == 2 and manifest.extra["processes"] == 2
    ref = {
        "embed": single["param/embed"],
        "layers.q": single["param/layers/q"],
        "layers.down": single["param/layers/down"],
        "final_norm": single["param/final_norm"],
    }
    assert sorted(arrays) == sorted(ref)
    for name, want in ref.items():
        # the store holds exactly what the two-process job trained ...
        np.testing.assert_array_equal(arrays[name], p0["param/" + name.replace(".", "/")])
        np.testing.assert_array_equal(p0[f"store/{name}"], arrays[name])
        # ... which is the single-process value
        np.testing.assert_allclose(arrays[name], want, rtol=RTOL, atol=ATOL, err_msg=name)
