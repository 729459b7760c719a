"""Orbax checkpoints: slots, restore onto a mesh, corrupt/partial fallback, kill -9 resume.

The kill -9 test runs this file as a worker in subprocesses (``python test_checkpoint.py
--worker ...``): a tiny-model training run (deterministic data per step) that saves every
step asynchronously. One run goes uninterrupted; another is killed with SIGKILL after it
reports step 3, then restarted; the restarted run's per-step losses and full-state digests
must be bitwise identical to the uninterrupted run's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.run import sharding as shd
from pmd_jax.run.checkpoint import COMMIT_FILE, Checkpointer, CheckpointError
from tests.host import need_devices
from tests.tiny_runs import child_env

REPO = Path(__file__).resolve().parents[2]


def _state(seed: int = 0) -> dict:
    r = np.random.default_rng(seed)
    return {
        "params": {"w": jnp.asarray(r.normal(size=(8, 4)), jnp.float32),
                   "b": jnp.asarray(r.normal(size=(4,)), jnp.bfloat16)},
        "step": jnp.int32(seed),
        "rng": jax.random.key_data(jax.random.PRNGKey(seed)),
    }


def _assert_tree_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_restore_with_slots(tmp_path):
    mem_dir = tmp_path / "memory_src"
    (mem_dir / "index").mkdir(parents=True)
    (mem_dir / "index" / "vectors.bin").write_bytes(os.urandom(1000))
    (mem_dir / "items.jsonl").write_text('{"a": 1}\n')
    ck = Checkpointer(tmp_path / "ck", max_to_keep=2)
    for step in (1, 2, 3):
        (mem_dir / "items.jsonl").write_text(f'{{"v": {step}}}\n')
        ck.save(step, _state(step), slots={"memory": mem_dir, "data_cursor": {"epoch": 0,
                                                                              "pos": step}})
        (mem_dir / "items.jsonl").write_text("changed right after save\n")  # copy was taken
    ck.wait()
    assert ck.all_steps() == [2, 3]  # keep last N
    r = ck.restore(_state(0), slot_dirs={"memory": tmp_path / "memory_out"})
    assert r.step == 3 and r.skipped == []
    _assert_tree_equal(r.state, _state(3))
    assert r.slots["data_cursor"] == {"epoch": 0, "pos": 3}
    out = r.slots["memory"]
    assert out == tmp_path / "memory_out"
    assert (out / "items.jsonl").read_text() == '{"v": 3}\n'
    assert (out / "index" / "vectors.bin").read_bytes() == (
        mem_dir / "index" / "vectors.bin").read_bytes()
    ck.save(4, _state(4), slots={"memory": b"\x00raw-bytes\xff"})
    r = ck.restore(_state(0))
    assert r.step == 4 and r.slots == {"memory": b"\x00raw-bytes\xff"}
    with pytest.raises(CheckpointError, match="unknown checkpoint slots"):
        ck.save(5, _state(5), slots={"optimizer_notes": {}})
    ck.close()


def _corrupt_truncate(step_dir: Path) -> str:
    f = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
            key=lambda p: p.stat().st_size)
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    return "truncated"


def _corrupt_flip(step_dir: Path) -> str:
    f = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
            key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    return "CRC32"


def _corrupt_no_marker(step_dir: Path) -> str:
    (step_dir / COMMIT_FILE).unlink()
    return "no commit marker"


@pytest.mark.parametrize("corrupt", [_corrupt_truncate, _corrupt_flip, _corrupt_no_marker])
def test_corrupt_latest_falls_back_to_previous(tmp_path, caplog, corrupt):
    ck = Checkpointer(tmp_path, max_to_keep=3, async_save=False)
    for step in (1, 2):
        ck.save(step, _state(step), slots={"data_cursor": {"pos": step}})
    expect = corrupt(tmp_path / "2")
    with caplog.at_level(logging.WARNING, logger="pmd_jax.run.checkpoint"):
        r = ck.restore(_state(0))
    assert r.step == 1
    _assert_tree_equal(r.state, _state(1))
    assert r.slots["data_cursor"] == {"pos": 1}
    assert r.skipped and r.skipped[0][0] == 2 and expect in r.skipped[0][1]
    assert str(tmp_path / "2") in caplog.text and expect in caplog.text
    # the bad step was moved aside, so the run can save step 2 again
    assert not (tmp_path / "2").exists() and any((tmp_path / "corrupt").iterdir())
    ck.save(2, _state(2))
    assert ck.restore(_state(0)).step == 2
    ck.close()


def test_partial_tmp_dir_is_ignored_and_all_corrupt_is_an_error(tmp_path):
    ck = Checkpointer(tmp_path, async_save=False)
    ck.save(1, _state(1))
    ck.close()
    # a save killed mid-way leaves orbax's tmp directory: never a step
    partial = tmp_path / "2.orbax-checkpoint-tmp"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "_METADATA").write_text("{")
    ck = Checkpointer(tmp_path, async_save=False)
    assert ck.restore(_state(0)).step == 1
    (tmp_path / "1" / COMMIT_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"no usable checkpoint .*step 1: .*no commit marker"):
        ck.restore(_state(0))
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        Checkpointer(tmp_path / "empty").restore(_state(0))


def test_poll_raises_a_failed_background_write_once_it_has_ended(tmp_path):
    """The trainer polls the in-flight save after every step: a background write that fails
    (here EFBIG under RLIMIT_FSIZE, as on a full disk; Python ignores SIGXFSZ) raises at the
    first poll after it ended, not at the next save up to ``train.checkpoint_every`` steps on."""
    ck = Checkpointer(tmp_path, max_to_keep=3)
    rng = np.random.default_rng(0)  # random floats: OCDBT's compression cannot shrink them
    state = {"w": jnp.asarray(rng.random(3_000_000, dtype=np.float32))}  # 12 MB
    ck.save(1, state)
    ck.wait()
    assert ck.poll() is False  # ended and committed: nothing to raise, nothing in flight
    save_fails_past_2_mib(ck, state, 2)
    assert ck.committed_steps() == [1]
    assert ck.restore(jax.tree.map(jnp.zeros_like, state)).step == 1
    ck.save(3, state)  # the checkpointer is usable again once the space is back
    ck.wait()
    assert ck.committed_steps() == [1, 3] and ck.poll() is False


def test_run_checkpointer_names_the_failed_write_without_blocking_on_one_in_flight(tmp_path):
    """The trainer's side of the above (RunCheckpointer.wait(block=False) after every step):
    the error names the failed step and the intact one; nothing in flight is a no-op."""
    import types

    from pmd_jax.loop.phases import TrainingError
    from pmd_jax.run.checkpoint import RunCheckpointer

    ck = RunCheckpointer(tmp_path, keep=3)
    rng = np.random.default_rng(0)
    bundle = types.SimpleNamespace(state={"w": jnp.asarray(rng.random(3_000_000, np.float32))})
    extras = {"data_cursor": {"pos": 0}}
    ck.wait(block=False)  # no save yet: nothing to look at
    ck.save(1, bundle, extras)
    ck.wait()
    assert ck.inflight is None
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, hard))
    try:
        ck.save(2, bundle, extras)
        assert ck.inflight == 2
        deadline = time.time() + 120
        with pytest.raises(TrainingError, match=r"checkpoint write at step 2 failed .*File too "
                           r"large.*; the previous checkpoint \(step 1\) is intact"):
            while ck.inflight is not None:
                ck.wait(block=False)
                assert time.time() < deadline, "the failed save never ended"
                time.sleep(0.02)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert ck.inflight is None
    ck.wait()  # the error was reported once; the next save starts clean
    ck.save(3, bundle, extras)
    ck.wait()
    assert ck.ckpt.committed_steps() == [1, 3]


def test_restore_onto_mesh_shardings(tmp_path):
    devices = need_devices(8)
    rules = shd.ShardingRules.from_mapping()
    axes = {"embed": ("vocab", "embed"), "mlp": ("embed", "mlp")}
    r = np.random.default_rng(0)
    host = {"embed": r.normal(size=(16, 8)).astype(np.float32),
            "mlp": r.normal(size=(8, 32)).astype(np.float32)}
    mesh_a = shd.make_mesh({"fsdp": 4, "tensor": 2}, devices=devices)
    saved = shd.shard_tree(host, mesh_a, rules, axes)
    ck = Checkpointer(tmp_path)
    ck.save(7, saved)
    ck.wait()
    mesh_b = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, devices=devices)  # relaid
    target_sh = shd.tree_shardings(mesh_b, rules, axes)
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          host, target_sh)
    out = ck.restore(target).state
    for k in host:
        assert out[k].sharding == target_sh[k]
        np.testing.assert_array_equal(np.asarray(out[k]), host[k])
    ck.close()


# --------------------------------------------------------------------------------------------
# kill -9 and resume: bitwise identical continuation
# --------------------------------------------------------------------------------------------


def _worker(ck_dir: str, out_path: str, steps: int, delay: float) -> None:
    from pmd_jax.distill import align
    from pmd_jax.distill import step as st
    from pmd_jax.distill.batch import make_batch
    from pmd_jax.distill.config import default_distill_config, freeze_distill_config
    from pmd_jax.models import decoder
    from tests.fakes import tiny_model_config

    cfg = tiny_model_config(vocab_size=40, num_kv_heads=1)
    c = default_distill_config()
    c.teacher.rule = "ema"
    c.teacher.rate = 0.1
    c.loss.topk = 8
    c.loss.chunk_size = 4
    c.optim.lr = 1e-2
    c.optim.warmup_steps = 2
    ts = st.TrainStep(cfg, freeze_distill_config(c))

    def batch_for(step: int) -> dict:
        r = np.random.default_rng(1000 + step)
        sp = [r.integers(1, 40, r.integers(2, 6)) for _ in range(4)]
        tp = [r.integers(1, 40, r.integers(3, 9)) for _ in range(4)]
        rs = [r.integers(1, 40, r.integers(2, 7)) for _ in range(4)]
        db = align.build_distill_batch(sp, tp, rs, pad_id=0, max_len=16, teacher_max_len=16,
                                       max_response_len=8)
        return make_batch(db, sampler_logp=r.normal(-3, 0.5, size=(4, 8)))

    template = ts.init(decoder.init_params(cfg, jax.random.PRNGKey(0)), 0)
    ck = Checkpointer(ck_dir, max_to_keep=2)
    try:
        restored = ck.restore(template)
        state, start = restored.state, restored.step
        assert restored.slots["data_cursor"]["next_step"] == start
        assert int(state.step) == start
        print(f"resumed {start}", flush=True)
    except CheckpointError:
        state, start = template, 0
    with open(out_path, "a") as out:
        for k in range(start, steps):
            state, m = ts.step(state, batch_for(k))
            digest = hashlib.sha256()
            for leaf in jax.tree.leaves(state):
                digest.update(np.asarray(leaf).tobytes())
            out.write(json.dumps({"step": k + 1, "loss": float(m["loss"]).hex(),
                                  "digest": digest.hexdigest()}) + "\n")
            out.flush()
            ck.save(k + 1, state, slots={"data_cursor": {"next_step": k + 1},
                                         "memory": {"seen": list(range(k + 1))}})
            print(f"saved {k + 1}", flush=True)
            time.sleep(delay)
    ck.close()
    print("done", flush=True)


def _run_worker(ck_dir: Path, out: Path, steps: int, delay: float, kill_after: int | None):
    env = child_env()
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    # one compile shared by the three runs (the cached executable is the same program)
    env["JAX_COMPILATION_CACHE_DIR"] = str(ck_dir.parent / "jax_cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    cmd = [sys.executable, __file__, "--worker", str(ck_dir), str(out), str(steps), str(delay)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(REPO))
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.strip())
        if kill_after is not None and line.strip() == f"saved {kill_after}":
            os.kill(proc.pid, signal.SIGKILL)
            break
    rc = proc.wait(timeout=600)
    err = proc.stderr.read() if proc.stderr else ""
    if kill_after is None:
        assert rc == 0, err[-3000:]
    else:
        assert rc == -signal.SIGKILL, (rc, err[-3000:])
    return lines


def _records(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.timeout(900)
def test_kill9_and_resume_is_bitwise_identical(tmp_path):
    steps = 6
    ref_out = tmp_path / "ref.jsonl"
    _run_worker(tmp_path / "ck_ref", ref_out, steps, 0.0, None)
    ref = _records(ref_out)
    assert sorted(ref) == list(range(1, steps + 1))

    out = tmp_path / "run.jsonl"
    _run_worker(tmp_path / "ck", out, steps, 0.5, kill_after=3)
    killed = _records(out)
    assert max(killed) < steps  # it really died before the end
    lines = _run_worker(tmp_path / "ck", out, steps, 0.0, None)
    resumed_at = int(next(x for x in lines if x.startswith("resumed")).split()[1])
    assert 1 <= resumed_at <= max(killed)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    after = [r for r in rows if r["step"] > resumed_at][-(steps - resumed_at):]
    assert [r["step"] for r in after] == list(range(resumed_at + 1, steps + 1))
    for r in after:  # step k+1 onwards: same loss bits and same full-state bytes
        assert r["loss"] == ref[r["step"]]["loss"], r["step"]
        assert r["digest"] == ref[r["step"]]["digest"], r["step"]
    for r in rows:  # and the killed run agreed with the reference before it died
        assert r["digest"] == ref[r["step"]]["digest"]


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))


def save_fails_past_2_mib(ck, state, step: int) -> None:
    """Saves ``step`` while the process may not grow a file past 2 MiB (EFBIG, as on a full
    disk): the background write fails and ``poll`` raises it (within 2 minutes)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, hard))
    try:
        ck.save(step, state)  # returns once the arrays are on the host; the write goes on
        deadline = time.time() + 120
        with pytest.raises(Exception, match="File too large|EFBIG|rrno 27"):
            while ck.poll():
                assert time.time() < deadline, "the failed save never ended"
                time.sleep(0.02)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _bundle(seed: int):
    import types

    state = _state(seed)
    sds = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sds), state)
    return types.SimpleNamespace(
        state=state, step_fn=types.SimpleNamespace(abstract_state=lambda: abstract))


