"""Gradient accumulation (train.microbatch_rows): the accumulated step equals the full-batch
step (loss, metrics, grad norm, params, optimizer moments, EMA teacher), unsharded and on an
8-fake-device mesh, for the SDPO, GRPO and hybrid losses.

Reference: the full-batch step (``microbatch_rows=0``), whose losses are token means over the
whole batch; the batch has rows without signal (``sd_mask = 0``), a whole microbatch without
any, and responses of different lengths, so per-microbatch normalisation would differ.
"""

from __future__ import annotations

# isort: off
from tests.distill.distill_common import (  # first: sets 8 fake devices
    TINY, assert_same_steps, ema_step_config, make_mesh8, start_state, tiny_params)
# isort: on

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.distill import accumulate, align
from pmd_jax.distill import batch as dbatch
from pmd_jax.distill import step as st
from pmd_jax.run import sharding as shd

B = 16
GROUP = 2
TOL = dict(rtol=1e-5, atol=1e-5)


def _cfg(mode: str):
    return ema_step_config(mode, GROUP)


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    sp = [r.integers(1, TINY.vocab_size, r.integers(2, 6)) for _ in range(B)]
    tp = [r.integers(1, TINY.vocab_size, r.integers(3, 10)) for _ in range(B)]
    rs = [r.integers(1, TINY.vocab_size, r.integers(1, 9)) for _ in range(B)]
    db = align.build_distill_batch(sp, tp, rs, pad_id=0)
    sd = (r.random(B) < 0.6).astype(np.float32)
    sd[4:8] = 0.0  # a whole microbatch of 4 rows without signal
    sd[0] = 1.0
    return dbatch.make_batch(
        db, sd_mask=sd,
        sampler_logp=r.normal(-3.5, 1.0, db.responses.shape).astype(np.float32),
        old_logp=r.normal(-3.8, 0.5, db.responses.shape).astype(np.float32),
        rewards=r.integers(0, 2, B).astype(np.float32),
    )


_params = tiny_params
_start = start_state


def _np(tree):
    return jax.tree.map(np.asarray, tree)


def _run(ts: st.TrainStep, steps: int = 2):
    state, batch, out = _start(ts), _batch(), []
    for i in range(steps):
        b = batch if i == 0 else _batch(i)
        state, m = ts.step(state, b)
        out.append(_np(m))
    return _np(state), out


@pytest.fixture(scope="module")
def mesh():
    return make_mesh8()


def _assert_same(got, want):
    assert_same_steps(got, want, TOL)


# slow tests all three (sdpo ~15-20 s on 2 cores): hybrid (GRPO's PPO-clip path with the
# teacher's advantage added: both parts) runs in the default suite on the mesh, below
@pytest.mark.parametrize("mode", [pytest.param("sdpo", marks=pytest.mark.slow),
                                  pytest.param("grpo", marks=pytest.mark.slow),
                                  pytest.param("hybrid", marks=pytest.mark.slow)])
def test_accumulated_equals_full_batch_unsharded(mode):
    ref = st.TrainStep(TINY, _cfg(mode))
    acc = st.TrainStep(TINY, _cfg(mode), microbatch_rows=4)
    assert acc.num_microbatches(B) == 4 and ref.num_microbatches(B) == 1
    want, got = _run(ref), _run(acc)
    _assert_same(got, want)
    m = want[1][0]
    assert m["num_loss_tokens"] > 0 and m["grad_norm"] > 0
    if mode != "grpo":  # a real EMA teacher moved
        assert not np.allclose(jax.tree.leaves(want[0].teacher)[0],
                               np.asarray(jax.tree.leaves(_params(7))[0]))
    # the accumulated program really loops over microbatches
    hlo = acc.lower(acc.abstract_state(), _batch()).as_text()
    assert "while" in hlo


# On the mesh, hybrid alone in the default suite: it reads both the teacher arrays (SDPO's
# part) and the rewards in whole groups (GRPO's part); sdpo and grpo there are slow tests
# (about 70 s together on 2 cores).
@pytest.mark.parametrize("mode", [pytest.param("sdpo", marks=pytest.mark.slow),
                                  pytest.param("grpo", marks=pytest.mark.slow), "hybrid"])
