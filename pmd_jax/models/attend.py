"""The masked attention of every layer of one :func:`pmd_jax.models.decoder.forward` call:
which implementation runs (:mod:`pmd_jax.models.attention_select`, from the backend and the
call's static facts) and the per-layer closures ``window -> attend(q, k, v)`` for each.

Masks are over slots (HF semantics): key j is visible from the query at slot i iff j <= i, on
sliding layers i - j < window, ``key_mask[b, j]``, and with ``segment_ids`` the same segment
(with ``shared_prefix`` also any key of segment 0). With a KV cache, query t sits at slot
``idx + t``. ``right_padded``: the caller's promise that every row's real tokens are slots
[0, n) (right padding): the cuDNN kernels then get the lengths n instead of a mask (no
[B, 1, T, S] mask, no bias, no ``dbias``). Nothing checks the promise on the device: a left-
padded row under it gets wrong attention on those paths (dense and chunked read the mask).

The choice is logged (INFO) the first time each distinct (implementation, reason) is made, i.e.
when the step or sampler is first traced; ``pmd_jax.loop.build.load_model`` logs the plan at
start-up.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pmd_jax.models import attention as attn_lib
from pmd_jax.models import attention_fused as fused
from pmd_jax.models.attention_select import GPU_BACKENDS, AttentionCall, Choice, select
from pmd_jax.models.config import ModelConfig

log = logging.getLogger(__name__)
BIG_WINDOW = 2**30  # a layer without a sliding window


def backend_facts() -> tuple[str, str | None]:
    """(jax.default_backend(), the first device's CUDA compute capability or None)."""
    backend = jax.default_backend()
    cc = None
    if backend in GPU_BACKENDS:
        cc = getattr(jax.devices()[0], "compute_capability", None)
    return backend, (None if cc is None else str(cc))


def choose(cfg: ModelConfig, requested: str, *, T: int, S: int, has_cache: bool,
           key_padding: bool, segments: bool, shared_prefix: bool,
           backend: tuple[str, str | None] | None = None, right_padded: bool = False
           ) -> Choice:
    """The implementation for one forward call (``backend``: (name, compute capability),
    default :func:`backend_facts`)."""
    name, cc = backend_facts() if backend is None else backend
    call = AttentionCall(backend=name, T=T, S=S, dtype=cfg.dtype, head_dim=cfg.head_dim,
                         has_cache=has_cache, key_padding=key_padding, segments=segments,
                         shared_prefix=shared_prefix, gpu_compute_capability=cc,
                         right_padded=right_padded)
    choice = select(requested, call)
    _log_once(choice.impl, choice.reason)
    return choice


@functools.lru_cache(maxsize=64)
def _log_once(impl: str, reason: str) -> None:
    log.info("attention: %s (%s)", impl, reason)


def plan_lines(cfg: ModelConfig, *, train_len: int, shared_prefix: bool = False,
               right_padded: bool = True) -> list[str]:
    """What ``cfg.attention_impl`` means on this backend for a train-step pass of
    ``train_len`` slots (right-padded rows, ``right_padded``; packed segments with
    ``shared_prefix``) and for the sampler's KV-cache passes: one line each, for the start-up
    log."""
    name, cc = backend_facts()
    dev = name if cc is None else f"{name} (compute capability {cc})"
    out = []
    calls = (
        ("train step", AttentionCall(
            backend=name, T=train_len, S=train_len, dtype=cfg.dtype, head_dim=cfg.head_dim,
            has_cache=False, key_padding=True, segments=shared_prefix,
            shared_prefix=shared_prefix, gpu_compute_capability=cc,
            right_padded=right_padded)),
        ("sampler (KV cache)", AttentionCall(
            backend=name, T=train_len, S=train_len, dtype=cfg.dtype, head_dim=cfg.head_dim,
            has_cache=True, key_padding=True, segments=False, shared_prefix=False,
            gpu_compute_capability=cc)),
    )
    for what, call in calls:
        try:
            c = select(cfg.attention_impl, call)
            out.append(f"attention on {dev}, attention_impl={cfg.attention_impl}, {what} "
                       f"at {train_len} slots: {c.impl} ({c.reason})")
        except ValueError as e:
            out.append(f"attention on {dev}, {what}: {e}")
    return out


def attend_fn(cfg: ModelConfig, impl: str, T: int, S: int, key_mask: jnp.ndarray,
              idx: jnp.ndarray | None, segment_ids: jnp.ndarray | None,
              shared_prefix: bool = False, *, windows: np.ndarray | None = None,
              key_padding: bool = True, shard_ctx: Any = None,
              right_padded: bool = False) -> Callable:
    """``window -> attend(q, k, v)``: the masked attention of a layer with that sliding window
    (``BIG_WINDOW``: none), over slots (causal, padding keys and other segments masked).
    ``windows``: every layer's window (the fused kernels switch over the distinct ones when
    the window is traced); ``key_padding=False``: ``key_mask`` is all True (no attention
    mask was given), so the fused kernels need no mask; ``right_padded``: the key padding is
    a suffix of each row, so cuDNN gets lengths instead of a mask (module docstring)."""
    if impl in ("cudnn", "cudnn_xla", "splash"):
        return _fused_attend_fn(impl, T, key_mask if key_padding else None, segment_ids,
                                shared_prefix, windows, shard_ctx, right_padded)
    if impl == "dense":
        q_idx = jnp.arange(T, dtype=jnp.int32) + (0 if idx is None else idx)
        k_idx = jnp.arange(S, dtype=jnp.int32)
        base = (k_idx[None, :] <= q_idx[:, None])[None] & key_mask[:, None, :]
        if segment_ids is not None:
            same = segment_ids[:, :, None] == segment_ids[:, None, :]
            base = base & ((same | (segment_ids[:, None, :] == 0)) if shared_prefix else same)
        rel = q_idx[:, None] - k_idx[None, :]  # [T, S]

    def chunked(window: Any) -> Callable:
        return functools.partial(
            attn_lib.chunked_attention, key_mask=key_mask,
            q_offset=0 if idx is None else idx, window=window,
            q_segment_ids=segment_ids, k_segment_ids=segment_ids,
            q_chunk=cfg.attention_chunk, k_chunk=cfg.attention_chunk,
            shared_segment_zero=shared_prefix)

    def attend_fn(window: Any) -> Callable:
        if impl == "chunked":
            if idx is None and windows is not None:
                # cache-free: a static window per call (a switch over the model's distinct
                # windows when the layer's is traced), so chunked attention visits a static
                # tile list (no loop over traced bounds)
                return fused.per_layer_window(window, [int(w) for w in windows], T,
                                              BIG_WINDOW, chunked)
            return chunked(window)
        if isinstance(window, int) and window >= BIG_WINDOW:
            mask = base
        else:
            mask = base & (rel < window)[None]
        return functools.partial(attn_lib.dense_attention, mask=mask)

    return attend_fn


def _fused_attend_fn(impl: str, T: int, key_mask: jnp.ndarray | None,
                     segment_ids: jnp.ndarray | None, shared_prefix: bool,
                     windows: np.ndarray | None, shard_ctx: Any,
                     right_padded: bool = False) -> Callable:
    all_windows = [BIG_WINDOW] if windows is None else [int(w) for w in windows]
    # right padding without segments: the rows' lengths [B] (no mask, no bias, no dbias);
    # else one [B, 1, T, S] mask per forward, shared by the layers (a constant of the scan)
    lengths = vis = None
    if impl != "splash":
        if right_padded and key_mask is not None and segment_ids is None:
            lengths = fused.right_padded_lengths(key_mask)
        else:
            vis = fused.visibility_mask(key_mask, segment_ids, shared_prefix)

    def make(w: int | None) -> fused.Attend:
        if impl == "splash":
            return _splash_attend(T, key_mask, segment_ids, w, shard_ctx)
        return functools.partial(fused.dpa_attention, window=w, mask=vis, seq_lengths=lengths,
                                 implementation="xla" if impl == "cudnn_xla" else "cudnn")

    def attend_fn(window: Any) -> fused.Attend:
        return fused.per_layer_window(window, all_windows, T, BIG_WINDOW, make)

    return attend_fn


def _splash_attend(T: int, key_mask: jnp.ndarray | None, segment_ids: jnp.ndarray | None,
                   window: int | None, shard_ctx: Any) -> fused.Attend:
    if shard_ctx is None:
        return functools.partial(fused.splash_attention, key_mask=key_mask, window=window,
                                 segment_ids=segment_ids)
    km = key_mask
    if km is None:  # shard_map wants arrays: an all-True mask of the rows' shape
        km = jnp.ones((1, T), jnp.bool_)
    segs = segment_ids

    def body(q, k, v, km_, seg_=None):
        return fused.splash_attention(q, k, v, key_mask=km_, window=window, segment_ids=seg_)

    def attend(q, k, v):
        m = jnp.broadcast_to(km, (q.shape[0], T))
        f = fused.shard_mapped(body, shard_ctx, with_segments=segs is not None)
        return f(q, k, v, m) if segs is None else f(q, k, v, m, segs)

    return attend
