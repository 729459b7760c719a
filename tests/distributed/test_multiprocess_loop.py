"""The whole co-evolution loop in two JAX processes == the same loop in one (pmd_jax.run.multihost).

``python -m pmd_jax.main`` runs as two processes joined by ``jax.distributed`` (coordinator on
127.0.0.1 at a free port; ``PMD_COORDINATOR`` / ``PMD_NUM_PROCESSES`` / ``PMD_PROCESS_ID``),
4 fake CPU devices each, and as one process with 8 devices; every run uses the same
``(data=1, fsdp=4, tensor=2)`` mesh, so in the two-process job the fsdp axis (FSDP gathers,
gradient reductions, the sampler's batch split) crosses the process boundary through gloo.
A tiny random Llama (``tiny-llama``, SmolLM2's tokenizer, real SciQ problems) runs 2 steps
with the JAX sampler, evaluating after the last step. The default suite runs the embedded
default's mode, ``pmd_verified`` (memory with reflections, the default MiniLM embedder, and
the check before use: paired replays drawn by process 0), with
tests/loop/test_trainer_verified.py's flags (every row's demonstration is the check's first
replay, so a replay drawn differently would change the loss), every launch and process under
its own ``PYTHONHASHSEED``, one process beside two. Slow: the same job killed and resumed
(``pmd_verified-killed``; the default suite's job until 2026-11-29), the same in ``pmd`` mode
(every item supervises, the experience level on), and GRPO and ``sdpo_matched_sampling``
(one process against two, no kill). A kill and resume in one process stays in the default
suite (tests/loop/test_trainer_verified.py, tests/run/test_checkpoint.py).

The killed jobs are killed after their first checkpoint: process 1 gets SIGKILL, and
process 0 must stop on its own with jax's error naming the dead task within
``HEARTBEAT_S + KILL_SLACK_S`` seconds (``PMD_HEARTBEAT_TIMEOUT_S`` sets jax.distributed's
``heartbeat_timeout_seconds``; jax's default is 100 s). Rerunning both processes with the same
command resumes from checkpoint 1, so its end state also shows that params, optimizer and
teacher state, the memory (held and checkpointed by process 0 alone) and the data cursor came
back intact: the resumed job and the clean GRPO job must both end where the one-process
runs end.

Compared: the final checkpoint's whole train state (params, optimizer state, teacher, step,
RNG) read with orbax as numpy, the exported HF weights (gathered, written by process 0), the
memory (``memory.jsonl`` and the checkpoint's memory slot, byte for byte), and the per-step
metrics (written once, by process 0).

Tolerance: the two-process job reduces gradients and sharded matmuls partly through gloo, the
one-process run inside XLA, in another summation order, so float32 values may differ in the
last bits; observed (jax 0.10.2): params and Adam moments within 2e-7 absolute, per-step
losses within 5e-5 relative (the loss is ~1e-7 here, a difference of nearly equal terms),
the KL-to-initial estimate within 4e-8 absolute (the GRPO state, whose updates are weight
decay alone, came out bitwise equal). We allow ``ATOL_STATE=2e-6`` on the state
(far below the 2e-3 the two Adam steps at lr 1e-3 move each tensor; checked to be > 1e-4),
``rtol=1e-3, atol=1e-6`` on float metrics. Host-side results (sampled tokens, hence rewards,
response lengths, the memory's records and the teacher prompts) must be identical: a rounding
difference that flipped one sampled token would show there. That holds because the sampler's
draw resolves ~1-ulp logit differences (sample_ops.inverse_cdf_sample, two uniforms: about
6e-5 of draws flip). With one uniform against the whole CDF about 1e-3 flipped, and on an
AVX2-only CPU (and in CI, with the same numbers) one of the ~110 draws here did: the step-1
states were 1 ulp apart and one rollout's 10th token differed. Two runs of the same job are
bitwise reproducible (not asserted here: that would double the time).

Time: compiling dominates. jax writes the persistent compilation cache from process 0 only
and process 1's cache keys differ, so process 1 compiles every program in every launch
(~40 s per train-step shape on a busy 2-core machine). With the GRPO jobs the module took
5:56 and 6:38 on the 2-core machine at load 11-16 (7 launches); the default suite's job is
2 launches side by side (the killed job's 4 took ~250 s of the CI's 21 minutes). It needs no
accelerator.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.fakes import assert_same_tree
from tests.host import smollm2_gguf
from tests.tiny_runs import TINY, cache_flags, child_env
from tests.tiny_runs import env as _env

ROOT = Path(__file__).resolve().parents[2]
# jax.distributed's heartbeat timeout for the two-process runs: short enough to see a dead
# peer noticed quickly, long enough that a process starved of CPU on a loaded machine (load
# 70 on 2 cores was seen; with 15 s both jobs of one run aborted while compiling there, most
# likely declared dead) is not declared dead while it compiles.
HEARTBEAT_S = 60
KILL_SLACK_S = 60  # the coordination service notices, then polls the error to process 0
RUN_TIMEOUT_S = 1200.0
ATOL_STATE = 2e-6
MOVED_MIN = 10 * ATOL_STATE
METRIC_RTOL, METRIC_ATOL = 1e-3, 1e-6
STEPS = 2
# test_trainer's tiny loop (random tiny-llama, feedback for a teacher signal, lr 1e-3 from
# step 0) on a mesh whose fsdp axis crosses the two processes.
FLAGS = [
    "--config.mesh.data=1",
    "--config.mesh.fsdp=4",
    "--config.mesh.tensor=2",
    "--config.rollout.sampler=jax",
    *(a for a in TINY if not a.startswith("--config.train.steps=")),
    f"--config.train.steps={STEPS}",
    "--config.train.keep_checkpoints=2",  # _assert_state_equal reads the step before the last
]
EVAL_AT_END = ("--config.train.eval_every=0",)  # evaluate once, after the last step
# Per-process measurements (wall clock, durations, this process's memory), not compared.
HOST_DEPENDENT = ("time", "rss_")
# Computed on the host from the sampled tokens, the verifier and the memory: must be equal.
EXACT_METRICS = (
    "reward_mean", "success_group_fraction", "format_ok_fraction", "response_tokens_mean",
    "truncated_fraction", "skipped_long_prompts", "rollout_staleness",
    "rollout_weights_version", "reprompt_sample_fraction", "demo_from_sibling_fraction",
    "demo_from_memory_fraction", "teacher_prompt_tokens_mean", "student_tokens_mean",
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_env(devices: int, extra: dict[str, str]) -> dict[str, str]:
    env = _env()
    env["XLA_FLAGS"] = child_env(devices)["XLA_FLAGS"]
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env.update(extra)
    return env


def _start(run_dir: Path, nproc: int, mode: str, tag: str, *flags: str,
           hashseed: int | None = None) -> list[tuple[subprocess.Popen, Path]]:
    """Starts a run as ``nproc`` processes (8 devices in all); returns (process, log) pairs.
    ``hashseed``: process ``i`` runs under ``PYTHONHASHSEED=hashseed + i`` (every process of
    the job, and every launch, salts Python's string hashes differently)."""
    smollm2_gguf()  # the runs read SmolLM2's tokenizer: skipped with the install command
    port = _free_port()
    out = []
    for pid in range(nproc):
        extra = {} if nproc == 1 else {
            "PMD_COORDINATOR": f"127.0.0.1:{port}", "PMD_NUM_PROCESSES": str(nproc),
            "PMD_PROCESS_ID": str(pid), "PMD_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S),
        }
        if hashseed is not None:
            extra["PYTHONHASHSEED"] = str(hashseed + pid)
        log = run_dir.parent / f"{run_dir.name}.{tag}.p{pid}.log"
        # the mode after FLAGS: TINY names mode pmd, and the last flag wins
        cmd = [sys.executable, "-m", "pmd_jax.main", "--config=configs/smollm2_sciq.py",
               f"--config.run_dir={run_dir}", *FLAGS, f"--config.mode={mode}", *cache_flags(),
               *flags]
        fh = open(log, "wb")  # noqa: SIM115 - the child holds it; closed when we return
        p = subprocess.Popen(cmd, cwd=ROOT, env=_proc_env(8 // nproc, extra), stdout=fh,
                             stderr=subprocess.STDOUT, start_new_session=True)
        fh.close()
        out.append((p, log))
    return out


def _kill(jobs: list[tuple[subprocess.Popen, Path]]) -> None:
    for p, _ in jobs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=60)


def _tails(jobs: list[tuple[subprocess.Popen, Path]]) -> str:
    """Each log's error lines (jax's fatal ones included) and its last lines."""
    out = []
    for _, log in jobs:
        lines = log.read_text(errors="replace").splitlines()
        errors = [x for x in lines if "Terminating process" in x or "unhealthy" in x
                  or "Error:" in x][:10]
        out.append(f"--- {log.name}:\n" + "\n".join(errors + ["..."] + lines[-30:]))
    return "\n".join(out)


def _wait(jobs: list[tuple[subprocess.Popen, Path]], deadline: float) -> None:
    """Waits for every process to exit 0; fails (killing the others) on an error or timeout."""
    try:
        while True:
            codes = [p.poll() for p, _ in jobs]
            if any(c not in (None, 0) for c in codes):
                pytest.fail(f"a process failed ({codes}):\n{_tails(jobs)}")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                pytest.fail(f"timeout ({codes}):\n{_tails(jobs)}")
            time.sleep(0.5)
    finally:
        _kill(jobs)


def _one_and_two_killed_resumed(tmp: Path, mode: str, *flags: str,
                                hashseed: int | None = None) -> dict:
    """``mode`` in one process, and in two processes killed after checkpoint 1 (process 1
    gets SIGKILL) and resumed; both evaluate after the last step (process 0 evaluates,
    process 1 serves its sampler calls). ``hashseed``: the one-process run has
    ``PYTHONHASHSEED=hashseed``, the killed job's processes ``hashseed + 1 + i``, the resumed
    job's ``hashseed + 3 + i``: no two processes salt string hashes alike."""
    t0 = time.monotonic()
    deadline = t0 + RUN_TIMEOUT_S
    one, two = tmp / f"{mode}_1", tmp / f"{mode}_2"

    def salt(k: int) -> int | None:
        return None if hashseed is None else hashseed + k

    # wave 1: one process, and two processes until the first checkpoint
    single = _start(one, 1, mode, "run", *EVAL_AT_END, *flags, hashseed=salt(0))
    killed = _start(two, 2, mode, "killed", *EVAL_AT_END, *flags, hashseed=salt(1))
    kill: dict = {}
    try:
        marker = two / "checkpoints" / "1" / "pmd_commit.json"
        while not marker.exists():
            if any(p.poll() is not None for p, _ in killed) or time.monotonic() > deadline:
                pytest.fail(f"no checkpoint 1 in the two-process run:\n{_tails(killed)}")
            time.sleep(0.05)
        (p0, log0), (p1, _) = killed
        os.killpg(p1.pid, signal.SIGKILL)
        p1.wait()
        t_kill = time.monotonic()
        try:
            rc0 = p0.wait(timeout=HEARTBEAT_S + KILL_SLACK_S)
        except subprocess.TimeoutExpired:
            rc0 = None
        kill = {"rc0": rc0, "seconds": time.monotonic() - t_kill,
                "log0": log0.read_text(errors="replace"),
                "final_hf": (two / "final_hf").exists()}
    finally:
        _kill(killed)
    # wave 2: the killed job restarted with the same command
    resumed = _start(two, 2, mode, "resumed", *EVAL_AT_END, *flags, hashseed=salt(3))
    _wait(single + resumed, deadline)
    print(f"{mode} runs took {time.monotonic() - t0:.0f}s; process 0 stopped "
          f"{kill.get('seconds', float('nan')):.0f}s after process 1 was killed")
    return {one.name: one, two.name: two, "kill": kill,
            "resumed_logs": [log.read_text(errors="replace") for _, log in resumed]}


def _one_and_two(tmp: Path, mode: str, *flags: str, hashseed: int | None = None) -> dict:
    """``mode`` in one process and in two, side by side, each evaluating after the last step
    (``hashseed``: the one-process run ``hashseed``, the two processes ``hashseed + 1 + i``)."""
    one, two = tmp / f"{mode}_1", tmp / f"{mode}_2"

    def salt(k: int) -> int | None:
        return None if hashseed is None else hashseed + k

    jobs = (_start(one, 1, mode, "run", *EVAL_AT_END, *flags, hashseed=salt(0))
            + _start(two, 2, mode, "run", *EVAL_AT_END, *flags, hashseed=salt(1)))
    _wait(jobs, time.monotonic() + RUN_TIMEOUT_S)
    return {one.name: one, two.name: two}


# rollout.n=1 (DEMO_FROM_DRAWS): 4 problems a step, so the rows split over fsdp=4; the same 4
# problems every step, so step 1 tests the items written at step 0
MP_ROWS = ("--config.rollout.problems_per_step=4", "--config.task.max_train_problems=4")


def _verified_flags() -> tuple[str, ...]:
    from tests.loop.test_trainer_verified import DEMO_FROM_DRAWS, MODES

    return (*DEMO_FROM_DRAWS, *MP_ROWS, *MODES["pmd_verified"])


@pytest.fixture(scope="module", params=[
    pytest.param(("pmd_verified", False), id="pmd_verified"),
    pytest.param(("pmd_verified", True), id="pmd_verified-killed", marks=pytest.mark.slow),
    pytest.param(("pmd", True), id="pmd-killed", marks=pytest.mark.slow)])
def runs(request, tmp_path_factory) -> dict:
    """A job in one process, and in two processes (killed after checkpoint 1 and resumed in
    the ``-killed`` params, slow). The mode is the embedded default's, ``pmd_verified``, with
    tests/loop/test_trainer_verified.py's flags (every row's demonstration is the check's
    first replay, so the replays' draws reach the loss), every launch and process under its
    own PYTHONHASHSEED; ``pmd`` (every item supervises, the experience level on) is slow."""
    mode, killed = request.param
    flags = _verified_flags() if mode == "pmd_verified" else ()
    tmp = tmp_path_factory.mktemp(f"mp_loop_{mode}")
    salt = 11 if flags else None
    out = (_one_and_two_killed_resumed(tmp, mode, *flags, hashseed=salt) if killed
           else _one_and_two(tmp, mode, *flags, hashseed=salt))
    return {**out, "mode": mode, "killed": killed, "one": out[f"{mode}_1"],
            "two": out[f"{mode}_2"]}


@pytest.fixture(scope="module")
def matched_runs(tmp_path_factory) -> dict:
    """sdpo_matched_sampling in one process and in two (slow), each under its own salt."""
    from tests.loop.test_trainer_verified import DEMO_FROM_DRAWS, MODES

    tmp = tmp_path_factory.mktemp("mp_loop_matched")
    d = {k: tmp / k for k in ("matched_1", "matched_2")}
    flags = (*EVAL_AT_END, *DEMO_FROM_DRAWS, *MP_ROWS, *MODES["sdpo_matched_sampling"])
    jobs = (_start(d["matched_1"], 1, "sdpo_matched_sampling", "run", *flags, hashseed=21)
            + _start(d["matched_2"], 2, "sdpo_matched_sampling", "run", *flags, hashseed=22))
    _wait(jobs, time.monotonic() + RUN_TIMEOUT_S)
    return d


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory) -> dict:
    """GRPO in one process and in two (slow tests only: the default suite runs PMD alone)."""
    tmp = tmp_path_factory.mktemp("mp_loop_grpo")
    d = {k: tmp / k for k in ("grpo_1", "grpo_2")}
    jobs = (_start(d["grpo_1"], 1, "grpo", "run", *EVAL_AT_END)
            + _start(d["grpo_2"], 2, "grpo", "run", *EVAL_AT_END))
    _wait(jobs, time.monotonic() + RUN_TIMEOUT_S)
    return d


