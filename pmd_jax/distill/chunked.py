"""Memory-bounded distillation loss and token log-probs over hidden states.

With a 151k vocabulary and 8k response tokens a full fp32 ``[B, T, V]`` logits tensor is
~5 GB per sample (and its backward needs several more). The functions here never build it:
they take the final-norm hidden states ``[B, T, D]`` and the unembedding ``[D, V]``, and
``lax.scan`` over chunks of ``chunk`` sequence positions. Each chunk projects to
``[B, chunk, V]`` fp32 logits, reduces them to per-token numbers (loss, sampled-token
log-prob, KL, agreement, entropy) and drops them. The scan body is wrapped in
``jax.checkpoint``, so the backward pass recomputes each chunk's logits instead of storing
them: forward and backward both keep O(B * chunk * V) logits alive, not O(B * T * V).

Chunks run over sequence positions, not over the flattened batch, so a batch-sharded
``[B, T, D]`` keeps its sharding (the scan axis is unsharded). Per-device live logits are
about ``B_local * chunk * V * 4`` bytes per buffer: pick ``chunk`` from that budget (the
default 256 gives 155 MB per buffer at ``B_local = 1``, ``V = 151936``). There is no vocab
tiling: one ``[B_local, chunk, V]`` row block is small enough at these vocabularies. ``chunk``
is an upper bound: the chunk used divides the sequence length where a divisor is near
(:func:`chunk_for_length`), so no padded rows are projected.

The projections run in the operands' compute dtype: bf16 hidden states and unembedding give
bf16 GEMMs with fp32 accumulation forward and backward and fp32 logits (:func:`project`).

Hidden states must already be aligned to the response positions (``[B, R, D]`` from
:func:`pmd_jax.distill.align.gather_response`): row ``t`` of the student and of the teacher
both predict response token ``tokens[:, t]``.

Teachers: one hidden/unembedding pair (EMA, frozen or live teacher), or, for the
trust-region teacher (METHOD.md 1.4), a second pair from the frozen reference model and the
interpolation ``alpha``: ``logits_T = lerp(logits_ref, logits_cur, alpha) = logits_ref +
alpha * (logits_cur - logits_ref)``, computed inside the chunk. The teacher is always
stop-gradiented.
"""

from __future__ import annotations

from typing import Literal, overload

import jax
import jax.numpy as jnp
from jax import lax

from pmd_jax.distill import losses
from pmd_jax.models import matmul

Array = jax.Array

DEFAULT_CHUNK = 256


