"""The disk a run's checkpoints take (issue 38, item 4): the estimate against a real saved
checkpoint of a tiny trained state, the refusal to start without room for two, and what one
kept checkpoint (the default) still protects."""

from __future__ import annotations

import collections
import logging
import shutil
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.run import disk
from pmd_jax.run.checkpoint import Checkpointer, RunCheckpointer
from pmd_jax.run.disk import DiskPlan, DiskSpaceError, checkpoint_bytes
from tests.run.test_checkpoint import save_fails_past_2_mib  # noqa: I001

_Usage = collections.namedtuple("_Usage", "total used free")


def _trained_state(steps: int = 2):
    """A tiny model's TrainState after ``steps`` updates (params, both AdamW moments and the
    EMA teacher non-zero, as in a run's checkpoints)."""
    from pmd_jax.distill import align
    from pmd_jax.distill import step as st
    from pmd_jax.distill.batch import make_batch
    from pmd_jax.distill.config import default_distill_config, freeze_distill_config
    from pmd_jax.models import decoder
    from pmd_jax.models.config import ModelConfig

    cfg = ModelConfig(family="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    c = default_distill_config()
    c.teacher.rule, c.teacher.rate = "ema", 0.1
    c.loss.topk, c.loss.chunk_size = 8, 4
    c.optim.lr, c.optim.warmup_steps = 1e-2, 0
    ts = st.TrainStep(cfg, freeze_distill_config(c))
    state = ts.init(decoder.init_params(cfg, jax.random.PRNGKey(0)), 0)
    for k in range(steps):
        r = np.random.default_rng(k)
        sp = [r.integers(1, 512, r.integers(2, 6)) for _ in range(4)]
        tp = [r.integers(1, 512, r.integers(3, 9)) for _ in range(4)]
        rs = [r.integers(1, 512, r.integers(2, 7)) for _ in range(4)]
        db = align.build_distill_batch(sp, tp, rs, pad_id=0, max_len=16, teacher_max_len=16,
                                       max_response_len=8)
        state, _ = ts.step(state, make_batch(db, sampler_logp=r.normal(-3, 0.5, size=(4, 8))))
    return state


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def test_estimate_bounds_a_saved_checkpoint(tmp_path):
    state = _trained_state()
    bundle = types.SimpleNamespace(state=state)
    memory = {"items": [f"item {i}" for i in range(500)]}  # the memory slot's value
    ck = RunCheckpointer(tmp_path, keep=1)
    line = ck.check_disk(bundle, {"memory": memory}, export_hf=True)
    est = checkpoint_bytes(state, {"memory": memory})
    arrays = sum(x.nbytes for x in jax.tree.leaves(state))
    assert est > arrays
    ck.save(2, bundle, {"data_cursor": {"pos": 0}, "memory": memory})
    ck.wait()
    real = _dir_bytes(tmp_path / "checkpoints" / "2")
    # an upper bound (arrays uncompressed), within what orbax's compression takes off
    assert 0.6 * est <= real <= est, (real, est)
    assert line.startswith("checkpoints: one takes up to ~")
    assert "keeping 1 (train.keep_checkpoints)" in line and "(2 while the next is written)" in line
    assert "the final HF export's weights ~" in line
    assert f"free on {tmp_path / 'checkpoints'}: " in line
    ck.ckpt.close()


def test_refuses_to_start_without_room_for_two(tmp_path, monkeypatch, caplog):
    bundle = types.SimpleNamespace(state={"params": {"w": jnp.ones((1024, 256))}})  # 1 MiB
    ck = RunCheckpointer(tmp_path, keep=1)
    one = checkpoint_bytes(bundle.state)
    free = {"n": int(1.5 * one)}
    monkeypatch.setattr(shutil, "disk_usage", lambda p: _Usage(10 * one, 0, free["n"]))
    with pytest.raises(DiskSpaceError) as e:
        ck.check_disk(bundle)
    msg = str(e.value)
    assert msg.startswith(f"not enough disk for checkpoints in {tmp_path / 'checkpoints'}: ")
    assert "a run needs room for two" in msg and "free needed" in msg and "MiB free" in msg
    # room for two: starts; keeping 3 needs four, so the log warns (no refusal)
    free["n"] = int(2.5 * one)
    ck3 = RunCheckpointer(tmp_path / "three", keep=3)
    with caplog.at_level(logging.WARNING, logger="pmd_jax.run.checkpoint"):
        ck3.check_disk(bundle)
    assert "keeping 3 (train.keep_checkpoints) needs" in caplog.text
    assert "lower train.keep_checkpoints" in caplog.text
    ck.ckpt.close()
    ck3.ckpt.close()


def test_disk_plan_counts_checkpoints_already_there_and_skips_remote():
    one = 100
    # resumed with its one kept checkpoint: the next needs room for one more only
    assert DiskPlan("d", one, keep=1, present=1, free=150).to_start == 100
    DiskPlan("d", one, keep=1, present=1, free=150).check()
    with pytest.raises(DiskSpaceError):
        DiskPlan("d", one, keep=1, present=0, free=150).check()
    assert DiskPlan("d", one, keep=3, present=3, free=0).to_start == 100  # a next one, always
    DiskPlan("gs://b/run/checkpoints", one, keep=1, free=None).check()  # remote: not measured
    assert disk.free_bytes("gs://b/run") is None
    assert "not measured (remote)" in DiskPlan("gs://b/r", one, keep=1).describe()


def test_keeping_one_still_leaves_the_last_through_a_failed_write(tmp_path):
    """Orbax deletes the old step only after the new one is committed: with max_to_keep=1 a
    save that fails mid-write (EFBIG under RLIMIT_FSIZE, as on a full disk) leaves the previous
    checkpoint, which restores; the next good save replaces it."""
    ck = Checkpointer(tmp_path, max_to_keep=1)
    rng = np.random.default_rng(0)
    state = {"w": jnp.asarray(rng.random(3_000_000, dtype=np.float32))}  # 12 MB
    ck.save(1, state)
    ck.wait()
    save_fails_past_2_mib(ck, state, 2)
    assert ck.committed_steps() == [1] and (tmp_path / "1").is_dir()
    assert ck.restore(jax.tree.map(jnp.zeros_like, state)).step == 1
    ck.save(3, state)
    ck.wait()
    assert ck.committed_steps() == [3] and not (tmp_path / "1").exists()
    ck.close()


def test_default_keeps_one_checkpoint():
    from pmd_jax.config import base_config

    assert base_config().train.keep_checkpoints == 1
