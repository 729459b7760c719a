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
:func:`token_distill_stats` on sequence chunks and :func:`finalize_distill` on the result. The
GRPO and hybrid policy-gradient losses are in :mod:`pmd_jax.distill.policy_gradient`; the
unchunked reference ``self_distillation_loss`` is in ``tests/distill/reference_losses.py``.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pmd_jax.distill import topk as topk_lib

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


def check_same_shape(a: Array, b: Array, what: str) -> None:
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
    ``top_k_impl``: how the student's top-K is taken (:mod:`pmd_jax.distill.topk`; every one
    gives ``lax.top_k``'s values and indices). Defaults are METHOD.md Table 12 (SciKnowEval
    column).
    """

    alpha: float = 0.5
    full_logit_distillation: bool = True
    topk: int | None = 100
    add_tail: bool = True
    temperature: float = 1.0
    is_clip: float | None = 2.0
    top_k_impl: str = "auto"

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
        topk_lib.check_impl(self.top_k_impl)
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
    check_same_shape(student_logp, teacher_logp, "student/teacher log-probs")
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
    sb, tb, _ = _buckets(student_logp, teacher_logp, topk, tail, topk_indices)
    return sb, tb


def _buckets(
    student_logp: Array, teacher_logp: Array, topk: int | None, tail: bool,
    topk_indices: TopKIndices | None,
) -> tuple[Array, Array, Array | None]:
    """:func:`distill_buckets` and the top-K indices (None over the full vocabulary)."""
    if topk is None:
        check_same_shape(student_logp, teacher_logp, "student/teacher log-probs")
        return student_logp, teacher_logp, None
    s, t, idx = topk_log_probs(student_logp, teacher_logp, topk, topk_indices)
    if tail:
        return add_tail(s), add_tail(t), idx
    return renormalize(s), renormalize(t), idx


# --------------------------------------------------------------------------------------------
# divergences (per token, summed over the last axis)
# --------------------------------------------------------------------------------------------


def _kl(p_logp: Array, q_logp: Array) -> Array:
    """KL(P || Q) = sum_v P (log P - log Q) from log-probs (torch ``kl_div(q, p, log_target)``)."""
    return jnp.sum(jnp.exp(p_logp) * (p_logp - q_logp), axis=-1)


def reverse_kl(student_logp: Array, teacher_logp: Array) -> Array:
    """KL(student || teacher) per token (``alpha = 1``, the paper's Eq. 1)."""
    check_same_shape(student_logp, teacher_logp, "student/teacher log-probs")
    return _kl(student_logp, teacher_logp)


def forward_kl(student_logp: Array, teacher_logp: Array) -> Array:
    """KL(teacher || student) per token (``alpha = 0``)."""
    check_same_shape(student_logp, teacher_logp, "student/teacher log-probs")
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
    check_same_shape(student_logp, teacher_logp, "student/teacher log-probs")
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
    check_same_shape(student_token_logp, teacher_token_logp, "student/teacher token log-probs")
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

    The student's top-K (``topk_indices``, default :func:`pmd_jax.distill.topk.top_k` with
    ``cfg.top_k_impl``) also gives its argmax on GPU (its first index, :func:`student_argmax`).
    """
    check_same_shape(student_logits, teacher_logits, "student/teacher logits")
    _check_tokens(student_logits, tokens)
    cfg.validate(vocab_size=student_logits.shape[-1])
    s = log_probs(student_logits, cfg.temperature)
    t = lax.stop_gradient(log_probs(teacher_logits, cfg.temperature))
    s_tok = token_log_probs(s, tokens)
    t_tok = token_log_probs(t, tokens)
    idx = None
    if cfg.full_logit_distillation:
        if topk_indices is None:
            topk_indices = topk_lib.topk_indices_fn(cfg.top_k_impl)
        sb, tb, idx = _buckets(s, t, cfg.topk, cfg.add_tail, topk_indices)
        loss = divergence(sb, tb, cfg.alpha)
    else:
        loss = sampled_token_surrogate(s_tok, t_tok)
    return {
        "loss": loss,
        "student_logp": s_tok,
        "teacher_logp": t_tok,
        **token_metrics(s, t, None if idx is None else student_argmax(s, idx)),
    }


def student_argmax(student_logp: Array, topk_idx: Array) -> Array:
    """The student's argmax given its top-K indices ``[..., K]``: their first index in a
    program lowered for a GPU (one reduction over the vocabulary fewer), ``argmax`` elsewhere.

    Not the first index on CPU: XLA:CPU runs ``lax.top_k`` as its TopK kernel only while the
    indices have no reader but the gather; a slice ``[..., 0]`` of them turns the top-K back
    into a stable sort of every whole row (measured: 2.26 s against 0.13 s at [4, 96, 49152],
    and 38.0 against 23.8 s for the CPU train step of ``bench_train_step.py --batch 4
    --student-len 512 --teacher-len 768 --response-len 384 --remat full``). Equal on rows
    without NaN (ties: the lowest index in both).
    """
    def first(i: Array, v: Array) -> Array:
        return i[..., 0]

    def arg(i: Array, v: Array) -> Array:
        return jnp.argmax(v, axis=-1).astype(i.dtype)

    return lax.platform_dependent(topk_idx, lax.stop_gradient(student_logp), cuda=first,
                                  rocm=first, default=arg)


def token_metrics(student_logp: Array, teacher_logp: Array,
                  student_top1: Array | None = None) -> dict[str, Array]:
    """Detached per-token ``kl`` (reverse, full vocabulary), ``top1_agree`` and ``entropy``
    from the two log-prob arrays ``[..., V]``.

    ``student_top1``: the student's argmax when it is known already (:func:`student_argmax`,
    the first index of its top-K on GPU; equal to ``argmax`` on rows without NaN), else it is
    taken here. The sums and the
    teacher's argmax are plain reductions over the same two arrays: XLA:GPU fuses them into
    one multi-output reduction that reads each array once (compiled for an H100 target, the
    chunk's forward and backward at [16, 96, 128256]: the same reads of the [B, C, V] arrays
    as an explicit variadic ``lax.reduce``, which XLA:CPU would sum less accurately).
    """
    s_d = lax.stop_gradient(student_logp)
    t = lax.stop_gradient(teacher_logp)
    s_top = jnp.argmax(s_d, axis=-1) if student_top1 is None else student_top1
    return {
        "kl": _kl(s_d, t),
        "top1_agree": (s_top == jnp.argmax(t, axis=-1)).astype(jnp.float32),
        "entropy": -jnp.sum(jnp.exp(s_d) * s_d, axis=-1),
    }


# --------------------------------------------------------------------------------------------
# weights, masks and aggregation
# --------------------------------------------------------------------------------------------


def is_ratio(student_token_logp: Array, old_token_logp: Array, is_clip: float) -> Array:
    """Detached IS ratio ``min(exp(clip(logp - old_logp, -20, 20)), is_clip)``."""
    check_same_shape(student_token_logp, old_token_logp, "student/old token log-probs")
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
    check_same_shape(trainer_token_logp, sampler_token_logp, "trainer/sampler token log-probs")
    c = static_float(threshold, "threshold")
    if not c > 0.0:
        raise ValueError(f"IS threshold must be > 0, got {c}")
    d = lax.stop_gradient(trainer_token_logp - sampler_token_logp).astype(jnp.float32)
    w = jnp.minimum(jnp.exp(jnp.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), c)
    if mask is not None:
        check_same_shape(w, mask, "IS weights/mask")
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
    check_same_shape(per_token, mask, "per-token values/mask")
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
    check_same_shape(per_token_loss, student_token_logp, "per-token loss/student log-probs")
    check_same_shape(per_token_loss, response_mask, "per-token loss/response mask")
    loss_mask = make_loss_mask(response_mask, sd_mask)
    x = per_token_loss
    if is_clip is not None:
        old = lax.stop_gradient(student_token_logp) if old_token_logp is None else old_token_logp
        x = x * is_ratio(student_token_logp, old, is_clip)
    if rollout_is_weights is not None:
        check_same_shape(per_token_loss, rollout_is_weights, "per-token loss/rollout IS weights")
        x = x * lax.stop_gradient(rollout_is_weights)
    return token_mean(x, loss_mask), loss_mask


def masked_mean(x: Array, mask: Array) -> Array:
    """Detached token-mean of a metric over a mask (0 when the mask is empty)."""
    return token_mean(lax.stop_gradient(x), mask)


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