# ----------------------------------------------------------------------------- readers
def _state(run_dir: Path, step: int) -> dict[str, np.ndarray]:
    """The checkpoint's train state as numpy arrays, by key path (orbax, no devices needed)."""
    import jax
    import orbax.checkpoint as ocp

    path = run_dir / "checkpoints" / str(step) / "state"
    meta = ocp.StandardCheckpointer().metadata(path)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    restored = ocp.PyTreeCheckpointer().restore(path, restore_args=args)
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(restored)}


def _hf(run_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted((run_dir / "final_hf").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r["kind"] == "train"]


# ----------------------------------------------------------------------------- checks
def _assert_state_equal(single: Path, multi: Path, trained: bool = True) -> None:
    a, b = _state(single, STEPS), _state(multi, STEPS)
    assert sorted(a) == sorted(b)
    assert any("opt_state" in k for k in a) and any("params" in k for k in a)
    before = _state(single, STEPS - 1)
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        if np.issubdtype(a[k].dtype, np.floating):
            np.testing.assert_allclose(b[k], a[k], rtol=0, atol=ATOL_STATE, err_msg=k)
        else:  # step counters, the RNG key
            np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    for k in a:  # the last step really moved every trained tensor (not a comparison of no-ops)
        if trained and "params" in k and "teacher" not in k and "norm" not in k:
            moved = float(np.abs(a[k].astype(np.float64) - before[k]).max())
            assert moved > MOVED_MIN, (k, moved)


def _assert_hf_equal(single: Path, multi: Path) -> None:
    a, b = _hf(single), _hf(multi)
    assert a and sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=ATOL_STATE, err_msg=k)


