"""Self-distillation (SDPO) and GRPO losses as pure, jit-able functions.

Everything here follows METHOD.md sections 1.1-1.3, which mirror
``compute_self_distillation_loss`` of lasgroup/SDPO (verl ``core_algos.py``). Shapes:

* ``logits`` / log-probs: ``[..., V]`` (typically ``[B, T, V]``), the divergence is taken over
  the last axis and gives one value per token ``[...]``.
* per-token arrays (losses, sampled-token log-probs, masks): ``[B, T]``.
* per-sample arrays (self-distillation mask, rewards): ``[B]``.

Conventions (all from verl):

* log-probs are taken at the sampling temperature: ``log_softmax(logits / T)``;
* ``alpha = 0``: forward KL(teacher || student); ``alpha = 1``: reverse KL(student || teacher);
  otherwise the generalized JSD with mixture ``M = (1 - alpha) Ps + alpha Pt`` and
  ``loss = (1 - alpha) KL(Ps || M) + alpha KL(Pt || M)``;
* the teacher never receives gradients (``stop_gradient`` on every teacher input);
* ``alpha`` and the other configuration values are static Python numbers: the branch taken
  (forward KL, reverse KL, JSD) depends on them, so they are checked at trace time.

The memory-bounded path over hidden states lives in :mod:`pmd_jax.distill.chunked`; it calls
:func:`token_distill_stats` on sequence chunks and :func:`aggregate_distill_loss` on the result.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
# (x, k) -> int indices of the k largest entries of x's last axis (lax.top_k order)
TopKIndices = Callable[[Array, int], Array]

# log(1 - sum p) is computed from a log-sum clamped below 0 by this much (verl's constant).
TAIL_CLAMP = -1e-7
# log-ratios are clamped to this range before exp (verl's constant).
LOG_RATIO_CLAMP = 20.0


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def static_float(value: Any, name: str) -> float:
    """A concrete Python number, or a clear error (tracers and arrays are refused)."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a static Python number, got a traced value; pass it as a "
            "Python float (static), not as a jit argument"
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        try:
            value = float(value)  # numpy scalars / 0-d arrays
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    value = float(value)
    if value != value:  # NaN
        raise ValueError(f"{name} must not be NaN")
    return value


def check_alpha(alpha: Any) -> float:
    """Validate the divergence interpolation ``alpha`` (must lie in [0, 1])."""
    a = static_float(alpha, "alpha")
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {a}")
    return a


def _check_same_shape(a: Array, b: Array, what: str) -> None:
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"{what}: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")


def _check_tokens(logits: Array, tokens: Array, what: str = "tokens") -> None:
    if tuple(tokens.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{what} shape {tuple(tokens.shape)} must equal logits shape without the vocab axis "
            f"{tuple(logits.shape[:-1])}"
        )
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"{what} must be an integer array, got {tokens.dtype}")


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DistillLossConfig:
    """The self-distillation loss settings (verl ``SelfDistillationConfig`` names).

    ``alpha``: 0 forward KL, 1 reverse KL, else generalized JSD. ``full_logit_distillation``:
    divergence over the next-token distribution (else the sampled-token surrogate, alpha must
    be 1). ``topk``: ``None`` for the full vocabulary, else K indices from the student.
    ``add_tail``: append the tail bucket, else renormalise the top-K. ``temperature``: the
    sampling temperature. ``is_clip``: clip of the detached IS ratio, ``None`` disables it.
    Defaults are METHOD.md Table 12 (SciKnowEval column).
    """

    alpha: float = 0.5
    full_logit_distillation: bool = True
    topk: int | None = 100
    add_tail: bool = True
    temperature: float = 1.0
    is_clip: float | None = 2.0

    def validate(self, vocab_size: int | None = None) -> DistillLossConfig:
        check_alpha(self.alpha)
        if not self.full_logit_distillation and self.alpha != 1.0:
            raise ValueError(
                "the sampled-token surrogate (full_logit_distillation=False) supports only "
                f"reverse KL, alpha=1; got alpha={self.alpha}"
            )
        if self.topk is not None:
            if isinstance(self.topk, bool) or not isinstance(self.topk, numbers.Integral):
                raise TypeError(f"topk must be an int or None, got {self.topk!r}")
            if self.topk < 1:
                raise ValueError(f"topk must be >= 1, got {self.topk}")
            # top-K is unused by the sampled-token surrogate
            if self.full_logit_distillation and vocab_size is not None and self.topk > vocab_size:
                raise ValueError(f"topk={self.topk} is larger than the vocabulary ({vocab_size})")
        t = static_float(self.temperature, "temperature")
        if not t > 0.0:
            raise ValueError(f"temperature must be > 0, got {t}")
        if self.is_clip is not None and not static_float(self.is_clip, "is_clip") > 0.0:
            raise ValueError(f"is_clip must be > 0 or None, got {self.is_clip}")
        return self


