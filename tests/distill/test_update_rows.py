"""Leaving rows without teacher signal out of the SDPO update (``update_rows.rows_for_update``).

Reference: the same train step on the full batch. Dropping rows whose self-distillation mask
is 0 must not change the loss, the gradient norm or the updated params (token mean over the
loss mask), including on an 8-device mesh, and a batch with no signal must update the
params exactly as the full batch does (Adam keeps moving on its moments).
"""

from __future__ import annotations

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pmd_jax.config import base_config  # noqa: E402
from pmd_jax.distill import align, update_rows  # noqa: E402
from pmd_jax.distill import step as st  # noqa: E402
from pmd_jax.distill.batch import make_batch  # noqa: E402
from pmd_jax.distill.config import default_distill_config, freeze_distill_config  # noqa: E402
from pmd_jax.models import decoder  # noqa: E402
from pmd_jax.run import sharding as shd  # noqa: E402
from tests.distill.test_step import TINY  # noqa: E402
from tests.host import need_devices  # noqa: E402

B = 8


def _dcfg():
    c = default_distill_config()
    c.teacher.rule = "frozen"
    c.loss.topk = 8
    c.loss.chunk_size = 5
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 0
    return freeze_distill_config(c)


def _run_cfg(mode="pmd", loss_name="sdpo"):
    c = base_config()
    c.mode = mode
    c.distill.loss.name = loss_name
    return c


def _batch(sd, seed=0):
    r = np.random.default_rng(seed)
    # row 0 is the longest everywhere, so dropping it lets every axis shrink
    sp = [r.integers(1, 48, 30 if i == 0 else r.integers(2, 6)) for i in range(B)]
    tp = [r.integers(1, 48, 40 if i == 0 else r.integers(3, 10)) for i in range(B)]
    rs = [r.integers(1, 48, 20 if i == 0 else r.integers(2, 7)) for i in range(B)]
    db = align.build_distill_batch(sp, tp, rs, pad_id=0, pad_side="right", pad_to_multiple=16)
    return make_batch(db, sd_mask=np.asarray(sd, np.float32),
                         sampler_logp=np.full(db.responses.shape, -3.0, np.float32),
                         rewards=r.random(B).astype(np.float32))


def _state(step_fn, seed=0):
    s = step_fn.init(decoder.init_params(TINY, jax.random.PRNGKey(seed)), 0)
    return s.replace(teacher=jax.tree.map(lambda t, p: jax.device_put(p, t.sharding),
                                          s.teacher, decoder.init_params(TINY,
                                                                         jax.random.PRNGKey(7))))


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_select_rows_trims_padding_and_keeps_alignment():
    batch = _batch(np.ones(B))
    out = update_rows.select_rows(batch, np.array([3, 5, 5]))
    assert out["sd_mask"].shape == (3,)
    assert out["student_tokens"].shape[1] < batch["student_tokens"].shape[1]
    assert out["teacher_tokens"].shape[1] < batch["teacher_tokens"].shape[1]
    assert out["responses"].shape[1] == 16 < batch["responses"].shape[1]
    for k in ("student_tokens", "teacher_tokens", "responses"):
        w = out[k].shape[1]
        np.testing.assert_array_equal(out[k], batch[k][[3, 5, 5], :w])
        assert not batch[k][[3, 5, 5], w:].any()  # only padding was cut
    for side in ("student", "teacher"):
        assert out[f"{side}_index"].max() + 1 < out[f"{side}_tokens"].shape[1]


@pytest.fixture(scope="module")
def step_fn():
    return st.TrainStep(TINY, _dcfg())