def _assert_metrics_equal(single: Path, multi: Path) -> None:
    a, b = _train_records(single), _train_records(multi)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(STEPS))
    for ra, rb in zip(a, b, strict=True):
        keys = {k for k in ra if not k.startswith(HOST_DEPENDENT)}
        assert keys == {k for k in rb if not k.startswith(HOST_DEPENDENT)}
        assert "loss" in keys and "grad_norm" in keys
        for k in sorted(keys):
            if k in EXACT_METRICS or k.startswith("memory_") or not isinstance(ra[k], float):
                assert rb[k] == ra[k], (k, ra["step"], ra[k], rb[k])
            else:
                np.testing.assert_allclose(rb[k], ra[k], rtol=METRIC_RTOL, atol=METRIC_ATOL,
                                           err_msg=f"{k} at step {ra['step']}")


def test_two_processes_equal_one_process(runs):
    """pmd_verified: process 0 draws the check's replays and broadcasts the requests, every
    process under its own salt (and, killed, the resumed job redoes step 1's replays under
    other salts: with the replay seed from a salted ``hash()`` its step-1 demonstrations
    differed: tests/loop/test_trainer_verified.py, the same flags in one process); the
    state, weights, metrics and every count of the check end where the one-process run
    ends."""
    single, multi = runs["one"], runs["two"]
    _assert_state_equal(single, multi)
    _assert_hf_equal(single, multi)
    _assert_metrics_equal(single, multi)
    recs = _train_records(multi)
    assert recs[-1]["loss"] != 0.0
    if runs["mode"] == "pmd":
        assert recs[-1]["memory_experiences"] == STEPS * 4  # 2 problems x 2 rollouts a step
    else:
        _assert_draws_equal(single, multi)
        # step 1: 2 item tests (memory.verify.max_items_per_step), on 2 of the 4 problems,
        # whose rows are shown a replay (the others run no replay)
        assert recs[-1]["verify_sequences"] > 0
        assert recs[-1]["demo_from_replay_fraction"] == 0.5