# --------------------------------------------------------------------------------------------
# log-probs, top-K and tail
# --------------------------------------------------------------------------------------------


def log_probs(logits: Array, temperature: float = 1.0) -> Array:
    """fp32 log-softmax over the last axis at the sampling temperature (``logits / T``)."""
    t = static_float(temperature, "temperature")
    if not t > 0.0:
        raise ValueError(f"temperature must be > 0, got {t}")
    x = logits.astype(jnp.float32)
    if t != 1.0:
        x = x / t
    return jax.nn.log_softmax(x, axis=-1)


def token_log_probs(logp: Array, tokens: Array) -> Array:
    """``logp[..., tokens]``: the log-prob of each sampled token, shape ``tokens.shape``."""
    _check_tokens(logp, tokens)
    return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def add_tail(logp: Array) -> Array:
    """Append the tail bucket ``log(1 - sum exp(logp))`` as a (K+1)-th entry.

    Computed as ``log(-expm1(min(logsumexp(logp), -1e-7)))`` exactly like verl, so a top-K
    that holds (numerically) all the mass gives a finite tail of about log(1e-7).
    """
    log_s = jax.nn.logsumexp(logp, axis=-1, keepdims=True)
    log_s = jnp.minimum(log_s, TAIL_CLAMP)
    tail = jnp.log(-jnp.expm1(log_s))
    return jnp.concatenate([logp, tail], axis=-1)


def renormalize(logp: Array) -> Array:
    """Renormalise log-probs over the last axis (``logp - logsumexp(logp)``)."""
    return logp - jax.nn.logsumexp(logp, axis=-1, keepdims=True)


def topk_log_probs(
    student_logp: Array, teacher_logp: Array, k: int, topk_indices: TopKIndices | None = None
) -> tuple[Array, Array, Array]:
    """Student and teacher full-vocab log-probs at the student's top-K indices.

    Both inputs are already normalised over the full vocabulary (``log_probs``), so the
    gathered values keep the full-vocab logsumexp, as in verl. Returns
    ``(student_topk, teacher_topk, indices)``, each ``[..., K]``. ``topk_indices(x, k)``
    replaces ``lax.top_k(x, k)[1]`` (e.g. the vocab-sharded one of
    :mod:`pmd_jax.distill.sharded_topk`); it must return the same indices.
    """
    _check_same_shape(student_logp, teacher_logp, "student/teacher log-probs")
    vocab = student_logp.shape[-1]
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"topk must be an int, got {k!r}")
    if not 1 <= k <= vocab:
        raise ValueError(f"topk={k} must be in [1, vocab={vocab}]")
    # top_k is not differentiated through the indices; values are re-gathered so the
    # gradient flows through the student log-probs (incl. their logsumexp).
    if topk_indices is None:
        _, idx = lax.top_k(lax.stop_gradient(student_logp), int(k))
    else:
        idx = topk_indices(lax.stop_gradient(student_logp), int(k))
    s = jnp.take_along_axis(student_logp, idx, axis=-1)
    t = jnp.take_along_axis(teacher_logp, idx, axis=-1)
    return s, t, idx


def distill_buckets(
    student_logp: Array, teacher_logp: Array, topk: int | None, tail: bool,
    topk_indices: TopKIndices | None = None,
) -> tuple[Array, Array]:
    """The distributions the divergence is taken over: full vocab, or top-K (+ tail bucket)."""
    if topk is None:
        _check_same_shape(student_logp, teacher_logp, "student/teacher log-probs")
        return student_logp, teacher_logp
    s, t, _ = topk_log_probs(student_logp, teacher_logp, topk, topk_indices)
    if tail:
        return add_tail(s), add_tail(t)
    return renormalize(s), renormalize(t)