def chunk_for_length(length: int, chunk: int) -> int:
    """The chunk of rows the chunked loss uses for ``length`` rows and at most ``chunk`` each.

    ``length`` itself when it fits in one chunk. Else, with ``n = ceil(length / chunk)``
    chunks needed: ``length / m`` for the smallest ``m`` in ``[n, 2n]`` that divides
    ``length`` (no padded rows; chunks at least about half the size asked for), or, when no
    such ``m`` exists (e.g. a prime length), ``ceil(length / n)`` (``n`` chunks, fewer than
    ``n`` padded rows). Never more than ``chunk``. E.g. ``(512, 96) -> 64`` (8 chunks; 96 as
    given pads 512 rows to 576), ``(1000, 256) -> 250``, ``(509, 96) -> 85`` (510 rows).
    """
    _check_chunk(chunk)
    if length <= chunk:
        return max(length, 1)
    n = -(-length // chunk)
    for m in range(n, 2 * n + 1):
        if length % m == 0:
            return length // m
    return -(-length // n)


def lowp_dtype(*arrays: Array) -> str | None:
    """The low-precision compute dtype (bfloat16 / float16) of matmul operands, by promotion;
    None when they compute in float32 (or wider)."""
    name = jnp.result_type(*arrays).name
    return name if name in matmul.LOWP_DTYPES else None


def project(hidden: Array, unembed: Array, vocab_major: bool = False,
            matmul_dtype: str | None = None) -> Array:
    """``hidden @ unembed`` with fp32 accumulation and output: ``[..., D] x [D, V] -> [..., V]``;
    with ``matmul_dtype`` from operands rounded to it (:func:`pmd_jax.models.matmul.lowp_einsum`).

    Operands that already compute in bfloat16 / float16 (a bf16 model, ``matmul_dtype`` None)
    go through :func:`~pmd_jax.models.matmul.lowp_einsum` in that dtype too: the same forward
    (low-precision operands, fp32 accumulation, fp32 logits for the loss), and a backward
    whose dX and dW take the logits' cotangent rounded to that dtype with fp32 accumulation,
    instead of an fp32 cotangent against low-precision operands (fp32, TF32 on GPU; MaxText's
    ``logits_dot_in_fp32=False``). float32 operands are computed exactly as before.

    ``vocab_major``: ``unembed`` is ``[V, D]`` (a tied embedding table) and is contracted on
    its second axis, so no transposed ``[D, V]`` copy is ever made (XLA:CPU materialises a
    loop-invariant ``embed.T`` before the chunk loop, and its gradient back, ~0.1 s each at a
    50k x 576 table).
    """
    spec = "...d,vd->...v" if vocab_major else "...d,dv->...v"
    matmul_dtype = matmul_dtype or lowp_dtype(hidden, unembed)
    if matmul_dtype is not None:
        return matmul.lowp_einsum(spec, hidden, unembed, matmul_dtype)
    return jnp.einsum(spec, hidden, unembed, preferred_element_type=jnp.float32)


def _check_hidden(hidden: Array, unembed: Array, what: str, vocab_major: bool = False) -> None:
    layout = "[V, D]" if vocab_major else "[D, V]"
    if hidden.ndim != 3:
        raise ValueError(f"{what} hidden must be [B, T, D], got shape {tuple(hidden.shape)}")
    if unembed.ndim != 2:
        raise ValueError(f"{what} unembed must be {layout}, got shape {tuple(unembed.shape)}")
    d_axis = 1 if vocab_major else 0
    if hidden.shape[-1] != unembed.shape[d_axis]:
        raise ValueError(
            f"{what}: hidden size {hidden.shape[-1]} does not match unembed "
            f"{'columns' if vocab_major else 'rows'} {unembed.shape[d_axis]} (unembed must be "
            f"{layout})"
        )


def _check_chunk(chunk: int) -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    return chunk


def _split(x: Array, chunk: int) -> Array:
    """``[B, T, ...]`` -> ``[n, B, chunk, ...]``, zero-padding T up to ``n * chunk``."""
    b, t = x.shape[:2]
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape((b, n, chunk) + x.shape[2:]), 1, 0)


def _merge(y: Array, t: int) -> Array:
    """``[n, B, chunk, ...]`` -> ``[B, T, ...]`` (drops the padding)."""
    n, b, c = y.shape[:3]
    return jnp.moveaxis(y, 0, 1).reshape((b, n * c) + y.shape[3:])[:, :t]


def chunked_distill_stats(
    student_hidden: Array,
    teacher_hidden: Array,
    student_unembed: Array,
    teacher_unembed: Array,
    tokens: Array,
    cfg: losses.DistillLossConfig,
    *,
    chunk: int = DEFAULT_CHUNK,
    ref_teacher_hidden: Array | None = None,
    ref_teacher_unembed: Array | None = None,
    trust_region_alpha: float | None = None,
    vocab_major: bool = False,
    remat: bool = True,
    topk_indices: losses.TopKIndices | None = None,
    matmul_dtype: str | None = None,
) -> dict[str, Array]:
    """Per-token distillation statistics, ``[B, T]`` each, computed chunk by chunk.

    Same outputs as :func:`pmd_jax.distill.losses.token_distill_stats` on the full logits
    (``loss``, ``student_logp``, ``teacher_logp``, ``kl``, ``top1_agree``, ``entropy``).
    ``teacher_hidden`` / ``teacher_unembed`` is the current teacher; with
    ``ref_teacher_hidden`` / ``ref_teacher_unembed`` and ``trust_region_alpha`` the teacher
    logits are ``lerp(ref, current, alpha)``.

    ``vocab_major``: the unembedding matrices are ``[V, D]`` (see :func:`project`).
    ``remat=False`` keeps each chunk's logits for the backward pass instead of recomputing
    them (one more projection per chunk saved, ``B * T * V`` fp32 logits kept alive: only for
    short responses / small vocabularies, e.g. the CPU benchmark).
    ``topk_indices``: the top-K index function (default ``lax.top_k``; on a mesh with a
    sharded vocabulary use :func:`pmd_jax.distill.sharded_topk.make_topk_indices`, which does
    not all-gather the logits chunk).
    ``matmul_dtype``: operand dtype of the logit projections (see :func:`project`).
    """
    _check_hidden(student_hidden, student_unembed, "student", vocab_major)
    _check_hidden(teacher_hidden, teacher_unembed, "teacher", vocab_major)
    chunk = _check_chunk(chunk)
    if teacher_hidden.shape != student_hidden.shape:
        raise ValueError(
            f"student hidden {tuple(student_hidden.shape)} and teacher hidden "
            f"{tuple(teacher_hidden.shape)} must have the same [B, T, D] (teacher aligned to "
            "the response positions)"
        )
    vocab = student_unembed.shape[0 if vocab_major else 1]
    if teacher_unembed.shape != student_unembed.shape:
        raise ValueError(
            f"student unembed {tuple(student_unembed.shape)} and teacher unembed "
            f"{tuple(teacher_unembed.shape)} differ"
        )
    if tuple(tokens.shape) != tuple(student_hidden.shape[:2]):
        raise ValueError(
            f"tokens shape {tuple(tokens.shape)} must be [B, T]={tuple(student_hidden.shape[:2])}"
        )
    cfg.validate(vocab_size=vocab)
    has_ref = ref_teacher_hidden is not None or ref_teacher_unembed is not None
    if has_ref:
        if ref_teacher_hidden is None or ref_teacher_unembed is None:
            raise ValueError("trust-region teacher needs both ref_teacher_hidden and _unembed")
        _check_hidden(ref_teacher_hidden, ref_teacher_unembed, "reference teacher", vocab_major)
        if ref_teacher_hidden.shape != teacher_hidden.shape:
            raise ValueError(
                f"reference teacher hidden {tuple(ref_teacher_hidden.shape)} must match teacher "
                f"hidden {tuple(teacher_hidden.shape)}"
            )
        if ref_teacher_unembed.shape != teacher_unembed.shape:
            raise ValueError(
                f"reference teacher unembed {tuple(ref_teacher_unembed.shape)} must match "
                f"teacher unembed {tuple(teacher_unembed.shape)}"
            )
        if trust_region_alpha is None:
            raise ValueError("trust-region teacher needs trust_region_alpha")
        tr_alpha = losses.static_float(trust_region_alpha, "trust_region_alpha")
        if not 0.0 <= tr_alpha <= 1.0:
            raise ValueError(f"trust_region_alpha must be in [0, 1], got {tr_alpha}")
    elif trust_region_alpha is not None:
        raise ValueError("trust_region_alpha given without a reference teacher (ref_teacher_*)")

    t_len = student_hidden.shape[1]
    chunk = chunk_for_length(t_len, chunk)
    sg = lax.stop_gradient
    w_t = sg(teacher_unembed)
    # has_ref: both ref_teacher_* are given (checked above), so each is None exactly without it
    w_r = sg(ref_teacher_unembed) if ref_teacher_unembed is not None else None

    def body(carry: None, xs: tuple) -> tuple[None, dict[str, Array]]:
        hs, ht, hr, tok = xs
        s_logits = project(hs, student_unembed, vocab_major, matmul_dtype)
        t_logits = project(ht, w_t, vocab_major, matmul_dtype)
        if hr is not None:
            assert w_r is not None  # hr is scanned only with a reference teacher
            r_logits = project(hr, w_r, vocab_major, matmul_dtype)
            t_logits = r_logits + tr_alpha * (t_logits - r_logits)
        return carry, losses.token_distill_stats(s_logits, sg(t_logits), tok, cfg, topk_indices)

    if remat:
        body = jax.checkpoint(body, prevent_cse=False)
    xs = (
        _split(student_hidden, chunk),
        _split(sg(teacher_hidden), chunk),
        _split(sg(ref_teacher_hidden), chunk) if ref_teacher_hidden is not None else None,
        _split(tokens.astype(jnp.int32), chunk),
    )
    _, out = lax.scan(body, None, xs)
    return {k: _merge(v, t_len) for k, v in out.items()}


@overload
def chunked_token_logprobs(
    hidden: Array, unembed: Array, tokens: Array, temperature: float = ...,
    chunk: int = ..., *, return_entropy: Literal[False] = ..., vocab_major: bool = ...,
    remat: bool = ..., matmul_dtype: str | None = ...,
) -> Array: ...


@overload
def chunked_token_logprobs(
    hidden: Array, unembed: Array, tokens: Array, temperature: float = ...,
    chunk: int = ..., *, return_entropy: Literal[True], vocab_major: bool = ...,
    remat: bool = ..., matmul_dtype: str | None = ...,
) -> tuple[Array, Array]: ...


def chunked_token_logprobs(
    hidden: Array,
    unembed: Array,
    tokens: Array,
    temperature: float = 1.0,
    chunk: int = DEFAULT_CHUNK,
    *,
    return_entropy: bool = False,
    vocab_major: bool = False,
    remat: bool = True,
    matmul_dtype: str | None = None,
) -> Array | tuple[Array, Array]:
    """``log_softmax(hidden @ unembed / T)[b, t, tokens[b, t]]`` as ``[B, T]`` fp32, chunked.

    Differentiable w.r.t. ``hidden`` and ``unembed`` with a chunked backward (remat). With
    ``return_entropy`` also returns the (detached) entropy per token. ``vocab_major`` /
    ``remat`` / ``matmul_dtype``: as in :func:`chunked_distill_stats`.
    """
    _check_hidden(hidden, unembed, "model", vocab_major)
    chunk = _check_chunk(chunk)
    if tuple(tokens.shape) != tuple(hidden.shape[:2]):
        raise ValueError(
            f"tokens shape {tuple(tokens.shape)} must be [B, T]={tuple(hidden.shape[:2])}"
        )
    t = losses.static_float(temperature, "temperature")
    if not t > 0.0:
        raise ValueError(f"temperature must be > 0, got {t}")
    t_len = hidden.shape[1]
    chunk = chunk_for_length(t_len, chunk)

    def body(carry: None, xs: tuple) -> tuple[None, tuple[Array, Array]]:
        h, tok = xs
        logp = losses.log_probs(project(h, unembed, vocab_major, matmul_dtype), t)
        tok_lp = losses.token_log_probs(logp, tok)
        if return_entropy:
            lp = lax.stop_gradient(logp)
            ent = -jnp.sum(jnp.exp(lp) * lp, axis=-1)
        else:
            ent = jnp.zeros_like(tok_lp)
        return carry, (tok_lp, ent)

    if remat:
        body = jax.checkpoint(body, prevent_cse=False)
    _, (lp, ent) = lax.scan(body, None, (_split(hidden, chunk), _split(tokens, chunk)))
    lp = _merge(lp, t_len)
    if return_entropy:
        return lp, _merge(ent, t_len)
    return lp
