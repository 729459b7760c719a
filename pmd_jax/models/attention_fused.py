"""Fused attention kernels from libraries, in the decoder's layout: cuDNN (through
``jax.nn.dot_product_attention``) and Pallas Splash (TPU). Which one runs:
:mod:`pmd_jax.models.attention_select`.

Both take q [B, T, H, hd] and heads-major k/v [B, KV, S, hd] of a pass without a KV cache
(T == S, query t at slot t), ``key_mask`` [B, S] (True: a real token) or, for right-padded
rows, ``seq_lengths`` [B] (:func:`dpa_attention` only: row b's real tokens are slots
[0, seq_lengths[b]); no mask array at all), optional packing
``segment_ids`` [B, T] and a static sliding ``window`` (key j visible from query i iff
``i - window < j <= i``; None: unlimited), and return [B, T, H, hd] equal to
:func:`pmd_jax.models.attention.dense_attention` with the decoder's mask on every query that
sees at least one key. Queries that see none (padding) give finite values that are never used.

:func:`per_layer_window` turns the decoder's per-layer window (a traced scalar inside the
layer scan) into the static windows these kernels need (``lax.switch`` over the model's
distinct windows).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from pmd_jax.models.config import ConfigError

log = logging.getLogger(__name__)
Attend = Callable[[jnp.ndarray, jnp.ndarray, jnp.ndarray], jnp.ndarray]
SPLASH_BLOCK = 128  # Splash's lane width: lengths are padded to a multiple of it


def visibility_mask(key_mask: jnp.ndarray | None, segment_ids: jnp.ndarray | None,
                    shared_prefix: bool) -> jnp.ndarray | None:
    """[B, 1, T, S] bool: key padding and segments (causality and window not included), or
    None when neither is given."""
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        vis = (same | (segment_ids[:, None, :] == 0)) if shared_prefix else same
        if key_mask is not None:
            vis = vis & key_mask.astype(jnp.bool_)[:, None, :]
    elif key_mask is not None:
        km = key_mask.astype(jnp.bool_)[:, None, :]
        vis = jnp.broadcast_to(km, (km.shape[0], key_mask.shape[1], km.shape[2]))
    else:
        return None
    return vis[:, None]


def right_padded_lengths(key_mask: jnp.ndarray) -> jnp.ndarray:
    """[B] int32: the number of real tokens of each right-padded row (``key_mask`` [B, S]
    True on slots [0, n)), at least 1: a row without any real token then attends to its slot
    0 (finite values nobody reads) rather than to nothing. Only right padding is expressed
    exactly: for a row with padding before a real token the lengths are wrong."""
    n = jnp.sum(key_mask.astype(jnp.int32), axis=-1)
    return jnp.maximum(n, 1).astype(jnp.int32)


def dpa_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, *,
                  key_mask: jnp.ndarray | None = None, window: int | None = None,
                  segment_ids: jnp.ndarray | None = None, shared_prefix: bool = False,
                  implementation: Literal["cudnn", "xla"] = "cudnn",
                  mask: jnp.ndarray | None = None, seq_lengths: jnp.ndarray | None = None
                  ) -> jnp.ndarray:
    """``jax.nn.dot_product_attention`` (``implementation`` "cudnn" or "xla") with the
    decoder's masks: ``is_causal``, ``local_window_size=(window - 1, 0)``, and key padding /
    segments as a boolean mask (cuDNN receives it as an additive bias and returns its
    gradient too). ``key_mask=None``: all keys real (no mask at all when there are no segments
    either). ``mask``: the :func:`visibility_mask` computed once by the caller (the decoder:
    once per forward, not per layer); ``key_mask``, ``segment_ids`` and ``shared_prefix`` are
    then not read.

    ``seq_lengths`` [B] int32 (:func:`right_padded_lengths`): right-padded rows, row b's real
    tokens at slots [0, seq_lengths[b]), passed as ``query_seq_lengths`` and
    ``key_value_seq_lengths`` (cuDNN: the ``PADDING_CAUSAL`` mask type, no mask operand, no
    bias, no ``dbias``). Then no mask is built; ``key_mask`` must be None and segments are
    refused (lengths cannot express them). Outputs of padding queries (slots >= length) are
    zeros (the xla implementation) or whatever cuDNN leaves there: never read."""
    B, T, H, hd = q.shape
    if k.shape[2] != T:
        raise ValueError(f"dpa_attention runs cache-free passes (T == S), got q {q.shape}, "
                         f"k {k.shape}")
    if seq_lengths is not None:
        if mask is not None or key_mask is not None or segment_ids is not None:
            raise ValueError("dpa_attention: seq_lengths replace the padding mask; give no "
                             "mask, key_mask or segment_ids with them")
        seq_lengths = jnp.asarray(seq_lengths, jnp.int32)
    elif mask is None:
        mask = visibility_mask(key_mask, segment_ids, shared_prefix)
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, S, KV, hd]
    out = jax.nn.dot_product_attention(
        q, kt, vt, mask=mask, is_causal=True, query_seq_lengths=seq_lengths,
        key_value_seq_lengths=seq_lengths,
        local_window_size=None if window is None else (int(window) - 1, 0),
        implementation=implementation)
    return out.astype(q.dtype)


def _splash_kernel(n: int, heads: int, window: int | None, interpret: bool):
    # lazy: the Pallas TPU kernel, only when Splash attention is built (TPU)
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    one: sa.Mask
    if window is None:
        one = sa.CausalMask((n, n))
    else:
        one = sa.LocalMask((n, n), window_size=(int(window) - 1, 0), offset=0)
    block = next(b for b in (512, 256, 128) if n % b == 0)
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    return sa, sa.make_splash_mha(sa.MultiHeadMask([one] * heads), block_sizes=sizes,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_attention(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, *,
                     key_mask: jnp.ndarray | None = None, window: int | None = None,
                     segment_ids: jnp.ndarray | None = None,
                     interpret: bool | None = None) -> jnp.ndarray:
    """Pallas Splash attention (one kernel per row, ``vmap`` over the batch). Key padding and
    packing both become Splash segment ids: a real token of segment s gets s + 1, padding 0
    (padding queries then see padding keys, never an empty row). T is padded up to a multiple
    of 128 with padding tokens. q is scaled by ``hd ** -0.5`` before the kernel (Splash does
    not scale). ``interpret``: Pallas interpret mode (default: on unless the backend is TPU).
    """
    B, T, H, hd = q.shape
    if k.shape[2] != T:
        raise ValueError(f"splash_attention runs cache-free passes (T == S), got q {q.shape}, "
                         f"k {k.shape}")
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    ids = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(
        jnp.int32) + 1
    if key_mask is not None:
        ids = jnp.where(key_mask.astype(jnp.bool_), ids, 0)
    n = -(-T // SPLASH_BLOCK) * SPLASH_BLOCK
    pad = n - T
    qh = (q * jnp.asarray(hd ** -0.5, q.dtype)).transpose(0, 2, 1, 3)  # [B, H, T, hd]
    kk, vv = k, v
    if pad:
        qh = jnp.pad(qh, ((0, 0), (0, 0), (0, pad), (0, 0)))
        kk = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
        vv = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
        ids = jnp.pad(ids, ((0, 0), (0, pad)))
    sa, kernel = _splash_kernel(n, H, window, bool(interpret))

    def one_row(qr, kr, vr, idr):
        return kernel(qr, kr, vr, segment_ids=sa.SegmentIds(q=idr, kv=idr))

    out = jax.vmap(one_row)(qh, kk, vv, ids)  # [B, H, n, hd]
    return out[:, :, :T].transpose(0, 2, 1, 3).astype(q.dtype)


def shard_mapped(fn: Callable, shard_ctx: Any, *, with_segments: bool) -> Callable:
    """``fn(q, k, v, key_mask, segment_ids)`` run per shard with ``jax.shard_map`` over the
    decoder's mesh (batch and heads sharded; a Pallas kernel is not partitioned by XLA).
    Refuses a sharded sequence axis (the kernel sees whole rows)."""
    mesh, rules = shard_ctx
    q_spec = rules.spec(("batch", "seq", "heads", "head_dim"))
    kv_spec = rules.spec(("batch", "kv_heads", "seq", "head_dim"))
    row_spec = rules.spec(("batch", "seq"))
    if q_spec[1] is not None or kv_spec[2] is not None:
        raise ConfigError("attention_impl='splash' needs the sequence axis unsharded "
                          f"(mesh rules give seq -> {q_spec[1]!r})")
    in_specs = (q_spec, kv_spec, kv_spec, row_spec) + ((row_spec,) if with_segments else ())
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=q_spec, check_vma=False)


def static_windows(windows: Sequence[int], T: int, big: int) -> list[int | None]:
    """The distinct static windows of a model's layers for T-slot rows: None for full
    attention and for windows that cover the whole row (>= T)."""
    out = sorted({None if (w >= big or w >= T) else int(w) for w in windows},
                 key=lambda w: (w is None, w or 0))
    return out


def per_layer_window(window: Any, windows: Sequence[int], T: int, big: int,
                     make: Callable[[int | None], Attend]) -> Attend:
    """The attention of a layer whose window is ``window``: a Python int (unrolled layers)
    picks ``make(w)`` directly; a traced scalar (scanned layers) switches over the model's
    distinct windows (``windows``: every layer's window, ``big`` = no window)."""
    if isinstance(window, (int, np.integer)):
        return make(None if (window >= big or window >= T) else int(window))
    options = static_windows(windows, T, big)
    if len(options) == 1:
        return make(options[0])
    finite = [w for w in options if w is not None]
    # index of the layer's window among the options (None, i.e. >= T, sorts last)
    idx = sum((jnp.asarray(window) > w).astype(jnp.int32) for w in finite)
    branches = [make(w) for w in options]

    def attend(q, k, v):
        return jax.lax.switch(idx, branches, q, k, v)

    return attend
