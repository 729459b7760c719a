"""Teacher rules (METHOD.md 1.4): EMA / frozen / trust-region / live, and no teacher gradient.

References we did not write: numpy for the EMA formula, ``torch.lerp`` for the trust-region
interpolation, and for the gradients a separate path: full logits from the decoder, teacher
logits turned into numpy constants, gathered with numpy indexing, then the unchunked
``tests/reference_losses.self_distillation_loss``. The EMA update is the one of the optimizer's
fused pass (``optim.fused_update``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.distill import align, optim
from pmd_jax.distill import batch as dbatch
from pmd_jax.distill import loss_fn as lf
from pmd_jax.distill import teacher as tlib
from pmd_jax.distill.config import default_distill_config, freeze_distill_config
from pmd_jax.models import decoder
from tests.distill import reference_losses
from tests.fakes import tiny_model_config

TINY = tiny_model_config(num_kv_heads=1)


def _toy_tree(seed: int, dtype=np.float32) -> dict:
    r = np.random.default_rng(seed)
    return {"a": r.normal(size=(3, 4)).astype(dtype), "b": {"c": r.normal(size=(5,)).astype(dtype)}}


def _ema(teacher, params, rate):
    """The EMA teacher of the step's fused optimizer pass, params left where they are (lr 0,
    zero gradient): ``(1 - rate) * teacher + rate * params``."""
    cfg = optim.OptimConfig(lr=0.0, warmup_steps=0, weight_decay=0.0, grad_clip=None)
    zeros = jax.tree.map(jnp.zeros_like, params)
    upd = optim.fused_update(cfg, zeros, optim.make_optimizer(cfg).init(params), params,
                             ema_teacher=teacher, ema_rate=tlib.check_rate(rate, "ema"))
    for got, want in zip(jax.tree.leaves(upd.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    return upd.teacher


def test_ema_update_matches_numpy_formula():
    t0, p = _toy_tree(0), _toy_tree(1)
    teacher = tlib.init_teacher("ema", jax.tree.map(jnp.asarray, t0))
    rate = 0.05
    out = _ema(teacher, jax.tree.map(jnp.asarray, p), rate)
    for got, a, b in zip(jax.tree.leaves(out), jax.tree.leaves(t0), jax.tree.leaves(p)):
        np.testing.assert_allclose(np.asarray(got), (1 - rate) * a + rate * b, rtol=1e-6, atol=1e-7)
    # two steps compose: t2 = (1-a)^2 t0 + (1-(1-a)^2) p for a constant p
    out2 = _ema(out, jax.tree.map(jnp.asarray, p), rate)
    for got, a, b in zip(jax.tree.leaves(out2), jax.tree.leaves(t0), jax.tree.leaves(p)):
        k = (1 - rate) ** 2
        np.testing.assert_allclose(np.asarray(got), k * a + (1 - k) * b, rtol=1e-6, atol=1e-6)


def test_ema_bf16_teacher_accumulates_in_fp32():
    t0 = {"w": np.full((8,), 1.0, np.float32)}
    p = {"w": jnp.full((8,), 1.5, jnp.float32)}
    teacher = tlib.init_teacher("ema", t0, jnp.bfloat16)
    assert teacher["w"].dtype == jnp.bfloat16
    out = _ema(teacher, p, 0.5)
    assert out["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["w"], np.float32), 1.25)


@pytest.mark.parametrize("rule", ["frozen", "trust_region"])
def test_frozen_and_trust_region_keep_initial_params(rule):
    """Only the EMA rule's tree is updated by the step (the others are never passed to it)."""
    t0 = jax.tree.map(jnp.asarray, _toy_tree(0))
    teacher = tlib.init_teacher(rule, t0)
    for got, want in zip(jax.tree.leaves(teacher), jax.tree.leaves(t0)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    c = default_distill_config()
    c.teacher.rule = rule
    c.loss.topk = 8
    opts = lf.StepOptions.from_config(freeze_distill_config(c), TINY.vocab_size)
    assert opts.keeps_teacher and opts.rule != "ema"  # TrainStep._step keeps state.teacher


def test_init_teacher_is_a_copy_and_live_keeps_nothing():
    p = {"w": jnp.arange(4.0)}
    t = tlib.init_teacher("ema", p)
    assert t["w"] is not p["w"]
    assert tlib.init_teacher("live", p) is None
    assert len(tlib.teacher_param_trees("trust_region", t, p)) == 2
    assert len(tlib.teacher_param_trees("live", None, p)) == 1


def test_lerp_logits_matches_torch_lerp():
    torch = pytest.importorskip("torch")
    r = np.random.default_rng(0)
    ref, cur = r.normal(size=(2, 3, 7)).astype(np.float32), r.normal(size=(2, 3, 7)).astype(
        np.float32
    )
    for a in (0.0, 0.01, 0.5, 1.0):
        want = torch.lerp(torch.from_numpy(ref), torch.from_numpy(cur), a).numpy()
        np.testing.assert_allclose(np.asarray(tlib.lerp_logits(ref, cur, a)), want, atol=1e-6)
    with pytest.raises(ValueError, match="differ in shape"):
        tlib.lerp_logits(ref, cur[:, :2], 0.5)


def test_bad_rule_and_rate():
    with pytest.raises(ValueError, match="teacher.rule"):
        tlib.init_teacher("polyak", {"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"teacher.rate must be in \[0, 1\]"):
        tlib.check_rate(1.5, "ema")
    with pytest.raises(ValueError, match="needs a teacher parameter tree"):
        tlib.teacher_param_trees("ema", None, {"w": jnp.zeros(2)})


# --------------------------------------------------------------------------------------------
# gradients: the teacher is a constant
# --------------------------------------------------------------------------------------------


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    b = 4
    sp = [r.integers(1, TINY.vocab_size, r.integers(2, 6)) for _ in range(b)]
    tp = [r.integers(1, TINY.vocab_size, r.integers(3, 10)) for _ in range(b)]
    rs = [r.integers(1, TINY.vocab_size, r.integers(2, 7)) for _ in range(b)]
    db = align.build_distill_batch(sp, tp, rs, pad_id=0, pad_side="left")
    return dbatch.make_batch(db, sd_mask=np.array([1, 1, 0, 1], np.float32))


@functools.partial(jax.jit, static_argnums=2)  # one compile, not op-by-op dispatch
def _full_logits(params, batch, side):
    logits, _ = decoder.forward(
        params, jnp.asarray(batch[f"{side}_tokens"]), jnp.asarray(batch[f"{side}_positions"]),
        TINY, attn_mask=jnp.asarray(batch[f"{side}_attn_mask"]),
    )
    return logits


def _gather_np(x: np.ndarray, index: np.ndarray) -> np.ndarray:
    return np.stack([x[i, index[i]] for i in range(x.shape[0])])


@pytest.mark.parametrize("rule", ["live", "ema", "trust_region"])
def test_teacher_gets_no_gradient_and_grads_equal_constant_teacher(rule):
    c = default_distill_config()
    c.teacher.rule = rule
    c.teacher.rate = 0.3
    c.loss.topk = 8
    c.loss.chunk_size = 3
    c.precision.remat = False
    opts = lf.StepOptions.from_config(freeze_distill_config(c), TINY.vocab_size)
    loss_fn = lf.make_loss_fn(TINY, opts)
    params = decoder.init_params(TINY, jax.random.PRNGKey(0))
    params0 = decoder.init_params(TINY, jax.random.PRNGKey(1))  # a different "initial" model
    teacher = tlib.init_teacher(rule, params0)
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}

    if teacher is not None:
        (loss, _), (g_p, g_t) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1),
                                                            has_aux=True))(params, teacher, batch)
        for leaf in jax.tree.leaves(g_t):
            assert not np.any(np.asarray(leaf)), "teacher params received a gradient"
    else:
        (loss, _), g_p = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, {}, batch)

    # reference: teacher logits as numpy constants (no path back to params at all)
    t_idx, s_idx = np.asarray(batch["teacher_index"]), np.asarray(batch["student_index"])
    if rule == "live":
        t_logits = _gather_np(np.asarray(_full_logits(params, batch, "teacher")), t_idx)
    elif rule == "ema":
        t_logits = _gather_np(np.asarray(_full_logits(params0, batch, "teacher")), t_idx)
    else:
        torch = pytest.importorskip("torch")
        ref = _gather_np(np.asarray(_full_logits(params0, batch, "teacher")), t_idx)
        cur = _gather_np(np.asarray(_full_logits(params, batch, "teacher")), t_idx)
        t_logits = torch.lerp(torch.from_numpy(ref), torch.from_numpy(cur), 0.3).numpy()
    t_const = jnp.asarray(t_logits)

    def ref_loss(p):
        s_logits = align.gather_response(_full_logits(p, batch, "student"), jnp.asarray(s_idx))
        loss, _ = reference_losses.self_distillation_loss(
            s_logits, t_const, batch["responses"], batch["response_mask"], batch["sd_mask"],
            opts.loss,
        )
        return loss

    ref_l, ref_g = jax.jit(jax.value_and_grad(ref_loss))(params)
    np.testing.assert_allclose(float(loss), float(ref_l), rtol=1e-5, atol=1e-7)
    assert float(loss) > 0
    flat_g = jax.tree_util.tree_leaves_with_path(g_p)
    for (path, g), r in zip(flat_g, jax.tree.leaves(ref_g)):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(r), rtol=2e-4, atol=1e-7,
            err_msg=f"grad mismatch at {jax.tree_util.keystr(path)}",
        )