# --------------------------------------------------------------------------------------------
# divergences (per token, summed over the last axis)
# --------------------------------------------------------------------------------------------


def _kl(p_logp: Array, q_logp: Array) -> Array:
    """KL(P || Q) = sum_v P (log P - log Q) from log-probs (torch ``kl_div(q, p, log_target)``)."""
    return jnp.sum(jnp.exp(p_logp) * (p_logp - q_logp), axis=-1)


def reverse_kl(student_logp: Array, teacher_logp: Array) -> Array:
    """KL(student || teacher) per token (``alpha = 1``, the paper's Eq. 1)."""
    _check_same_shape(student_logp, teacher_logp, "student/teacher log-probs")
    return _kl(student_logp, teacher_logp)


def forward_kl(student_logp: Array, teacher_logp: Array) -> Array:
    """KL(teacher || student) per token (``alpha = 0``)."""
    _check_same_shape(student_logp, teacher_logp, "student/teacher log-probs")
    return _kl(teacher_logp, student_logp)


def generalized_jsd(student_logp: Array, teacher_logp: Array, alpha: float) -> Array:
    """``(1-alpha) KL(Ps || M) + alpha KL(Pt || M)`` with ``M = (1-alpha) Ps + alpha Pt``.

    ``log M = logsumexp(log Ps + log(1-alpha), log Pt + log(alpha))``. ``alpha`` must be
    strictly inside (0, 1) here (0 and 1 are the forward / reverse KL, see
    :func:`divergence`); ``alpha = 0.5`` is the standard JSD.
    """
    a = check_alpha(alpha)
    if a in (0.0, 1.0):
        raise ValueError(
            f"generalized_jsd needs alpha strictly in (0, 1), got {a}; use divergence() "
            "for the alpha=0 (forward KL) and alpha=1 (reverse KL) cases"
        )
    _check_same_shape(student_logp, teacher_logp, "student/teacher log-probs")
    log_m = jnp.logaddexp(student_logp + jnp.log1p(-a), teacher_logp + jnp.log(a))
    return (1.0 - a) * _kl(student_logp, log_m) + a * _kl(teacher_logp, log_m)


def divergence(student_logp: Array, teacher_logp: Array, alpha: float) -> Array:
    """verl's dispatch: alpha=0 forward KL, alpha=1 reverse KL, else generalized JSD."""
    a = check_alpha(alpha)
    if a == 0.0:
        return forward_kl(student_logp, teacher_logp)
    if a == 1.0:
        return reverse_kl(student_logp, teacher_logp)
    return generalized_jsd(student_logp, teacher_logp, a)


def sampled_token_surrogate(student_token_logp: Array, teacher_token_logp: Array) -> Array:
    """Token-level reverse-KL surrogate: ``stopgrad(logp_s(y) - logp_t(y)) * logp_s(y)``.

    Its gradient is ``-A_SDPO * grad logp_s(y)`` with ``A_SDPO = logp_t(y) - logp_s(y)``,
    the REINFORCE estimator of the reverse KL on the sampled token.
    """
    _check_same_shape(student_token_logp, teacher_token_logp, "student/teacher token log-probs")
    w = lax.stop_gradient(student_token_logp - teacher_token_logp)
    return w * student_token_logp


# --------------------------------------------------------------------------------------------
# per-token statistics from logits
# --------------------------------------------------------------------------------------------


