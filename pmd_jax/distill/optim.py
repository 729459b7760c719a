"""The optimizer: optax AdamW with linear warmup to a constant learning rate, global-norm clip.

Defaults are METHOD.md Table 12 (SciKnowEval column): lr 1e-5 constant after 10 warmup steps,
weight decay 0.01, gradient clipping at global norm 1.0, Adam betas (0.9, 0.999) (verl's
defaults, which are torch's).

The schedule is HF/verl ``get_constant_schedule_with_warmup``: the multiplier at optimizer step
``s`` (0-based, the number of updates already applied) is ``min(1, s / warmup)``, so the very
first update uses lr 0 when ``warmup > 0``. Weight decay is decoupled and scaled by the
scheduled lr, as in ``torch.optim.AdamW``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5
    warmup_steps: int = 10
    weight_decay: float = 0.01
    grad_clip: float | None = 1.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def validate(self) -> OptimConfig:
        for name in ("lr", "weight_decay", "b1", "b2", "eps"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"optim.{name} must be a finite number, got {v!r}")
        if self.lr < 0:
            raise ValueError(f"optim.lr must be >= 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if not (0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0):
            raise ValueError(f"optim betas must be in [0, 1), got ({self.b1}, {self.b2})")
        if self.eps <= 0:
            raise ValueError(f"optim.eps must be > 0, got {self.eps}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int):
            raise ValueError(f"optim.warmup_steps must be an int, got {self.warmup_steps!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"optim.grad_clip must be > 0 or None, got {self.grad_clip}")
        return self

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> OptimConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(m) - names
        if unknown:
            raise ValueError(f"unknown optim settings {sorted(unknown)}; known: {sorted(names)}")
        kw = dict(m)
        if kw.get("grad_clip") is not None and kw["grad_clip"] <= 0:
            kw["grad_clip"] = None  # 0 / negative in a config file means "no clipping"
        return cls(**kw).validate()


def warmup_constant_schedule(lr: float, warmup_steps: int) -> optax.Schedule:
    """``lr * min(1, step / warmup_steps)`` (``lr`` from the start when ``warmup_steps=0``)."""
    if warmup_steps <= 0:
        return optax.constant_schedule(lr)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup_steps), optax.constant_schedule(lr)],
        boundaries=[warmup_steps],
    )


def make_optimizer(cfg: OptimConfig | None = None) -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip)`` then AdamW with the warmup + constant schedule.

    Optimizer moments are kept in the dtype of the parameters they are initialised on; the
    train step initialises them on fp32 master weights (see :mod:`pmd_jax.distill.step`).
    """
    cfg = (cfg or OptimConfig()).validate()
    sched = warmup_constant_schedule(cfg.lr, cfg.warmup_steps)
    parts: list[optax.GradientTransformation] = []
    if cfg.grad_clip is not None:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(
        optax.adamw(
            learning_rate=sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
            weight_decay=cfg.weight_decay, mu_dtype=jnp.float32,
        )
    )
    return optax.chain(*parts)


class FusedUpdate(NamedTuple):
    params: Any
    opt_state: Any
    teacher: Any
    grad_norm: jax.Array  # global L2 norm of the gradient, before clipping
    finite: jax.Array  # bool scalar: loss and gradient norm finite (update applied)
    # The clipped gradient the moments read. Nothing needs it after the update; a program
    # that was handed the gradient donated returns it so that XLA writes it over the
    # gradient's buffer instead of a temporary (TrainStep.apply_gradients).
    clipped_grads: Any = None


def _adam_states(cfg: OptimConfig, opt_state: Any) -> tuple[Any, Any]:
    """``(ScaleByAdamState, ScaleByScheduleState)`` of a :func:`make_optimizer` state."""
    adamw = opt_state[-1]
    if (len(opt_state) != (2 if cfg.grad_clip is not None else 1) or len(adamw) != 3
            or not isinstance(adamw[0], optax.ScaleByAdamState)
            or not isinstance(adamw[2], optax.ScaleByScheduleState)):
        raise ValueError("opt_state is not the state of make_optimizer(cfg) "
                         f"(grad_clip={cfg.grad_clip}): {jax.tree.structure(opt_state)}")
    return adamw[0], adamw[2]