def test_memory_identical_and_written_once(runs):
    single, multi = runs["one"], runs["two"]
    # the memory as exported at the end of the run, and as checkpointed (process 0's slot)
    assert (multi / "memory.jsonl").read_bytes() == (single / "memory.jsonl").read_bytes()
    assert (multi / "memory.html").exists()
    from pmd_jax.run.host_state import HostState, decode

    def slot(run: Path) -> dict:
        d = run / "checkpoints" / str(STEPS) / "memory"
        return decode(HostState.from_bytes((d / "state.json").read_bytes(),
                                           (d / "arrays.npz").read_bytes()))

    mem = slot(multi)
    assert isinstance(mem, dict) and "process" not in mem  # not process 1's placeholder
    assert_same_tree(slot(single), mem)
    if runs["mode"] == "pmd":  # both steps' records: the resume kept them
        assert len(mem["experience"]["items"]) == STEPS * 4


def test_killed_process_stops_the_other_and_both_resume(runs):
    if not runs["killed"]:
        pytest.skip("the default suite's job runs without a kill (the slow -killed params)")
    kill = runs["kill"]
    assert kill["rc0"] is not None, (
        f"process 0 still ran {HEARTBEAT_S + KILL_SLACK_S}s after process 1 was killed")
    assert kill["rc0"] != 0 and not kill["final_hf"]
    assert kill["seconds"] < HEARTBEAT_S + KILL_SLACK_S
    log0 = kill["log0"]
    assert "stopped sending heartbeats" in log0 or "another task died" in log0, log0[-3000:]
    for log in runs["resumed_logs"]:
        assert "resumed from checkpoint at step 1" in log, log[-3000:]