def test_dropping_unsignaled_rows_keeps_the_update(step_fn):
    sd = [0, 1, 0, 0, 1, 0, 1, 0]
    batch = _batch(sd)
    upd, stats = update_rows.rows_for_update(_run_cfg(), batch)
    assert stats["train_rows"] == 4.0
    assert upd["sd_mask"].tolist() == [1.0, 1.0, 1.0, 0.0]
    s_full, m_full = step_fn.step(_state(step_fn), batch)
    s_drop, m_drop = step_fn.step(_state(step_fn), upd)
    for k in ("loss", "grad_norm"):
        np.testing.assert_allclose(float(m_drop[k]), float(m_full[k]), rtol=2e-5, err_msg=k)
    assert float(m_full["loss"]) > 0
    # Adam's first step is about lr * g / |g| per element, so float32 noise in a near-zero
    # gradient entry shows up at up to lr (3e-3) in the params: compare at 1e-5 absolute.
    for a, b in zip(_leaves(s_drop.params), _leaves(s_full.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_no_signal_batch_updates_like_the_full_batch(step_fn):
    """Second step without signal: zero gradient, but Adam's moments still move the params
    (the first step has one signal row: a bucket of one row)."""
    first = _batch([1, 0, 0, 0, 0, 0, 0, 0], seed=1)
    upd1, st1 = update_rows.rows_for_update(_run_cfg(), first)
    assert st1["train_rows"] == 1.0 and upd1["sd_mask"].tolist() == [1.0]
    s0, m0 = step_fn.step(_state(step_fn), upd1)
    assert float(m0["loss"]) > 0
    empty = _batch(np.zeros(B), seed=2)
    upd, stats = update_rows.rows_for_update(_run_cfg(), empty)
    assert stats["train_rows"] == 1.0 and upd["sd_mask"].tolist() == [0.0]
    before = _leaves(s0.params)
    s_full, _ = step_fn.step(jax.tree.map(np.array, s0), empty)
    s_drop, _ = step_fn.step(jax.tree.map(np.array, s0), upd)
    moved = False
    for a, b, c in zip(_leaves(s_drop.params), _leaves(s_full.params), before):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        moved |= not np.allclose(a, c)
    assert moved


def test_mesh_buckets_are_multiples_of_the_batch_axes(step_fn):
    mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, devices=need_devices(8))
    sharded = st.TrainStep(TINY, _dcfg(), mesh=mesh, rules=shd.ShardingRules.from_mapping())
    assert sharded.batch_divisor() == 4
    sd = [0, 1, 0, 0, 0, 0, 0, 0]
    batch = _batch(sd)
    upd, stats = update_rows.rows_for_update(_run_cfg(), batch, sharded.batch_divisor())
    assert stats["train_rows"] == 4.0
    _, m_full = step_fn.step(_state(step_fn), batch)  # unsharded, full batch
    _, m_drop = sharded.step(_state(sharded), upd)
    np.testing.assert_allclose(float(m_drop["loss"]), float(m_full["loss"]), rtol=1e-4)
    np.testing.assert_allclose(float(m_drop["grad_norm"]), float(m_full["grad_norm"]),
                               rtol=1e-4)


@pytest.mark.parametrize("mode,loss_name,flag", [("grpo", "grpo", True),
                                                 ("pmd", "hybrid", True),
                                                 ("pmd", "sdpo", False)])
def test_batch_unchanged_when_rows_all_count(mode, loss_name, flag):
    cfg = _run_cfg(mode, loss_name)
    cfg.train.drop_unsignaled_rows = flag
    batch = _batch([0, 1, 0, 0, 0, 0, 0, 0])
    upd, stats = update_rows.rows_for_update(cfg, batch)
    assert upd is batch and stats["train_rows"] == B


# ------------------------------------------------------------ train.pad_lengths='max'


def _rows(seed=0, n=B):
    from pmd_jax.distill.assemble import TrainRows

    r = np.random.default_rng(seed)
    sp = [r.integers(1, 48, r.integers(3, 30)) for _ in range(n)]
    tp = [r.integers(1, 48, r.integers(4, 40)) for _ in range(n)]
    rs = [r.integers(1, 48, r.integers(2, 20)) for _ in range(n)]
    sp[0], tp[0], rs[0] = sp[0][:3], tp[0][:4], rs[0][:2]  # a short row: the trims show
    return TrainRows(students=sp, teachers=tp, responses=rs,
                     sampler_logp=[np.full(len(x), -3.0, np.float32) for x in rs],
                     sd_mask=np.asarray([0, 1, 0, 1, 1, 0, 1, 0], np.float32),
                     rewards=r.random(n).astype(np.float32))


def _max_cfg():
    c = _run_cfg()
    c.train.pad_lengths = "max"
    c.train.shared_prefix = "off"
    c.rollout.max_prompt_tokens = 40
    c.rollout.max_tokens = 20
    c.teacher_prompt.max_tokens = 50
    return c


def test_fixed_lengths_are_the_configured_maxima_and_every_step_has_them():
    from pmd_jax.distill.assemble import fixed_lengths, update_batch

    cfg = _max_cfg()
    assert fixed_lengths(cfg) == (48 + 32, 64 + 32, 32)  # each rounded up to 16
    assert fixed_lengths(_run_cfg()) is None  # 'multiple', the default
    shapes = set()
    for seed in range(4):  # other rows, other signal rows: the same shapes
        arrays = update_batch(cfg, _rows(seed), pad_id=0)
        for b in (arrays.full, arrays.update):
            shapes.add((b["student_tokens"].shape[1], b["teacher_tokens"].shape[1],
                        b["responses"].shape[1]))
        assert arrays.update["sd_mask"].shape[0] == 4  # the signal rows, bucketed
    assert shapes == {(80, 96, 32)}
    plain = update_batch(_run_cfg(), _rows(0), pad_id=0)
    assert plain.full["student_tokens"].shape[1] < 80  # each step's own longest rows
    # the fixed batch holds the same rows: its first columns are the plain batch, then padding
    fixed = update_batch(cfg, _rows(0), pad_id=0).full
    for k in ("student_tokens", "teacher_tokens", "responses", "response_mask",
              "student_attn_mask", "teacher_attn_mask"):
        w = plain.full[k].shape[1]
        np.testing.assert_array_equal(fixed[k][:, :w], plain.full[k], err_msg=k)
        assert not fixed[k][:, w:].any(), k
    for k in ("student_index", "teacher_index"):
        w = plain.full[k].shape[1]
        np.testing.assert_array_equal(fixed[k][:, :w], plain.full[k], err_msg=k)


def test_a_row_past_the_maxima_is_refused_naming_the_option():
    from pmd_jax.distill.assemble import update_batch

    rows = _rows(0)
    rows.teachers[2] = np.ones(100, np.int64)  # teacher rows hold 64 + 32 tokens
    with pytest.raises(ValueError, match="train.pad_lengths='max'.*longer than.*teacher"):
        update_batch(_max_cfg(), rows, pad_id=0)


def test_pad_lengths_max_trains_like_each_steps_own_lengths(step_fn):
    """The same rows padded to the maxima: the same loss, gradient norm and update (the
    padding is masked everywhere: attention, loss, metrics)."""
    from pmd_jax.distill.assemble import update_batch

    plain = update_batch(_run_cfg(), _rows(3), pad_id=0).update
    fixed = update_batch(_max_cfg(), _rows(3), pad_id=0).update
    assert fixed["teacher_tokens"].shape[1] > plain["teacher_tokens"].shape[1]
    s_a, m_a = step_fn.step(_state(step_fn), plain)
    s_b, m_b = step_fn.step(_state(step_fn), fixed)
    assert float(m_a["loss"]) > 0
    for k in ("loss", "grad_norm", "kl", "entropy"):
        if k in m_a:
            np.testing.assert_allclose(float(m_b[k]), float(m_a[k]), rtol=2e-5, err_msg=k)
    for a, b in zip(_leaves(s_b.params), _leaves(s_a.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_pad_lengths_bad_values_fail_validation():
    from pmd_jax.config import config_errors

    cfg = _max_cfg()
    assert not [e for e in config_errors(cfg) if "pad_lengths" in e]
    cfg.train.shared_prefix = "auto"
    assert any("train.pad_lengths='max' needs train.shared_prefix='off'" in e
               for e in config_errors(cfg))
    cfg.train.pad_lengths = "pow2"
    assert any("train.pad_lengths must be one of" in e for e in config_errors(cfg))