def token_distill_stats(
    student_logits: Array, teacher_logits: Array, tokens: Array, cfg: DistillLossConfig,
    topk_indices: TopKIndices | None = None,
) -> dict[str, Array]:
    """Per-token self-distillation quantities from student/teacher logits ``[..., V]``.

    The teacher logits are stop-gradiented. Returns a dict of ``tokens.shape`` arrays:

    * ``loss``: the per-token divergence (or surrogate) before IS weights and masking;
    * ``student_logp`` / ``teacher_logp``: log-probs of the sampled tokens at the
      temperature (the student one carries gradients);
    * ``kl``: full-vocabulary reverse KL(student || teacher) (detached metric);
    * ``top1_agree``: 1.0 where the argmax of student and teacher coincide (detached);
    * ``entropy``: the student's entropy at the temperature (detached).
    """
    _check_same_shape(student_logits, teacher_logits, "student/teacher logits")
    _check_tokens(student_logits, tokens)
    cfg.validate(vocab_size=student_logits.shape[-1])
    s = log_probs(student_logits, cfg.temperature)
    t = lax.stop_gradient(log_probs(teacher_logits, cfg.temperature))
    s_tok = token_log_probs(s, tokens)
    t_tok = token_log_probs(t, tokens)
    if cfg.full_logit_distillation:
        sb, tb = distill_buckets(s, t, cfg.topk, cfg.add_tail, topk_indices)
        loss = divergence(sb, tb, cfg.alpha)
    else:
        loss = sampled_token_surrogate(s_tok, t_tok)
    s_d = lax.stop_gradient(s)
    return {
        "loss": loss,
        "student_logp": s_tok,
        "teacher_logp": t_tok,
        "kl": _kl(s_d, t),
        "top1_agree": (jnp.argmax(s_d, axis=-1) == jnp.argmax(t, axis=-1)).astype(jnp.float32),
        "entropy": -jnp.sum(jnp.exp(s_d) * s_d, axis=-1),
    }


# --------------------------------------------------------------------------------------------
# weights, masks and aggregation
# --------------------------------------------------------------------------------------------


def is_ratio(student_token_logp: Array, old_token_logp: Array, is_clip: float) -> Array:
    """Detached IS ratio ``min(exp(clip(logp - old_logp, -20, 20)), is_clip)``."""
    _check_same_shape(student_token_logp, old_token_logp, "student/old token log-probs")
    c = static_float(is_clip, "is_clip")
    if not c > 0.0:
        raise ValueError(f"is_clip must be > 0, got {c}")
    d = lax.stop_gradient(student_token_logp - old_token_logp)
    d = jnp.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.minimum(jnp.exp(d), c)


def truncated_is_weights(
    trainer_token_logp: Array,
    sampler_token_logp: Array,
    threshold: float = 2.0,
    mask: Array | None = None,
) -> Array:
    """Token-level truncated IS between trainer and sampler (vLLM) log-probs (verl
    ``rollout_is=token``): ``min(exp(clip(trainer - sampler, -20, 20)), threshold)``,
    detached, zero where ``mask`` is 0."""
    _check_same_shape(trainer_token_logp, sampler_token_logp, "trainer/sampler token log-probs")
    c = static_float(threshold, "threshold")
    if not c > 0.0:
        raise ValueError(f"IS threshold must be > 0, got {c}")
    d = lax.stop_gradient(trainer_token_logp - sampler_token_logp).astype(jnp.float32)
    w = jnp.minimum(jnp.exp(jnp.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), c)
    if mask is not None:
        _check_same_shape(w, mask, "IS weights/mask")
        w = w * mask.astype(w.dtype)
    return w


def make_loss_mask(response_mask: Array, sd_mask: Array | None = None) -> Array:
    """``response_mask * sd_mask[:, None]`` as float32 ``[B, T]``."""
    if response_mask.ndim != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {tuple(response_mask.shape)}")
    m = response_mask.astype(jnp.float32)
    if sd_mask is None:
        return m
    if tuple(sd_mask.shape) != (response_mask.shape[0],):
        raise ValueError(
            f"self-distillation mask must be [B]={response_mask.shape[0]}, "
            f"got shape {tuple(sd_mask.shape)}"
        )
    return m * sd_mask.astype(jnp.float32)[:, None]


def token_mean(per_token: Array, mask: Array) -> Array:
    """``sum(per_token * mask) / max(sum(mask), 1)``; an all-masked batch gives exactly 0.

    Masked entries are selected away (``where``) so a NaN/inf there cannot leak into the sum.
    """
    _check_same_shape(per_token, mask, "per-token values/mask")
    m = mask.astype(jnp.float32)
    x = jnp.where(m > 0, per_token.astype(jnp.float32), 0.0)
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def aggregate_distill_loss(
    per_token_loss: Array,
    student_token_logp: Array,
    response_mask: Array,
    sd_mask: Array | None = None,
    *,
    is_clip: float | None = 2.0,
    old_token_logp: Array | None = None,
    rollout_is_weights: Array | None = None,
) -> tuple[Array, Array]:
    """Apply the IS ratio, the rollout IS weights and token-mean over the loss mask.

    ``old_token_logp=None`` means on-policy (``old := stopgrad(logp)``, ratio 1), as verl does
    with one mini-batch per generation batch. Returns ``(loss, loss_mask)``.
    """
    _check_same_shape(per_token_loss, student_token_logp, "per-token loss/student log-probs")
    _check_same_shape(per_token_loss, response_mask, "per-token loss/response mask")
    loss_mask = make_loss_mask(response_mask, sd_mask)
    x = per_token_loss
    if is_clip is not None:
        old = lax.stop_gradient(student_token_logp) if old_token_logp is None else old_token_logp
        x = x * is_ratio(student_token_logp, old, is_clip)
    if rollout_is_weights is not None:
        _check_same_shape(per_token_loss, rollout_is_weights, "per-token loss/rollout IS weights")
        x = x * lax.stop_gradient(rollout_is_weights)
    return token_mean(x, loss_mask), loss_mask


