"""The fused clip + AdamW + EMA update: equal to the optax chain it replaces, and to torch.

References: ``optax.chain(clip_by_global_norm, adamw)`` + ``optax.apply_updates`` +
``reference_losses.ema_update`` (bitwise: same expressions on the same state pytree), and
``torch.nn.utils.clip_grad_norm_`` + ``torch.optim.AdamW`` with the warmup-constant LambdaLR +
``Tensor.lerp_`` for the EMA teacher (to float32 rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pmd_jax.distill import optim
from tests.distill import reference_losses

SHAPES = {"a": (5, 7), "b": {"c": (3, 4, 2), "d": (11,)}}


def _tree(seed: int, scale: float = 1.0):
    r = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(r.standard_normal(s) * scale, jnp.float32),
                        SHAPES, is_leaf=lambda x: isinstance(x, tuple))


def _reference(cfg, opt, grads, opt_state, params, teacher, rate, loss):
    updates, new_opt = opt.update(grads, opt_state, params)
    new_p = optax.apply_updates(params, updates)
    new_t = reference_losses.ema_update(teacher, new_p, rate)
    finite = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
    keep = lambda n, o: jax.tree.map(lambda a, b: jnp.where(finite, a, b), n, o)  # noqa: E731
    return keep(new_p, params), keep(new_opt, opt_state), keep(new_t, teacher)


@pytest.mark.parametrize("grad_clip,grad_scale", [(1.0, 1.0), (1.0, 1e-3), (None, 1.0)])
def test_fused_update_equals_optax_chain_bitwise(grad_clip, grad_scale):
    cfg = optim.OptimConfig(lr=3e-3, warmup_steps=2, weight_decay=0.01, grad_clip=grad_clip)
    opt = optim.make_optimizer(cfg)
    params, teacher = _tree(0), _tree(1)
    opt_state = opt.init(params)
    ref = (params, opt_state, teacher)
    ours = (params, opt_state, teacher)
    fused = jax.jit(lambda g, o, p, t: optim.fused_update(
        cfg, g, o, p, loss=jnp.float32(1.0), ema_teacher=t, ema_rate=0.05))
    for step in range(4):
        grads = _tree(10 + step, grad_scale)
        ref = jax.jit(lambda g, o, p, t: _reference(cfg, opt, g, o, p, t, 0.05, 1.0))(
            grads, ref[1], ref[0], ref[2])
        u = fused(grads, ours[1], ours[0], ours[2])
        ours = (u.params, u.opt_state, u.teacher)
        assert bool(u.finite)
        np.testing.assert_allclose(float(u.grad_norm), float(optax.tree.norm(grads)), rtol=1e-6)
        assert jax.tree.structure(ours) == jax.tree.structure(ref)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the clip triggered (or not) as intended, and the params moved
    assert (float(optax.tree.norm(_tree(10, grad_scale))) > 1.0) == (grad_scale == 1.0)
    assert not np.array_equal(np.asarray(ours[0]["a"]), np.asarray(params["a"]))


def test_fused_update_matches_torch_adamw_clip_and_lerp():
    torch = pytest.importorskip("torch")
    cfg = optim.OptimConfig(lr=1e-2, warmup_steps=3, weight_decay=0.1, grad_clip=1.0)
    rate = 0.05
    params, teacher = _tree(0), _tree(1)
    leaves, treedef = jax.tree.flatten(params)
    tp = [torch.tensor(np.asarray(x), requires_grad=True) for x in leaves]
    tt = [torch.tensor(np.asarray(x)) for x in jax.tree.leaves(teacher)]
    topt = torch.optim.AdamW(tp, lr=cfg.lr, betas=(cfg.b1, cfg.b2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        topt, lambda s: min(1.0, s / cfg.warmup_steps))
    opt_state = optim.make_optimizer(cfg).init(params)
    fused = jax.jit(lambda g, o, p, t: optim.fused_update(
        cfg, g, o, p, loss=jnp.float32(0.5), ema_teacher=t, ema_rate=rate))
    for step in range(6):
        grads = _tree(20 + step, 0.3 if step % 2 else 3.0)  # clipped on even steps
        for p, g in zip(tp, jax.tree.leaves(grads)):
            p.grad = torch.tensor(np.asarray(g))
        torch.nn.utils.clip_grad_norm_(tp, cfg.grad_clip)
        topt.step()
        sched.step()
        with torch.no_grad():
            for t, p in zip(tt, tp):
                t.lerp_(p, rate)
        u = fused(grads, opt_state, params, teacher)
        params, opt_state, teacher = u.params, u.opt_state, u.teacher
        for ours, theirs in ((params, tp), (teacher, tt)):
            for a, b in zip(jax.tree.leaves(ours), theirs):
                np.testing.assert_allclose(np.asarray(a), b.detach().numpy(),
                                           rtol=2e-5, atol=2e-6)
    assert treedef == jax.tree.structure(params)


@pytest.mark.parametrize("bad", ["grad", "loss"])
def test_nonfinite_leaves_state_bitwise_unchanged(bad):
    cfg = optim.OptimConfig(warmup_steps=0)
    opt = optim.make_optimizer(cfg)
    params, teacher = _tree(0), _tree(1)
    opt_state = opt.update(_tree(2), opt.init(params), params)[1]  # non-zero moments, count 1
    grads = _tree(3)
    loss = jnp.float32(1.0)
    if bad == "grad":
        grads["b"]["d"] = grads["b"]["d"].at[3].set(jnp.nan)
    else:
        loss = jnp.float32(jnp.inf)
    u = jax.jit(lambda g, o, p, t, lo: optim.fused_update(
        cfg, g, o, p, loss=lo, ema_teacher=t, ema_rate=0.05))(grads, opt_state, params,
                                                             teacher, loss)
    assert not bool(u.finite)
    for a, b in zip(jax.tree.leaves((u.params, u.opt_state, u.teacher)),
                    jax.tree.leaves((params, opt_state, teacher))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # without the skip the NaN propagates (the flag is what protects the state)
    u2 = optim.fused_update(cfg, grads, opt_state, params, loss=loss, skip_nonfinite=False)
    if bad == "grad":
        assert not np.isfinite(np.asarray(u2.params["b"]["d"])).all()


def test_fused_update_rejects_foreign_state():
    cfg = optim.OptimConfig()
    params = _tree(0)
    with pytest.raises(ValueError, match="not the state of make_optimizer"):
        optim.fused_update(cfg, params, optax.adam(1e-3).init(params), params)