def test_accumulated_equals_full_batch_on_mesh(mesh, mode):
    rules = shd.ShardingRules.from_mapping()
    ref = st.TrainStep(TINY, _cfg(mode), mesh=mesh, rules=rules)
    acc = st.TrainStep(TINY, _cfg(mode), mesh=mesh, rules=rules, microbatch_rows=4)
    assert acc.batch_divisor() == 4 and acc.num_microbatches(B) == 4
    want, got = _run(ref), _run(acc)
    _assert_same(got, want)
    m = want[1][0]
    assert m["num_loss_tokens"] > 0 and m["grad_norm"] > 0
    if mode != "grpo":  # a real EMA teacher moved
        assert not np.allclose(np.asarray(jax.tree.leaves(want[0].teacher)[0]),
                               np.asarray(jax.tree.leaves(_params(7))[0]))
    # the accumulated program really loops over microbatches
    assert "while" in acc.lower(acc.abstract_state(), _batch()).as_text()


def test_microbatch_size_rule():
    assert accumulate.microbatch_size(64, 0, 1) == 64  # off
    assert accumulate.microbatch_size(64, 16, 8) == 16
    assert accumulate.microbatch_size(8, 16, 8) == 8  # a small bucket is one microbatch
    assert accumulate.microbatch_size(48, 32, 8) == 24  # 32 does not divide 48
    assert accumulate.microbatch_size(40, 32, 8) == 8
    with pytest.raises(accumulate.MicrobatchError, match="not a multiple of 8"):
        accumulate.microbatch_size(64, 12, 8)
    with pytest.raises(accumulate.MicrobatchError, match=">= 0"):
        accumulate.check_microbatch_rows(-1, 1)


def test_bad_microbatch_rows_fail_at_construction(mesh):
    with pytest.raises(accumulate.MicrobatchError, match="multiple of 4"):
        st.TrainStep(TINY, _cfg("sdpo"), mesh=mesh, microbatch_rows=6)
    with pytest.raises(accumulate.MicrobatchError, match="GRPO group"):
        st.TrainStep(TINY, _cfg("grpo"), microbatch_rows=3)


def test_weights_reproduce_a_global_token_mean():
    """Direct formula: sum_i w_i * mean_i == the mean over all rows, incl. empty microbatches."""
    r = np.random.default_rng(1)
    x = r.normal(size=(12, 5)).astype(np.float32)
    resp = (r.random((12, 5)) < 0.5).astype(np.float32)
    resp[3:6] = 0.0
    sd = np.ones(12, np.float32)
    w = accumulate._weights({"response_mask": jnp.asarray(resp), "sd_mask": jnp.asarray(sd)},
                            4)["response"]
    per = [(x[i:i + 3] * resp[i:i + 3]).sum() / max(resp[i:i + 3].sum(), 1.0)
           for i in range(0, 12, 3)]
    np.testing.assert_allclose(float(np.sum(np.asarray(w) * per)),
                               (x * resp).sum() / resp.sum(), rtol=1e-6)


def test_unknown_metric_is_an_error():
    with pytest.raises(KeyError, match="no accumulation rule"):
        accumulate.combine_metrics({"new_metric": jnp.zeros(2)},
                                   {"rows": jnp.full(2, 0.5)}, "sdpo")


def test_config_validation_names_the_problem():
    from pmd_jax.config import base_config, batch_plan_errors

    c = base_config()  # 32 problems x 8 rollouts = 256 rows
    assert batch_plan_errors(c) == []
    c.train.microbatch_rows = 32
    assert batch_plan_errors(c) == []
    c.train.microbatch_rows = 48
    assert batch_plan_errors(c) == ["train.microbatch_rows=48 does not divide the update batch "
                                     "of rollout.problems_per_step x rollout.n = 256 rows"]
    c.train.microbatch_rows = 4
    c.distill.loss.name = "hybrid"
    assert any("not a multiple of the GRPO group, rollout.n=8" in e
               for e in batch_plan_errors(c))
    c.distill.loss.name = "sdpo"
    c.mesh.data, c.mesh.fsdp = 2, 4
    assert batch_plan_errors(c) == [
        "train.microbatch_rows=4 is not a multiple of mesh.data x mesh.fsdp = 8 (each "
        "microbatch is split over them)"]
    c.train.microbatch_rows = -1
    assert "must be an int >= 0" in batch_plan_errors(c)[0]
