"""Softmax attention: dense, and a memory-bounded chunked (flash-style) version in pure JAX.

Both take q [B, T, H, hd] and heads-major k/v [B, KV, S, hd] (GQA: query head h reads kv head
h // (H // KV)), compute scores and softmax in float32 and return [B, T, H, hd].

``dense_attention`` takes a materialised mask [B, T, S] and builds [B, KV, G, T, S] scores: for
long sequences (the Qwen3-8B teacher sees 18k tokens) that is tens of GiB per layer.

``chunked_attention`` never builds anything of size T x S. Queries are cut into chunks of
``q_chunk`` and keys into chunks of ``k_chunk``; the mask of one (query chunk, key chunk) tile is
computed from slot indices (query t sits at slot ``q_offset + t``, key j at slot j): causal
(j <= i), sliding window (i - j < window), key padding ``key_mask`` [B, S] and optional packing
``segment_ids``. The softmax is the online (running max / running sum) one of FlashAttention,
and only key chunks that can be visible from a query chunk (by causality and the window) are
visited, so causal attention does about half the dense work and a sliding-window layer only
O(T x window). The backward pass is a ``jax.custom_vjp`` that recomputes each tile's
probabilities from the saved log-sum-exp (FlashAttention-2's backward), so forward and
backward both hold O(q_chunk x k_chunk) scores per head plus O(T) residuals (q, k, v, output,
log-sum-exp), however long the sequence.

Which tiles are visited: when the first query's slot (``q_offset``) and the window are static
Python ints (every cache-free pass: the decoder gives one static window per call, switching
over the model's distinct windows when the layer's window is traced), the list of visible
(query chunk, key chunk) pairs is computed in Python and one ``lax.scan`` with a static trip
count runs over it (forward and backward), the online-softmax state of every query chunk in its
carry. With a traced offset (KV-cache passes) each query chunk's key range is computed on the
device and a ``fori_loop`` runs over those traced bounds (a while loop whose predicate a GPU
reads back on the host at every iteration; a static list cannot know where the queries start).
Both visit the same tiles in the same order with the same arithmetic: same bits.

Rows with no visible key (padding queries) give an average of the values they visited; they
are never used (dense gives an average over all keys: both are finite garbage).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pmd_jax.models.attention_select import AUTO_CHUNKED_MIN_SCORES, legacy_rule
from pmd_jax.models.config import ATTENTION_IMPLS, ConfigError

__all__ = ["AUTO_CHUNKED_MIN_SCORES", "chunked_attention", "dense_attention", "resolve_impl"]
_MIN = float(jnp.finfo(jnp.float32).min)


def resolve_impl(impl: str, T: int, S: int) -> str:
    """The implementation ``impl`` means for T queries, S keys on CPU: "auto" is
    :func:`pmd_jax.models.attention_select.legacy_rule` (chunked when T * S > 1024^2);
    explicit names are returned as they are. Backend-aware choice (cuDNN on GPU, Splash on
    TPU): :func:`pmd_jax.models.attention_select.select`."""
    if impl not in ATTENTION_IMPLS:
        raise ConfigError(f"attention_impl={impl!r} is not one of {ATTENTION_IMPLS}")
    if impl == "auto":
        return legacy_rule(T, S)
    return impl


def dense_attention(
    q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, mask: jnp.ndarray
) -> jnp.ndarray:
    """Softmax attention with GQA grouping. q [B,T,H,hd], k/v [B,KV,S,hd], mask [B,T,S] bool.

    Scores and softmax in float32; rows with no visible key give a uniform average (they are
    padding queries and are never used).

    The queries are moved to heads-major ``[B, KV, G*T, hd]`` first, so both attention
    matmuls are plain batched matmuls over ``B*KV`` (no transposed operands inside the dot):
    on XLA:CPU, B=16 T=256 SmolLM2 shapes, fwd+bwd 682 -> 465 ms per layer (a loaded
    2-core host; the whole benchmark step 59.7 -> 55.8 s back to back).
    """
    B, T, H, hd = q.shape
    KV = k.shape[1]
    G = H // KV
    S = k.shape[2]
    qh = q.reshape(B, T, KV, G, hd).transpose(0, 2, 3, 1, 4).reshape(B, KV, G * T, hd)
    if T == 1:
        # One query per row (a decode step): the scores as a fused multiply + reduce over hd.
        # As a dot, XLA:CPU's library fusion ran it ~40 ms per layer for 48 rows x 792 cache
        # slots (SmolLM2-135M), 4x slower than this: the whole decode step 1,356 -> 351 ms.
        s = jnp.sum(qh[:, :, :, None, :].astype(jnp.float32) * k[:, :, None, :, :], axis=-1)
    else:
        s = jnp.einsum("bkmd,bksd->bkms", qh, k, preferred_element_type=jnp.float32)
    s = s.reshape(B, KV, G, T, S) * (hd ** -0.5)
    s = jnp.where(mask[:, None, None, :, :], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).reshape(B, KV, G * T, S)
    o = jnp.einsum("bkms,bksd->bkmd", p.astype(v.dtype), v)
    return o.reshape(B, KV, G, T, hd).transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd)


def chunked_attention(
    q: jnp.ndarray,
    k: jnp.ndarray,
    v: jnp.ndarray,
    key_mask: jnp.ndarray | None = None,
    *,
    q_offset: jnp.ndarray | int = 0,
    window: jnp.ndarray | int | None = None,
    q_segment_ids: jnp.ndarray | None = None,
    k_segment_ids: jnp.ndarray | None = None,
    q_chunk: int = 512,
    k_chunk: int = 512,
    shared_segment_zero: bool = False,
) -> jnp.ndarray:
    """Memory-bounded causal attention; same result as :func:`dense_attention` with the mask
    ``(j <= q_offset + t) & (q_offset + t - j < window) & key_mask[b, j]
    (& q_segment_ids[b, t] == k_segment_ids[b, j])``; with ``shared_segment_zero`` a key of
    segment 0 is visible from every segment (a prefix shared by the row's segments:
    ``| k_segment_ids[b, j] == 0``).

    q [B,T,H,hd], k/v [B,KV,S,hd], key_mask [B,S] bool (None: all keys real), ``q_offset``:
    slot of the first query (the KV-cache write index; 0 without a cache), ``window``: sliding
    window (None: unlimited; may be a traced per-layer scalar). Chunk sizes need not divide T
    or S (the last chunk is padded).
    """
    B, T, H, hd = q.shape
    if k.ndim != 4 or k.shape[0] != B or v.shape != k.shape or k.shape[-1] != hd:
        raise ValueError(f"k/v must be [B, KV, S, hd] matching q {q.shape}; got {k.shape}, "
                         f"{v.shape}")
    KV, S = k.shape[1], k.shape[2]
    if H % KV:
        raise ValueError(f"{H} query heads are not a multiple of {KV} kv heads")
    if q_chunk < 1 or k_chunk < 1:
        raise ValueError(f"chunk sizes must be >= 1, got q_chunk={q_chunk} k_chunk={k_chunk}")
    if (q_segment_ids is None) != (k_segment_ids is None):
        raise ValueError("give both q_segment_ids and k_segment_ids, or neither")
    km = jnp.ones((B, S), jnp.bool_) if key_mask is None else key_mask.astype(jnp.bool_)
    win = jnp.asarray(2**30 if window is None else window, jnp.int32)
    off = jnp.asarray(q_offset, jnp.int32)
    if q_segment_ids is None or k_segment_ids is None:  # both None (checked above)
        qseg = kseg = None
    else:
        qseg = q_segment_ids.astype(jnp.int32)
        kseg = k_segment_ids.astype(jnp.int32)
    cq, ck = min(q_chunk, T), min(k_chunk, S)
    pairs = None
    if _is_static_int(q_offset) and (window is None or _is_static_int(window)):
        pairs = tile_schedule(T, S, cq, ck, int(q_offset),
                              2**30 if window is None else int(window))
    return _flash(cq, ck, bool(shared_segment_zero), pairs, q, k, v, km, off, win, qseg, kseg)


def _is_static_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def tile_schedule(T: int, S: int, cq: int, ck: int, q_offset: int, window: int
                  ) -> tuple[tuple[int, int], ...]:
    """The (query chunk, key chunk) pairs a query chunk can see (causality and the window),
    in the order the traced-bounds loops visit them: the same key range as ``_k_range`` (first
    chunk holding a key within the window of the chunk's first query, through the chunk of its
    last query's slot), from static ints."""
    nq, nk = math.ceil(T / cq), math.ceil(S / ck)
    out = []
    for i in range(nq):
        first = q_offset + i * cq
        last = q_offset + min(i * cq + cq - 1, T - 1)
        lo = min(max((first - window + 1) // ck, 0), nk)
        hi = min(max(last // ck + 1, 0), nk)
        out += [(i, j) for j in range(lo, hi)]
    return tuple(out)


# --------------------------------------------------------------------------- internals
def _pad_axis(x: jnp.ndarray, axis: int, to: int, value=0) -> jnp.ndarray:
    n = x.shape[axis]
    if n == to:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, to - n)
    return jnp.pad(x, pad, constant_values=value)


def _layout(cq, ck, q, k, v, km, qseg, kseg):
    """Pad and chunk: q -> [nq, B, cq, KV, G, hd]; k/v/key mask/segments padded to nk * ck."""
    B, T, H, hd = q.shape
    KV, S = k.shape[1], k.shape[2]
    nq, nk = math.ceil(T / cq), math.ceil(S / ck)
    qc = _pad_axis(q, 1, nq * cq).reshape(B, nq, cq, KV, H // KV, hd).swapaxes(0, 1)
    kp, vp = _pad_axis(k, 2, nk * ck), _pad_axis(v, 2, nk * ck)
    kmp = _pad_axis(km, 1, nk * ck, False)
    qsc = ksp = None
    if qseg is not None:
        qsc = _pad_axis(qseg, 1, nq * cq, -1).reshape(B, nq, cq).swapaxes(0, 1)
        ksp = _pad_axis(kseg, 1, nk * ck, -2)
    return qc, kp, vp, kmp, qsc, ksp, nq, nk


def _q_slots(i, cq, T, off):
    """Slots of query chunk i (padded queries repeat the last real slot) and the range of key
    chunks [lo, hi) that any of them can see."""
    t = jnp.minimum(i * cq + jnp.arange(cq, dtype=jnp.int32), T - 1)
    return off + t


def _k_range(slots, win, ck, nk):
    lo = jnp.clip((slots[0] - win + 1) // ck, 0, nk)
    hi = jnp.clip(slots[-1] // ck + 1, 0, nk)
    return lo, hi


def _tile(j, ck, qc, kp, vp, kmp, slots, win, qs, ksp, scale, shared):
    """Masked float32 scores [B, KV, G, cq, ck] of query chunk qc [B, cq, KV, G, hd] against
    key chunk j, and that chunk's k, v [B, KV, ck, hd]."""
    kc = jax.lax.dynamic_slice_in_dim(kp, j * ck, ck, axis=2)
    vc = jax.lax.dynamic_slice_in_dim(vp, j * ck, ck, axis=2)
    kmc = jax.lax.dynamic_slice_in_dim(kmp, j * ck, ck, axis=1)
    s = jnp.einsum("bqkgd,bksd->bkgqs", qc, kc, preferred_element_type=jnp.float32) * scale
    kslots = j * ck + jnp.arange(ck, dtype=jnp.int32)
    rel = slots[:, None] - kslots[None, :]
    vis = ((rel >= 0) & (rel < win))[None] & kmc[:, None, :]  # [B, cq, ck]
    if qs is not None:
        ksc = jax.lax.dynamic_slice_in_dim(ksp, j * ck, ck, axis=1)
        same = qs[:, :, None] == ksc[:, None, :]
        vis = vis & ((same | (ksc[:, None, :] == 0)) if shared else same)
    s = jnp.where(vis[:, None, None], s, _MIN)
    return s, kc, vc


def _fwd_tile(j, state, qc, qs, slots, kp, vp, kmp, ksp, win, ck, scale, shared, v_dtype):
    """One key chunk j of the online softmax of one query chunk: (m, den, acc) updated."""
    m, den, acc = state
    s, _, vc = _tile(j, ck, qc, kp, vp, kmp, slots, win, qs, ksp, scale, shared)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    den = den * corr + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v_dtype), vc,
                    preferred_element_type=jnp.float32)
    return m_new, den, acc * corr[..., None] + pv


def _take(x, i):
    return None if x is None else jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _put(x, val, i):
    return jax.lax.dynamic_update_index_in_dim(x, val, i, 0)


def _forward(cq, ck, shared, pairs, q, k, v, km, off, win, qseg, kseg):
    B, T, H, hd = q.shape
    KV = k.shape[1]
    G = H // KV
    scale = hd ** -0.5
    qc_all, kp, vp, kmp, qsc, ksp, nq, nk = _layout(cq, ck, q, k, v, km, qseg, kseg)
    tile = functools.partial(_fwd_tile, kp=kp, vp=vp, kmp=kmp, ksp=ksp, win=win, ck=ck,
                             scale=scale, shared=shared, v_dtype=v.dtype)
    m0 = jnp.full((B, KV, G, cq), _MIN, jnp.float32)
    l0 = jnp.zeros((B, KV, G, cq), jnp.float32)
    a0 = jnp.zeros((B, KV, G, cq, hd), jnp.float32)

    def finish(m, den, acc):
        den = jnp.where(den > 0, den, 1.0)
        return (acc / den[..., None]).astype(q.dtype), m + jnp.log(den)

    if pairs is not None:  # static tile list: one scan, every query chunk's state carried
        def pair_step(carry, ij):
            i, j = ij
            slots = _q_slots(i, cq, T, off)
            state = tuple(_take(c, i) for c in carry[:3])
            new = tile(j, state, _take(qc_all, i), _take(qsc, i), slots)
            # the chunk's output, rewritten after each of its tiles (the last write stays): as
            # in the traced-bounds loop, o and lse leave the loop as arrays, so XLA cannot
            # fuse the division into their consumers (which rounded differently)
            new = (*new, *finish(*new))
            return tuple(_put(c, n, i) for c, n in zip(carry, new)), None

        state0 = (m0, l0, a0, *finish(m0, l0, a0))
        carry0 = tuple(jnp.broadcast_to(x, (nq, *x.shape)) for x in state0)
        if pairs:
            ij = jnp.asarray(np.asarray(pairs, np.int32).T)
            carry0, _ = jax.lax.scan(pair_step, carry0, (ij[0], ij[1]))
        o, lse = carry0[3], carry0[4]
    else:  # traced bounds (KV-cache passes)
        def q_step(_, xs):
            i, qc, qs = xs
            slots = _q_slots(i, cq, T, off)
            lo, hi = _k_range(slots, win, ck, nk)
            state = jax.lax.fori_loop(
                lo, hi, lambda j, st: tile(j, st, qc, qs, slots), (m0, l0, a0))
            return None, finish(*state)

        idx = jnp.arange(nq, dtype=jnp.int32)
        _, (o, lse) = jax.lax.scan(q_step, None, (idx, qc_all, qsc))
    # o [nq, B, KV, G, cq, hd] -> [B, T, H, hd]
    out = o.transpose(1, 0, 4, 2, 3, 5).reshape(B, nq * cq, H, hd)[:, :T]
    return out, (o, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _flash(cq, ck, shared, pairs, q, k, v, km, off, win, qseg, kseg):
    return _forward(cq, ck, shared, pairs, q, k, v, km, off, win, qseg, kseg)[0]


def _flash_fwd(cq, ck, shared, pairs, q, k, v, km, off, win, qseg, kseg):
    out, (o, lse) = _forward(cq, ck, shared, pairs, q, k, v, km, off, win, qseg, kseg)
    return out, (q, k, v, km, off, win, qseg, kseg, o, lse)


def _bwd_tile(j, carry, qc, qs, slots, doc, lse_c, d_c, kp, vp, kmp, ksp, win, ck, scale,
              shared):
    """Key chunk j's share of the gradients of one query chunk: dq (of that chunk) and the
    dk, dv accumulators (of all keys) updated."""
    dq, dk_acc, dv_acc = carry
    s, kc, vc = _tile(j, ck, qc, kp, vp, kmp, slots, win, qs, ksp, scale, shared)
    p = jnp.exp(s - lse_c[..., None])  # [B, KV, G, cq, ck]
    dv = jnp.einsum("bkgqs,bkgqd->bksd", p, doc)
    dp = jnp.einsum("bkgqd,bksd->bkgqs", doc, vc.astype(jnp.float32))
    ds = p * (dp - d_c[..., None]) * scale
    dq = dq + jnp.einsum("bkgqs,bksd->bkgqd", ds, kc.astype(jnp.float32))
    dk = jnp.einsum("bkgqs,bqkgd->bksd", ds, qc.astype(jnp.float32))
    start = (0, 0, j * ck, 0)
    dk_acc = jax.lax.dynamic_update_slice(
        dk_acc, jax.lax.dynamic_slice(dk_acc, start, dk.shape) + dk, start)
    dv_acc = jax.lax.dynamic_update_slice(
        dv_acc, jax.lax.dynamic_slice(dv_acc, start, dv.shape) + dv, start)
    return dq, dk_acc, dv_acc


def _flash_bwd(cq, ck, shared, pairs, res, dout):
    q, k, v, km, off, win, qseg, kseg, o, lse = res
    B, T, H, hd = q.shape
    KV, S = k.shape[1], k.shape[2]
    G = H // KV
    scale = hd ** -0.5
    qc_all, kp, vp, kmp, qsc, ksp, nq, nk = _layout(cq, ck, q, k, v, km, qseg, kseg)
    # dO in the layout of o: [nq, B, KV, G, cq, hd], float32 (zero on padded queries)
    do = _pad_axis(dout.astype(jnp.float32), 1, nq * cq)
    do = do.reshape(B, nq, cq, KV, G, hd).transpose(1, 0, 3, 4, 2, 5)
    dsum = jnp.sum(do * o.astype(jnp.float32), axis=-1)  # [nq, B, KV, G, cq]
    Sp = nk * ck
    tile = functools.partial(_bwd_tile, kp=kp, vp=vp, kmp=kmp, ksp=ksp, win=win, ck=ck,
                             scale=scale, shared=shared)
    zeros = jnp.zeros((B, KV, Sp, hd), jnp.float32)
    dq0 = jnp.zeros((B, KV, G, cq, hd), jnp.float32)

    if pairs is not None:  # static tile list: one scan, every query chunk's dq carried
        def pair_step(carry, ij):
            dq_all, dk_acc, dv_acc = carry
            i, j = ij
            slots = _q_slots(i, cq, T, off)
            dq, dk_acc, dv_acc = tile(j, (_take(dq_all, i), dk_acc, dv_acc), _take(qc_all, i),
                                      _take(qsc, i), slots, _take(do, i), _take(lse, i),
                                      _take(dsum, i))
            return (_put(dq_all, dq, i), dk_acc, dv_acc), None

        carry0 = (jnp.broadcast_to(dq0, (nq, *dq0.shape)), zeros, zeros)
        if pairs:
            ij = jnp.asarray(np.asarray(pairs, np.int32).T)
            carry0, _ = jax.lax.scan(pair_step, carry0, (ij[0], ij[1]))
        dq, dk, dv = carry0
    else:  # traced bounds (KV-cache passes)
        def q_step(carry, xs):
            dk_acc, dv_acc = carry
            i, qc, qs, doc, lse_c, d_c = xs
            slots = _q_slots(i, cq, T, off)
            lo, hi = _k_range(slots, win, ck, nk)
            dq, dk_acc, dv_acc = jax.lax.fori_loop(
                lo, hi, lambda j, c: tile(j, c, qc, qs, slots, doc, lse_c, d_c),
                (dq0, dk_acc, dv_acc))
            return (dk_acc, dv_acc), dq

        idx = jnp.arange(nq, dtype=jnp.int32)
        (dk, dv), dq = jax.lax.scan(q_step, (zeros, zeros), (idx, qc_all, qsc, do, lse, dsum))
    dq = dq.transpose(1, 0, 4, 2, 3, 5).reshape(B, nq * cq, H, hd)[:, :T]
    return (dq.astype(q.dtype), dk[:, :, :S].astype(k.dtype), dv[:, :, :S].astype(v.dtype),
            None, None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
