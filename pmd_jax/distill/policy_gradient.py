"""GRPO and the GRPO + SDPO hybrid (METHOD.md 1.1, Table 13) as pure, jit-able functions.

Policy-gradient losses on the student's log-probs of the sampled tokens: group-relative
advantages (:func:`grpo_advantages`), verl's PPO clip (:func:`ppo_clip_per_token`), the
token-mean GRPO loss and the hybrid whose advantage mixes in the SDPO term. Shapes and
conventions as in :mod:`pmd_jax.distill.losses`.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax import lax

from pmd_jax.distill.losses import (
    LOG_RATIO_CLAMP,
    check_same_shape,
    masked_mean,
    static_float,
    token_mean,
)

Array = jax.Array


def grpo_advantages(rewards: Array, group_size: int) -> Array:
    """``r_i - mean(r)`` within each group of ``group_size`` consecutive samples (no std).

    ``rewards``: ``[N]`` with ``N`` a multiple of ``group_size`` (the sampler's layout:
    prompt-major, ``group_size`` rollouts per prompt). Returns ``[N]``.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [N], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise TypeError(f"group_size must be an int, got {group_size!r}")
    n = rewards.shape[0]
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of {group_size}")
    r = rewards.astype(jnp.float32).reshape(n // group_size, group_size)
    return (r - jnp.mean(r, axis=1, keepdims=True)).reshape(n)


def ppo_clip_per_token(
    token_logp: Array,
    old_token_logp: Array,
    advantages: Array,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_ratio_c: float | None = 3.0,
) -> tuple[Array, Array]:
    """verl's vanilla PPO per-token loss with asymmetric clipping (and dual-clip).

    ``ratio = exp(clip(logp - old, -20, 20))``;
    ``l = max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high))``; where ``A < 0`` and
    ``clip_ratio_c`` is set, ``l = min(l, -A clip_ratio_c)`` (verl default 3.0).
    ``advantages``: ``[B, T]`` or ``[B]`` (broadcast over tokens); detached.
    Returns ``(per_token_loss, clipped)`` where ``clipped`` is 1.0 where the clip was active.
    """
    check_same_shape(token_logp, old_token_logp, "token/old log-probs")
    lo = static_float(clip_low, "clip_low")
    hi = static_float(clip_high, "clip_high")
    if not (0.0 <= lo < 1.0 and hi >= 0.0):
        raise ValueError(f"bad PPO clip range: clip_low={lo}, clip_high={hi}")
    adv = lax.stop_gradient(advantages).astype(jnp.float32)
    if adv.ndim == 1:
        adv = adv[:, None]
    adv = jnp.broadcast_to(adv, token_logp.shape)
    d = jnp.clip(token_logp - lax.stop_gradient(old_token_logp), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(d)
    l1 = -adv * ratio
    l2 = -adv * jnp.clip(ratio, 1.0 - lo, 1.0 + hi)
    loss = jnp.maximum(l1, l2)
    clipped = (l2 > l1).astype(jnp.float32)
    if clip_ratio_c is not None:
        c = static_float(clip_ratio_c, "clip_ratio_c")
        if not c > 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {c}")
        loss = jnp.where(adv < 0, jnp.minimum(loss, -adv * c), loss)
    return loss, clipped


def grpo_loss(
    token_logp: Array,
    response_mask: Array,
    advantages: Array,
    *,
    old_token_logp: Array | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_ratio_c: float | None = 3.0,
    rollout_is_weights: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Token-mean PPO-clip loss over the response mask (METHOD.md Table 13 defaults).

    ``advantages``: ``[B]`` (GRPO, from :func:`grpo_advantages`) or ``[B, T]`` (hybrid).
    ``old_token_logp=None``: on-policy (ratio 1, the gradient is ``-A grad logp``).
    ``rollout_is_weights``: truncated IS weights (:func:`truncated_is_weights`), multiplied in.
    """
    check_same_shape(token_logp, response_mask, "token log-probs/response mask")
    old = lax.stop_gradient(token_logp) if old_token_logp is None else old_token_logp
    per_tok, clipped = ppo_clip_per_token(
        token_logp, old, advantages, clip_low, clip_high, clip_ratio_c
    )
    if rollout_is_weights is not None:
        check_same_shape(per_tok, rollout_is_weights, "per-token loss/rollout IS weights")
        per_tok = per_tok * lax.stop_gradient(rollout_is_weights)
    mask = response_mask.astype(jnp.float32)
    loss = token_mean(per_tok, mask)
    metrics = {
        "pg_loss": lax.stop_gradient(loss),
        "pg_clipfrac": masked_mean(clipped, mask),
    }
    return loss, metrics


def sdpo_token_advantages(student_token_logp: Array, teacher_token_logp: Array) -> Array:
    """``A_SDPO_t = log q_teacher(y_t) - log pi_student(y_t)`` on the sampled token (detached)."""
    check_same_shape(student_token_logp, teacher_token_logp, "student/teacher token log-probs")
    return lax.stop_gradient(teacher_token_logp - student_token_logp)


def hybrid_advantages(
    grpo_adv: Array,
    student_token_logp: Array,
    teacher_token_logp: Array,
    lam: float,
    sd_mask: Array | None = None,
) -> Array:
    """Eq. 3 (METHOD.md 1.1): ``A_t = lam * A_GRPO + (1 - lam) * A_SDPO_t`` per token ``[B, T]``.

    ``A_GRPO = r_i - mean_group(r)`` (``[B]``, broadcast over tokens) and
    ``A_SDPO_t = log q(y_t | x, f, y_<t) - log pi(y_t | x, y_<t)`` (detached). Where
    ``sd_mask[b] = 0`` (no reprompt: the teacher saw the plain prompt) the SDPO term is
    zeroed; this choice is ours, the paper is silent (METHOD.md 1.5 gives such samples no
    distillation signal).
    """
    lam_f = static_float(lam, "lam")
    if not 0.0 <= lam_f <= 1.0:
        raise ValueError(f"hybrid lambda must be in [0, 1], got {lam_f}")
    if grpo_adv.ndim != 1 or grpo_adv.shape[0] != student_token_logp.shape[0]:
        raise ValueError(
            f"GRPO advantages must be [B]={student_token_logp.shape[0]}, "
            f"got shape {tuple(grpo_adv.shape)}"
        )
    a_sd = sdpo_token_advantages(student_token_logp, teacher_token_logp)
    if sd_mask is not None:
        if tuple(sd_mask.shape) != (student_token_logp.shape[0],):
            raise ValueError(f"sd_mask must be [B], got shape {tuple(sd_mask.shape)}")
        a_sd = a_sd * sd_mask.astype(a_sd.dtype)[:, None]
    a_grpo = lax.stop_gradient(grpo_adv).astype(jnp.float32)[:, None]
    return lam_f * a_grpo + (1.0 - lam_f) * a_sd


def hybrid_loss(
    token_logp: Array,
    teacher_token_logp: Array,
    response_mask: Array,
    grpo_adv: Array,
    lam: float,
    *,
    sd_mask: Array | None = None,
    old_token_logp: Array | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_ratio_c: float | None = 3.0,
    rollout_is_weights: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """GRPO + SDPO hybrid (Eq. 3): the PPO-clip token-mean loss with the combined advantage.

    ``loss = sum_{b,t} m_bt * ppo(logp_bt, old_bt, A_bt) / max(sum m, 1)`` with
    ``A_bt = lam * (r_b - mean_group(r)) + (1 - lam) * sd_b * stopgrad(logq_T(y_bt) -
    logpi(y_bt))`` and ``m = response_mask``. On-policy (ratio 1, no clipping active) its
    gradient is exactly ``-sum m_bt A_bt grad logpi(y_bt) / sum m``: the policy gradient with
    the combined advantage. ``lam = 1`` is GRPO; ``lam = 0`` is the sampled-token SDPO
    surrogate (its gradient equals that of :func:`sampled_token_surrogate`).
    """
    check_same_shape(token_logp, teacher_token_logp, "student/teacher token log-probs")
    adv = hybrid_advantages(grpo_adv, token_logp, teacher_token_logp, lam, sd_mask)
    loss, metrics = grpo_loss(
        token_logp,
        response_mask,
        adv,
        old_token_logp=old_token_logp,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_ratio_c=clip_ratio_c,
        rollout_is_weights=rollout_is_weights,
    )
    metrics["hybrid_adv_mean"] = masked_mean(adv, response_mask.astype(jnp.float32))
    return loss, metrics
