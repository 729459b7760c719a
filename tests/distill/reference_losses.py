"""Reference implementations the tests compare the package against (test-only code).

* :func:`self_distillation_loss`: the SDPO loss from full ``[B, T, V]`` logits (the unchunked
  path, METHOD.md 1.2-1.3); the train step uses the chunked statistics instead.
* :func:`chunked_distill_loss`: the chunked statistics of :mod:`pmd_jax.distill.chunked`
  finalised into the loss, compared with the unchunked one.
* :func:`ema_update`: the EMA teacher update as a plain tree map, the reference for the fused
  optimizer pass (moved from ``pmd_jax.distill.teacher``, issue 16).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pmd_jax.distill import chunked, losses

Array = jax.Array


def self_distillation_loss(
    student_logits: Array,
    teacher_logits: Array,
    tokens: Array,
    response_mask: Array,
    sd_mask: Array | None,
    cfg: losses.DistillLossConfig,
    *,
    old_token_logp: Array | None = None,
    rollout_is_weights: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The full SDPO loss from aligned ``[B, T, V]`` logits (unchunked reference path).

    ``tokens[b, t]`` is response token t; ``student_logits[b, t]`` / ``teacher_logits[b, t]``
    are the logits that predict it (see :mod:`pmd_jax.distill.align`). For long sequences and
    large vocabularies use :func:`chunked_distill_loss`, which gives
    the same numbers without materialising the logits.
    """
    if student_logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(student_logits.shape)}")
    stats = losses.token_distill_stats(student_logits, teacher_logits, tokens, cfg)
    return losses.finalize_distill(
        stats,
        response_mask,
        sd_mask,
        cfg,
        old_token_logp=old_token_logp,
        rollout_is_weights=rollout_is_weights,
    )


def chunked_distill_loss(
    student_hidden: Array,
    teacher_hidden: Array,
    student_unembed: Array,
    teacher_unembed: Array,
    tokens: Array,
    response_mask: Array,
    sd_mask: Array | None,
    cfg: losses.DistillLossConfig,
    *,
    chunk: int = chunked.DEFAULT_CHUNK,
    old_token_logp: Array | None = None,
    rollout_is_weights: Array | None = None,
    ref_teacher_hidden: Array | None = None,
    ref_teacher_unembed: Array | None = None,
    trust_region_alpha: float | None = None,
    vocab_major: bool = False,
    remat: bool = True,
    topk_indices: losses.TopKIndices | None = None,
    matmul_dtype: str | None = None,
) -> tuple[Array, dict[str, Array], dict[str, Array]]:
    """The SDPO loss from aligned hidden states: ``(loss, metrics, per_token_stats)``.

    Equal to :func:`self_distillation_loss` on the full logits
    ``hidden @ unembed`` (tested), without materialising them.
    """
    stats = chunked.chunked_distill_stats(
        student_hidden,
        teacher_hidden,
        student_unembed,
        teacher_unembed,
        tokens,
        cfg,
        chunk=chunk,
        ref_teacher_hidden=ref_teacher_hidden,
        ref_teacher_unembed=ref_teacher_unembed,
        trust_region_alpha=trust_region_alpha,
        vocab_major=vocab_major,
        remat=remat,
        topk_indices=topk_indices,
        matmul_dtype=matmul_dtype,
    )
    loss, metrics = losses.finalize_distill(
        stats,
        response_mask,
        sd_mask,
        cfg,
        old_token_logp=old_token_logp,
        rollout_is_weights=rollout_is_weights,
    )
    return loss, metrics, stats


def ema_update(teacher: Any, params: Any, rate: float) -> Any:
    """``(1 - rate) * teacher + rate * params`` leaf by leaf in fp32, cast to the teacher dtype
    (the EMA teacher that :func:`pmd_jax.distill.optim.fused_update` computes in its pass)."""
    a = jnp.float32(rate)

    def upd(t: jax.Array, p: jax.Array) -> jax.Array:
        t32 = t.astype(jnp.float32)
        return (t32 + a * (p.astype(jnp.float32) - t32)).astype(t.dtype)

    return jax.tree.map(upd, teacher, params)