def test_resume_lets_go_of_the_state_before_restoring_and_rebuilds_it_when_none_is_usable(
        tmp_path, monkeypatch):
    """RunCheckpointer.restore_latest with ``rebuild`` (the trainer's resume): the arrays the
    bundle held are freed before the checkpoint's are read, so the two are never resident
    together (a Qwen2.5-Coder-0.5B resume holding both was killed on 24 GiB); the restored
    state is the saved one; with every checkpoint corrupt the run starts from ``rebuild()``.
    Without ``rebuild`` the state is kept (no way to make it again)."""
    import weakref

    from pmd_jax.run.checkpoint import RunCheckpointer

    saved = _bundle(1)
    ck = RunCheckpointer(tmp_path, keep=2)
    ck.save(4, saved, {"data_cursor": {"pos": 3}})
    ck.wait()

    bundle = _bundle(0)
    held = weakref.ref(bundle.state["params"]["w"])
    ck = RunCheckpointer(tmp_path, keep=2)
    real = ck.ckpt.restore
    alive_at_restore = []

    def restore(target, **kw):
        alive_at_restore.append(held() is not None)
        return real(target, **kw)

    monkeypatch.setattr(ck.ckpt, "restore", restore)
    got, extras = ck.restore_latest(bundle, rebuild=lambda: pytest.fail("rebuilt"))
    assert alive_at_restore == [False], "the old state was resident during the restore"
    assert extras["step"] == 4 and extras["data_cursor"] == {"pos": 3}
    _assert_tree_equal(got.state, saved.state)

    kept = _bundle(0)
    ck = RunCheckpointer(tmp_path, keep=2)
    real_kept = ck.ckpt.restore
    monkeypatch.setattr(ck.ckpt, "restore",
                        lambda target, **kw: (alive_at_restore.append(kept.state is not None),
                                              real_kept(target, **kw))[1])
    ck.restore_latest(kept)
    assert alive_at_restore == [False, True]

    _corrupt_no_marker(tmp_path / "checkpoints" / "4")
    fresh = _bundle(0)
    assert RunCheckpointer(tmp_path, keep=2).restore_latest(
        fresh, rebuild=lambda: _state(7)) is None
    _assert_tree_equal(fresh.state, _state(7))