def fused_update(
    cfg: OptimConfig,
    grads: Any,
    opt_state: Any,
    params: Any,
    *,
    loss: jax.Array | None = None,
    skip_nonfinite: bool = True,
    ema_teacher: Any = None,
    ema_rate: float | None = None,
) -> FusedUpdate:
    """Clip + AdamW (+ EMA teacher) + non-finite skip in one pass over each parameter.

    The same numbers as ``make_optimizer(cfg).update`` then ``optax.apply_updates`` (same
    expressions in the same order, on the same optimizer-state pytree) followed by
    the EMA teacher update of the new params (``tests/reference_losses.ema_update``), and, with
    ``skip_nonfinite``, ``where(finite, new, old)`` on every leaf. The difference is the
    memory traffic on XLA:CPU: the optax chain is a sequence of tree maps whose elementwise
    producers XLA duplicates into each output's fusion (the new mu / nu / params / teacher
    each recompute the moments from the *old* buffers), so the donated state buffers cannot
    be updated in place and XLA copies params, mu and nu first (~1.6 GB of extra traffic per
    step at 135M parameters), and the gradient norm was reduced twice. Here the gradient
    norm is reduced once, the new moments and the new params are materialised
    (``optimization_barrier``) before their consumers, so each stage reads only buffers it
    does not overwrite and every donated buffer is updated in place.
    """
    cfg = cfg.validate()
    adam, sched = _adam_states(cfg, opt_state)
    g_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(g_norm)
    if loss is not None:
        finite = finite & jnp.isfinite(loss)

    def keep(new: jax.Array, old: jax.Array) -> jax.Array:
        return jnp.where(finite, new, old) if skip_nonfinite else new

    if cfg.grad_clip is not None:
        max_norm = cfg.grad_clip
        trigger = jnp.squeeze(g_norm < max_norm)

        def clip(g: jax.Array) -> jax.Array:
            return lax.select(trigger, g, (g / g_norm.astype(g.dtype)) * max_norm)
    else:
        def clip(g: jax.Array) -> jax.Array:
            return g

    b1, b2, eps, wd = cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay
    count_inc = optax.safe_increment(adam.count)
    bc1 = 1 - b1**count_inc
    bc2 = 1 - b2**count_inc
    step_size = -1 * warmup_constant_schedule(cfg.lr, cfg.warmup_steps)(sched.count)

    # stage 1: the new moments (in place over the old ones)
    clipped = jax.tree.map(clip, grads)

    def moments(g: jax.Array, mu: jax.Array, nu: jax.Array) -> tuple[jax.Array, jax.Array]:
        mu1 = (1 - b1) * (g**1) + b1 * mu
        nu1 = (1 - b2) * (g**2) + b2 * nu
        return keep(mu1.astype(mu.dtype), mu), keep(nu1.astype(nu.dtype), nu)

    mn = jax.tree.map(moments, clipped, adam.mu, adam.nu)
    mu_new = jax.tree.map(lambda _, x: x[0], adam.mu, mn)
    nu_new = jax.tree.map(lambda _, x: x[1], adam.nu, mn)
    mu_new, nu_new = lax.optimization_barrier((mu_new, nu_new))

    # stage 2: the new params from the materialised moments (in place over the old params)
    def param(p: jax.Array, mu: jax.Array, nu: jax.Array) -> jax.Array:
        mu_hat = mu / bc1.astype(mu.dtype)
        nu_hat = nu / bc2.astype(nu.dtype)
        u = mu_hat / (jnp.sqrt(nu_hat + 0.0) + eps)
        if wd != 0.0:
            u = u + wd * p
        u = jnp.array(step_size, dtype=u.dtype) * u
        return keep(jnp.asarray(p + u).astype(p.dtype), p)

    new_params = jax.tree.map(param, params, mu_new, nu_new)

    # stage 3: the EMA teacher from the materialised new params
    teacher = ema_teacher
    if ema_teacher is not None:
        if ema_rate is None:
            raise ValueError("ema_teacher needs ema_rate")
        new_params = lax.optimization_barrier(new_params)
        a = jnp.float32(ema_rate)

        def ema(t: jax.Array, p: jax.Array) -> jax.Array:
            t32 = t.astype(jnp.float32)
            return keep((t32 + a * (p.astype(jnp.float32) - t32)).astype(t.dtype), t)

        teacher = jax.tree.map(ema, ema_teacher, new_params)

    adam_new = optax.ScaleByAdamState(count=keep(count_inc, adam.count), mu=mu_new, nu=nu_new)
    sched_new = optax.ScaleByScheduleState(
        count=keep(optax.safe_increment(sched.count), sched.count))
    adamw_new = (adam_new, opt_state[-1][1], sched_new)
    new_opt = (opt_state[0], adamw_new) if len(opt_state) == 2 else (adamw_new,)
    return FusedUpdate(new_params, new_opt, teacher, g_norm, finite, clipped)


def learning_rate_at(cfg: OptimConfig, step: Any) -> Any:
    """The scheduled learning rate for optimizer step ``step`` (for metrics)."""
    return warmup_constant_schedule(cfg.lr, cfg.warmup_steps)(step)
