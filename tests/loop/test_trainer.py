"""End-to-end tests of the loop on a tiny random Llama (SmolLM2's tokenizer, real SciQ data).

They run the real entry point in subprocesses: a clean run, and a shorter run with the
initial policy in a file and the compiled programs dropped every step whose steps must equal
the clean run's to the bit. Slow (the default suite runs their smaller siblings, named
above each): a run killed with SIGKILL after its first checkpoint and restarted with the same
command, which must end bitwise equal (params, and the per-step rewards and losses it
logged); a run whose second checkpoint write really fails (the OS refuses the write:
RLIMIT_FSIZE, which binds root too) must stop naming that step, with the first checkpoint
intact and resumable; restarts at an evaluation's step and from step 0.

Every run of the session shares one persistent XLA compilation cache
(train.compilation_cache_dir) in a temporary folder: the first run compiles, the later ones
(and each restart after a kill) load the same programs, as a user's restarted run does.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pmd_jax.run.metrics import eval_kl_points
from tests.tiny_runs import (  # noqa: E402  (other modules import these from here too)
    ROOT,
    TINY,
    cache_flags,
    jax_cache_dir,
    run_once,
)
from tests.tiny_runs import cmd as _cmd
from tests.tiny_runs import env as _env
from tests.tiny_runs import final_params as _final_params
from tests.tiny_runs import train_records as _train_records

__all__ = ["ROOT", "TINY", "_cmd", "_env", "_final_params", "_train_records", "cache_flags",
           "jax_cache_dir", "run_once"]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> Path:
    return run_once(tmp_path_factory, "clean")


def start_until_checkpoint(run_dir: Path, *extra: str, step: int = 1,
                           stderr: Path | None = None,
                           env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts a run and returns once checkpoint ``step`` is committed (the run goes on).
    ``env``: the run's environment (default: tiny_runs.env())."""
    err = open(stderr, "wb") if stderr is not None else subprocess.PIPE  # noqa: SIM115
    proc = subprocess.Popen(_cmd(run_dir, *extra), cwd=ROOT, env=env or _env(),
                            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    marker = run_dir / "checkpoints" / str(step) / "pmd_commit.json"
    t0 = time.time()
    while not marker.exists():
        if proc.poll() is not None:
            msg = stderr.read_text() if stderr is not None else proc.stderr.read().decode()
            raise AssertionError(msg[-4000:])
        assert time.time() - t0 < 600, "no checkpoint after 600 s"
        time.sleep(0.05)
    return proc


def kill9_and_resume(reference: Path, run_dir: Path, *extra: str) -> str:
    """SIGKILL a run right after its first checkpoint, rerun the same command, and check that
    it ends bitwise equal to ``reference`` (a clean run with the same flags). Returns the
    resumed run's log."""
    proc = start_until_checkpoint(run_dir, *extra)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "final_hf").exists()
    p = subprocess.run(_cmd(run_dir, *extra), cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "resumed from checkpoint" in p.stderr
    a, b = _train_records(reference), _train_records(run_dir)
    assert [r["step"] for r in b] == [0, 1, 2], "a step was lost or repeated"
    for ra, rb in zip(a, b, strict=True):
        for k in ("reward_mean", "loss", "kl", "kl_policy_initial", "grad_norm",
                  "memory_experiences", "memory_insights", "reprompt_sample_fraction",
                  "logp_mismatch_mean", "rollout_staleness", "rollout_weights_version"):
            if k in ra:
                assert ra[k] == rb[k], (k, ra["step"], ra[k], rb[k])
    pa, pb = _final_params(reference), _final_params(run_dir)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    return p.stderr


def test_run_writes_the_run_directory(clean_run: Path):
    recs = _train_records(clean_run)
    assert [r["step"] for r in recs] == [0, 1, 2]
    for r in recs:
        for k in ("reward_mean", "loss", "time_sample", "time_verify", "time_memory",
                  "time_train", "time_publish", "memory_experiences"):
            assert k in r, (k, r)
        assert np.isfinite(r["loss"])
    assert recs[-1]["memory_experiences"] == 12  # 3 steps x 2 problems x 2 rollouts
    assert (clean_run / "final_hf" / "config.json").exists()
    assert (clean_run / "memory.html").exists() and (clean_run / "memory.jsonl").exists()
    assert list((clean_run / "plots").glob("*.png"))
    assert list((clean_run / "tensorboard").iterdir())
    assert list(jax_cache_dir().glob("*-cache"))  # the run wrote its compiled programs


def test_final_evaluation_kl_is_the_next_steps_kl(clean_run: Path, tmp_path: Path):
    """eval.kl_final: the evaluation after a 2-step run's last step samples the rollouts of a
    step 2 with the final weights and measures their KL to the initial policy, which is the
    KL the 3-step clean run measures on its step 2 (the same problems, sampling seed and
    weights: tiny_runs' learning rate is constant). The memory is not touched.

    The short run reads the initial policy from a file (train.offload_initial_policy) and
    drops its compiled programs after every step (train.clear_compiled_every: programs loaded
    again or recompiled), the clean run holds both in memory: its steps' metrics are the
    clean run's to the bit, and the file is gone when the run ends. (The same two options
    under a kill and resume: test_kill9_resume_is_bitwise_identical, slow.)"""
    short = tmp_path / "final_kl"
    p = subprocess.run(_cmd(short, "--config.train.steps=2", "--config.train.eval_every=0",
                            "--config.train.offload_initial_policy=True",
                            "--config.train.clear_compiled_every=1"),
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    (path,) = re.findall(r"initial policy offloaded to (\S+) ", p.stderr)
    assert Path(path).name.startswith("pmd_jax_initial_policy_")
    assert not Path(path).exists()
    for ra, rb in zip(_train_records(clean_run)[:2], _train_records(short), strict=True):
        for k in ("reward_mean", "loss", "kl", "kl_policy_initial", "grad_norm"):
            assert ra[k] == rb[k], (k, ra["step"], ra[k], rb[k])
    recs = [json.loads(x) for x in (short / "metrics.jsonl").read_text().splitlines() if x]
    (ev,) = [r for r in recs if r["kind"] == "eval"]
    assert ev["step"] == 2 and ev["time_kl_final"] > 0
    step2 = _train_records(clean_run)[2]
    assert step2["step"] == 2
    assert abs(ev["kl_policy_initial"]) > 1e-4  # the weights moved
    assert ev["kl_policy_initial"] == pytest.approx(step2["kl_policy_initial"], rel=1e-5)
    assert _train_records(short)[-1]["memory_experiences"] == 8  # 2 steps x 2 problems x 2
    mem = [json.loads(x) for x in (short / "memory.jsonl").read_text().splitlines() if x]
    assert sum(r.get("level") == "experience" for r in mem) == 8, mem[:2]
    assert [p["step"] for p in eval_kl_points(recs)] == [2]


# ~45 s; in the default suite: a kill and resume (tests/run/test_checkpoint.py,
# tests/loop/test_trainer_verified.py) and the two options in a run that ends bitwise
# where the clean run does (test_final_evaluation_kl_is_the_next_steps_kl)
@pytest.mark.slow
def test_kill9_resume_is_bitwise_identical(clean_run: Path, tmp_path: Path):
    """... with the initial policy offloaded to a file (train.offload_initial_policy) and the
    compiled programs dropped after every step (train.clear_compiled_every: programs loaded
    again or recompiled), against the clean run that holds both in memory: every metric and
    parameter is the same to the bit (the KL to the initial policy included), and
    the file is gone when the run ends (the killed attempt's file is overwritten, not left
    beside it: it is named by the run directory)."""
    log = kill9_and_resume(clean_run, tmp_path / "killed",
                           "--config.train.offload_initial_policy=True",
                           "--config.train.clear_compiled_every=1")
    (path,) = re.findall(r"initial policy offloaded to (\S+) ", log)
    assert Path(path).name.startswith("pmd_jax_initial_policy_")
    assert not Path(path).exists()


# ~45 s; the checkpointer's side in the default suite: tests/run/test_checkpoint.py
# test_resume_lets_go_of_the_state_before_restoring_and_rebuilds_it_when_none_is_usable
@pytest.mark.slow
def test_no_usable_checkpoint_starts_from_the_initial_weights_again(
        clean_run: Path, tmp_path: Path):
    """A resume lets go of the train state before it reads the checkpoint (the restored and
    the initial arrays are never resident together); when no checkpoint turns out to be
    usable, the run loads the initial weights again and ends bitwise equal to a clean run."""
    run_dir = tmp_path / "corrupt"
    proc = start_until_checkpoint(run_dir)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for marker in (run_dir / "checkpoints").glob("*/pmd_commit.json"):
        marker.unlink()
    p = subprocess.run(_cmd(run_dir), cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "starting from scratch" in p.stderr and "initial weights again" in p.stderr
    assert [r["step"] for r in _train_records(run_dir)] == [0, 1, 2]
    for ra, rb in zip(_train_records(clean_run), _train_records(run_dir), strict=True):
        assert (ra["loss"], ra["reward_mean"]) == (rb["loss"], rb["reward_mean"]), ra["step"]
    pa, pb = _final_params(clean_run), _final_params(run_dir)
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


# ~40 s; the checkpointer's side in the default suite: tests/run/test_checkpoint.py
# test_run_checkpointer_names_the_failed_write_without_blocking_on_one_in_flight
@pytest.mark.slow
def test_failed_checkpoint_write_names_the_step_and_keeps_the_previous(
        clean_run: Path, tmp_path: Path):
    from pmd_jax.run.checkpoint import verify_step_dir

    run_dir, log = tmp_path / "ckfail", tmp_path / "stderr.txt"
    proc = start_until_checkpoint(run_dir, stderr=log)
    # From now on the OS refuses to grow any file of the run past 2 MiB (EFBIG; Python ignores
    # SIGXFSZ). Metrics and logs stay far below; each checkpoint's array files are ~12 MB, so
    # the write of checkpoint 2 fails inside orbax's background writer, as on a full disk.
    lim = 2 << 20
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (lim, lim))
    try:
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = log.read_text()
    assert rc != 0, err[-4000:]
    assert "checkpoint write at step 2 failed" in err, err[-4000:]
    assert "the previous checkpoint (step 1) is intact" in err, err[-4000:]
    assert "File too large" in err or "errno 27" in err.lower() or "EFBIG" in err, err[-4000:]
    ckpts = run_dir / "checkpoints"
    verify_step_dir(ckpts / "1", 1)  # every file of step 1 has its recorded size and CRC32
    assert not (ckpts / "2" / "pmd_commit.json").exists()
    assert not (run_dir / "final_hf").exists()
    # The same command (2 steps, so it is quick) resumes from step 1 and reproduces the clean
    # run's step 1 exactly: params, optimizer, memory and data cursor came back intact.
    p = subprocess.run(_cmd(run_dir, "--config.train.steps=2"), cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "resumed from checkpoint at step 1" in p.stderr, p.stderr[-4000:]
    a, b = _train_records(clean_run), _train_records(run_dir)
    assert [r["step"] for r in b] == [0, 1]
    for k in ("reward_mean", "loss", "kl", "kl_policy_initial", "grad_norm",
              "memory_experiences", "memory_insights"):
        if k in a[1]:
            assert a[1][k] == b[1][k], (k, a[1][k], b[1][k])


def test_bad_config_fails_before_compute(tmp_path: Path):
    t0 = time.time()
    (tmp_path / "not_a_dir").write_text("")  # a file where the cache folder should be
    p = subprocess.run(
        [sys.executable, "-m", "pmd_jax.main", "--config=configs/smollm2_sciq.py",
         "--config.mode=bogus", "--config.rollout.n=0", f"--config.run_dir={tmp_path}/r",
         "--config.train.compilation_cache_min_compile_secs=-1",
         f"--config.train.compilation_cache_dir={tmp_path}/not_a_dir"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 2
    assert "mode='bogus'" in p.stderr and "rollout.n" in p.stderr
    assert "train.compilation_cache_min_compile_secs" in p.stderr
    assert "train.compilation_cache_dir" in p.stderr and "not a directory" in p.stderr
    assert not (tmp_path / "r").exists()
    p = subprocess.run(
        [sys.executable, "-m", "pmd_jax.main", "--config=configs/smollm2_sciq.py",
         "--config.rollout.no_such_key=1"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert p.returncode != 0 and "no_such_key" in p.stderr
    assert time.time() - t0 < 120


def test_compilation_cache_option(tmp_path: Path):
    """train.compilation_cache_* set jax's persistent cache ("~" expanded, "none" = off, the
    size in GiB); jax's own environment variables, when set, are left to win."""
    code = (
        "import json, sys, jax\n"
        "from pmd_jax.config import base_config, setup_compilation_cache\n"
        "c = base_config().train\n"
        "c.compilation_cache_dir, c.compilation_cache_min_compile_secs = sys.argv[1], 0.5\n"
        "c.compilation_cache_max_gib = 2\n"
        "d = setup_compilation_cache(c)\n"
        "print(json.dumps([d, jax.config.jax_persistent_cache_min_compile_time_secs,\n"
        "                  jax.config.jax_compilation_cache_max_size]))\n"
    )

    def run(arg: str, **env: str) -> list:
        p = subprocess.run([sys.executable, "-c", code, arg], cwd=ROOT, text=True,
                           env={**_env(), "HOME": str(tmp_path), **env},
                           capture_output=True, timeout=300)
        assert p.returncode == 0, p.stderr[-4000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    assert run("~/xla") == [str(tmp_path / "xla"), 0.5, 2 * 2**30]
    assert run("none")[0] is None
    assert run("~/xla", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "env"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="3") == [
        str(tmp_path / "env"), 3.0, 2 * 2**30]


# ~20 s (a one-step run); the metrics file's side in the default suite:
# tests/run/test_metrics_resume.py
@pytest.mark.slow
def test_a_run_from_step_0_drops_an_earlier_attempts_records(tmp_path: Path):
    """A run directory whose earlier attempt died before its first checkpoint: the new run
    starts at step 0 and its metrics.jsonl holds the new run's records only (the grid's
    restarted cells had logged their step-0 evaluation twice)."""
    run = tmp_path / "restarted"
    run.mkdir()
    stale = [{"kind": "eval", "step": 0, "accuracy": 0.99, "stale": True},
             {"kind": "train", "step": 0, "loss": 9.0, "stale": True}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stale))
    p = subprocess.run(_cmd(run, "--config.train.steps=1"), cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    assert not any(r.get("stale") for r in recs), recs
    assert [(r["kind"], r["step"]) for r in recs] == [("train", 0)]
    assert "dropped 2 metrics records of an earlier attempt" in p.stderr


# ~65-75 s (three runs); the metrics file's side in the default suite:
# tests/run/test_metrics_resume.py
@pytest.mark.slow
def test_a_restart_at_an_evaluations_step_keeps_or_runs_it(tmp_path: Path):
    """A run restarted from the checkpoint of a step that is evaluated: an evaluation that
    finished before the restart is kept, not run again; one that did not (the run died in it,
    as the MBPP grid's pmd cell did) runs before the next step. Either way every evaluated
    step has one record."""
    def run(run_dir: Path, steps: int) -> str:
        p = subprocess.run(_cmd(run_dir, "--config.train.eval_every=1",
                                f"--config.train.steps={steps}"),
                           cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-4000:]
        return p.stderr

    def evals(run_dir: Path) -> list[dict]:
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r for r in recs if r["kind"] == "eval"]

    done, died = tmp_path / "done", tmp_path / "died"
    run(done, 1)  # step 0 trained, checkpoint 1, step 1 evaluated
    (first,) = evals(done)
    assert first["step"] == 1
    shutil.copytree(done, died)
    # the other run died in that evaluation: checkpoint 1 is there, its record is not
    lines = (died / "metrics.jsonl").read_text().splitlines()
    (died / "metrics.jsonl").write_text("".join(
        x + "\n" for x in lines if json.loads(x)["kind"] != "eval"))
    log_done, log_died = run(done, 2), run(died, 2)
    for log_ in (log_done, log_died):
        assert "resumed from checkpoint at step 1" in log_, log_[-4000:]
    assert "(its evaluation finished before: kept)" in log_done
    assert "(its evaluation finished before: kept)" not in log_died
    a, b = evals(done), evals(died)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert a[0] == first  # kept as written, not run again
    assert b[0]["time"] > first["time"]  # run again after the restart
    for ra, rb in zip(a, b, strict=True):
        assert (ra["accuracy"], ra["num_problems"]) == (rb["accuracy"], rb["num_problems"])


# ~30 s (a start-up that loads the model); the crafted-slot and converter tests of
# tests/run/test_host_state.py cover the checkpointer's side in the default run
@pytest.mark.slow
def test_a_checkpoint_of_the_pickling_format_is_refused_in_one_line(clean_run: Path,
                                                                     tmp_path: Path):
    """A resume from a checkpoint whose host state was pickled (an older pmd_jax, or a
    crafted one) stops in one line, exit 2, naming the converter, and unpickles nothing."""
    import pickle
    import shutil

    from pmd_jax.run.checkpoint import write_commit_marker

    run_dir = tmp_path / "old"
    shutil.copytree(clean_run, run_dir)
    step_dir = max((run_dir / "checkpoints").glob("[0-9]*"), key=lambda p: int(p.name))
    slot = step_dir / "memory"
    for f in slot.iterdir():
        if f.name != "commit_success.txt":
            f.unlink()
    ran = tmp_path / "ran"
    (slot / "blob.bin").write_bytes(
        pickle.dumps(type("Boom", (), {"__reduce__": lambda s: (os.system, (f"touch {ran}",))})()))
    (slot / "kind").write_text("bytes")
    write_commit_marker(step_dir, int(step_dir.name))
    p = subprocess.run(_cmd(run_dir), cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("cannot start: checkpoint slot") and "pickled host state" in last
    assert f"python -m pmd_jax.run.convert --run_dir={run_dir}" in last, last
    assert "Traceback" not in p.stderr and not ran.exists()