def _assert_eval_equal(single: Path, multi: Path) -> None:
    """The evaluation after the last step: run by process 0 with process 1 serving its
    generate calls, written once, equal to the one-process run's."""
    evals = [[r for r in map(json.loads, filter(None, (run / "metrics.jsonl").read_text()
                                                 .splitlines())) if r["kind"] == "eval"]
             for run in (single, multi)]
    assert [r["step"] for r in evals[0]] == [r["step"] for r in evals[1]] == [STEPS]
    for k in ("accuracy", "num_problems"):
        assert evals[1][0][k] == evals[0][0][k], k
    res = [(run / "eval" / f"step_{STEPS:06d}" / "results.jsonl").read_text()
           for run in (single, multi)]
    assert res[0] and res[1] == res[0]  # the same evaluation texts, written once


def _assert_written_once(run: Path) -> None:
    # one record per step: process 1 writes no metrics (and the resume truncated none away)
    assert [r["step"] for r in _train_records(run)] == list(range(STEPS))
    assert (run / "config.json").exists() and list((run / "plots").glob("*.png"))
    assert len(list((run / "tensorboard").iterdir())) >= 1


def test_evaluation_across_processes(runs):
    _assert_eval_equal(runs["one"], runs["two"])


def test_files_written_once_by_process_0(runs):
    _assert_written_once(runs["two"])


