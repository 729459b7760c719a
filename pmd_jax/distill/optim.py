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
from typing import Any

import jax.numpy as jnp
import optax


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


def learning_rate_at(cfg: OptimConfig, step: Any) -> Any:
    """The scheduled learning rate for optimizer step ``step`` (for metrics)."""
    return warmup_constant_schedule(cfg.lr, cfg.warmup_steps)(step)
