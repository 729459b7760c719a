"""Teacher regularisation rules (METHOD.md 1.4): EMA, trust-region, frozen initial, live.

The teacher is the same decoder as the student with another parameter tree (or, for
trust-region, a lerp of two logit tensors). Which tree the train step keeps:

* ``"ema"``: a separate copy initialised from the initial params; after every optimizer update
  ``theta' <- (1 - rate) theta' + rate theta`` (verl ``_update_teacher``), computed in fp32 and
  stored in ``teacher.dtype``, in the optimizer's pass (:func:`pmd_jax.distill.optim.fused_update`).
* ``"frozen"``: a copy of the initial params, never updated.
* ``"trust_region"``: the kept copy is the frozen *initial* params (the reference); the teacher
  logits are ``lerp(logits_ref, logits_current, rate) = (1 - rate) logits_ref + rate
  logits_current``, both under the teacher prompt (``torch.lerp`` semantics, verl
  ``TrustRegionTeacher``). One extra forward of the frozen params, no extra trainable state.
* ``"live"``: ``stop_gradient`` of the current params; nothing is kept.

The teacher never receives gradients: every tree handed to a teacher forward goes through
``lax.stop_gradient`` here, and the teacher state is not an argument of the differentiated
function in the step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

TEACHER_RULES = ("ema", "trust_region", "frozen", "live")


def check_rule(rule: str) -> str:
    if rule not in TEACHER_RULES:
        raise ValueError(f"teacher.rule={rule!r} is not one of {TEACHER_RULES}")
    return rule


def check_rate(rate: float, rule: str) -> float:
    r = float(rate)
    if not 0.0 <= r <= 1.0 or r != r:
        raise ValueError(f"teacher.rate must be in [0, 1] for rule {rule!r}, got {rate}")
    return r


def keeps_copy(rule: str) -> bool:
    """Whether the rule keeps its own parameter tree in the train state."""
    return check_rule(rule) != "live"


def init_teacher(rule: str, params: Any, dtype: Any = jnp.float32) -> Any | None:
    """The teacher state for ``rule`` from the initial params (``None`` for ``"live"``).

    A fresh copy (never aliasing ``params``, so donating the params does not invalidate it).
    """
    if not keeps_copy(rule):
        return None
    return jax.tree.map(lambda p: jnp.array(p, dtype=dtype, copy=True), params)


def lerp_logits(ref_logits: jax.Array, cur_logits: jax.Array, rate: float) -> jax.Array:
    """``torch.lerp(ref, cur, rate) = ref + rate * (cur - ref)`` (trust-region teacher)."""
    if tuple(ref_logits.shape) != tuple(cur_logits.shape):
        raise ValueError(
            f"trust-region lerp: reference logits {tuple(ref_logits.shape)} and current logits "
            f"{tuple(cur_logits.shape)} differ in shape"
        )
    r = jnp.float32(rate)
    ref = ref_logits.astype(jnp.float32)
    return ref + r * (cur_logits.astype(jnp.float32) - ref)


def teacher_param_trees(rule: str, teacher: Any, params: Any) -> tuple[Any, ...]:
    """The (stop-gradient) parameter trees whose forwards make the teacher logits.

    One tree for ema / frozen / live; two for trust-region: ``(reference, current)`` whose
    logits are combined with :func:`lerp_logits`.
    """
    check_rule(rule)
    sg = lax.stop_gradient
    if rule == "live":
        return (sg(params),)
    if teacher is None:
        raise ValueError(f"teacher rule {rule!r} needs a teacher parameter tree, got None")
    if rule == "trust_region":
        return (sg(teacher), sg(params))
    return (sg(teacher),)