@pytest.mark.slow
def test_grpo_two_processes_equal_one_process(grpo_runs):
    """GRPO's loop across processes: sampling, verification, checkpoints, export and the
    final evaluation. A random model never answers a SciQ question right, so every reward is
    0, every advantage is 0 and the updates are AdamW's weight decay alone: the cross-process
    gradient math is what the PMD run (and tests/distributed/test_multiprocess.py) checks. Slow: the
    default suite's PMD runs cover the same plumbing (evaluation included)."""
    single, multi = grpo_runs["grpo_1"], grpo_runs["grpo_2"]
    for run in (single, multi):  # the runs are GRPO's (a flag order once made them PMD's)
        cfg = json.loads((run / "config.json").read_text())
        assert (cfg["mode"], cfg["distill"]["loss"]["name"]) == ("grpo", "grpo")
    _assert_state_equal(single, multi, trained=False)
    _assert_hf_equal(single, multi)
    _assert_metrics_equal(single, multi)
    assert all(r["reward_mean"] == 0.0 and r["loss"] == 0.0 for r in _train_records(multi))
    assert not (multi / "memory.jsonl").exists()
    _assert_eval_equal(single, multi)
    _assert_written_once(multi)


# ------------------------------------------------------ the default mode and its control
DRAW_METRICS = ("verify_", "extra_demo_", "demo_from_")


def _assert_draws_equal(single: Path, multi: Path) -> None:
    """The check's replays and the extra attempts: every count (sequences, tokens, arms,
    items tested / admitted / rejected, the demonstration shares) equal, not just close."""
    a, b = _train_records(single), _train_records(multi)
    keys = [k for k in a[0] if k.startswith(DRAW_METRICS) and k != "time_verify_replays"]
    assert keys
    for ra, rb in zip(a, b, strict=True):
        for k in keys:
            assert rb[k] == ra[k], (k, ra["step"], ra[k], rb[k])


@pytest.mark.slow
def test_sdpo_matched_sampling_two_processes_equal_one(matched_runs):
    single, multi = matched_runs["matched_1"], matched_runs["matched_2"]
    _assert_state_equal(single, multi)
    _assert_hf_equal(single, multi)
    _assert_metrics_equal(single, multi)
    _assert_draws_equal(single, multi)
    assert all(r["extra_demo_found_fraction"] == 1.0 for r in _train_records(multi))
    _assert_eval_equal(single, multi)
