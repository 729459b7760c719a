"""Reference implementations the tests compare the package against (test-only code).

* :func:`self_distillation_loss`: the SDPO loss from full ``[B, T, V]`` logits (the unchunked
  path, METHOD.md 1.2-1.3); the train step uses the chunked statistics instead.
* :func:`chunked_distill_loss`: the chunked statistics of :mod:`pmd_jax.distill.chunked`
  finalised into the loss, compared with the unchunked one.
* :func:`ema_update`: the EMA teacher update as a plain tree map, the reference for the fused
  optimizer pass (moved from ``pmd_jax.distill.teacher``, issue 16).
* :func:`head_chunked_distill_stats`: the chunked statistics as they were computed before
  issue 50 (``lax.top_k`` on the student, the LM head as a plain fp32-result einsum whose
  backward takes the fp32 cotangent, ``min(chunk, T)`` rows per chunk with the last one
  padded, the metrics as separate reductions), to check that fp32 results did not change and
  bf16 gradients stay within bf16 rounding of these.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

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


def head_token_distill_stats(student_logits: Array, teacher_logits: Array, tokens: Array,
                             cfg: losses.DistillLossConfig) -> dict[str, Array]:
    """:func:`pmd_jax.distill.losses.token_distill_stats` before issue 50 (frozen copy)."""
    s = losses.log_probs(student_logits, cfg.temperature)
    t = lax.stop_gradient(losses.log_probs(teacher_logits, cfg.temperature))
    s_tok = losses.token_log_probs(s, tokens)
    t_tok = losses.token_log_probs(t, tokens)
    if cfg.full_logit_distillation:
        if cfg.topk is None:
            sb, tb = s, t
        else:
            _, idx = lax.top_k(lax.stop_gradient(s), int(cfg.topk))
            sk = jnp.take_along_axis(s, idx, axis=-1)
            tk = jnp.take_along_axis(t, idx, axis=-1)
            if cfg.add_tail:
                sb, tb = losses.add_tail(sk), losses.add_tail(tk)
            else:
                sb, tb = losses.renormalize(sk), losses.renormalize(tk)
        loss = losses.divergence(sb, tb, cfg.alpha)
    else:
        loss = losses.sampled_token_surrogate(s_tok, t_tok)
    s_d = lax.stop_gradient(s)
    return {
        "loss": loss,
        "student_logp": s_tok,
        "teacher_logp": t_tok,
        "kl": jnp.sum(jnp.exp(s_d) * (s_d - t), axis=-1),
        "top1_agree": (jnp.argmax(s_d, axis=-1) == jnp.argmax(t, axis=-1)).astype(jnp.float32),
        "entropy": -jnp.sum(jnp.exp(s_d) * s_d, axis=-1),
    }


def head_chunked_distill_stats(
    student_hidden: Array, teacher_hidden: Array, student_unembed: Array,
    teacher_unembed: Array, tokens: Array, cfg: losses.DistillLossConfig, *, chunk: int,
) -> dict[str, Array]:
    """:func:`pmd_jax.distill.chunked.chunked_distill_stats` before issue 50 (frozen copy of
    its default path: one teacher, ``[D, V]`` unembeddings, remat, no ``matmul_dtype``)."""
    sg = lax.stop_gradient
    t_len = student_hidden.shape[1]
    chunk = min(chunk, max(t_len, 1))
    w_t = sg(teacher_unembed)

    def proj(h: Array, w: Array) -> Array:
        return jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)

    def body(carry: None, xs: tuple) -> tuple[None, dict[str, Array]]:
        hs, ht, tok = xs
        t_logits = sg(proj(ht, w_t))
        return carry, head_token_distill_stats(proj(hs, student_unembed), t_logits, tok, cfg)

    xs = (chunked._split(student_hidden, chunk), chunked._split(sg(teacher_hidden), chunk),
          chunked._split(tokens.astype(jnp.int32), chunk))
    _, out = lax.scan(jax.checkpoint(body, prevent_cse=False), None, xs)
    return {k: chunked._merge(v, t_len) for k, v in out.items()}