def masked_mean(x: Array, mask: Array) -> Array:
    """Detached token-mean of a metric over a mask (0 when the mask is empty)."""
    return token_mean(lax.stop_gradient(x), mask)


def self_distillation_loss(
    student_logits: Array,
    teacher_logits: Array,
    tokens: Array,
    response_mask: Array,
    sd_mask: Array | None,
    cfg: DistillLossConfig,
    *,
    old_token_logp: Array | None = None,
    rollout_is_weights: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The full SDPO loss from aligned ``[B, T, V]`` logits (unchunked reference path).

    ``tokens[b, t]`` is response token t; ``student_logits[b, t]`` / ``teacher_logits[b, t]``
    are the logits that predict it (see :mod:`pmd_jax.distill.align`). For long sequences and
    large vocabularies use :func:`pmd_jax.distill.chunked.chunked_distill_loss`, which gives
    the same numbers without materialising the logits.
    """
    if student_logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(student_logits.shape)}")
    stats = token_distill_stats(student_logits, teacher_logits, tokens, cfg)
    return finalize_distill(
        stats,
        response_mask,
        sd_mask,
        cfg,
        old_token_logp=old_token_logp,
        rollout_is_weights=rollout_is_weights,
    )


def finalize_distill(
    stats: dict[str, Array],
    response_mask: Array,
    sd_mask: Array | None,
    cfg: DistillLossConfig,
    *,
    old_token_logp: Array | None = None,
    rollout_is_weights: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Loss and metrics from :func:`token_distill_stats` output (``[B, T]`` arrays)."""
    loss, loss_mask = aggregate_distill_loss(
        stats["loss"],
        stats["student_logp"],
        response_mask,
        sd_mask,
        is_clip=cfg.is_clip,
        old_token_logp=old_token_logp,
        rollout_is_weights=rollout_is_weights,
    )
    resp = response_mask.astype(jnp.float32)
    metrics = {
        "loss": lax.stop_gradient(loss),
        "kl": masked_mean(stats["kl"], loss_mask),
        "top1_agree": masked_mean(stats["top1_agree"], loss_mask),
        "entropy": masked_mean(stats["entropy"], resp),
        "num_loss_tokens": jnp.sum(loss_mask),
    }
    if sd_mask is not None:
        metrics["masked_sample_fraction"] = 1.0 - jnp.mean(sd_mask.astype(jnp.float32))
    if old_token_logp is not None:
        diff = lax.stop_gradient(stats["student_logp"]) - old_token_logp
        metrics["logp_abs_diff_old"] = masked_mean(jnp.abs(diff), resp)
    return loss, metrics


# --------------------------------------------------------------------------------------------
# GRPO and the GRPO + SDPO hybrid
# --------------------------------------------------------------------------------------------


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
    _check_same_shape(token_logp, old_token_logp, "token/old log-probs")
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
    _check_same_shape(token_logp, response_mask, "token log-probs/response mask")
    old = lax.stop_gradient(token_logp) if old_token_logp is None else old_token_logp
    per_tok, clipped = ppo_clip_per_token(
        token_logp, old, advantages, clip_low, clip_high, clip_ratio_c
    )
    if rollout_is_weights is not None:
        _check_same_shape(per_tok, rollout_is_weights, "per-token loss/rollout IS weights")
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
    _check_same_shape(student_token_logp, teacher_token_logp, "student/teacher token log-probs")
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
    _check_same_shape(token_logp, teacher_token_logp, "student/teacher token log-probs")
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
