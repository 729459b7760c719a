"""The jitted programs of the in-process JAX sampler (``jax_sampler.JaxSampler``).

``compiled_programs`` (cached per model config, pad id, mesh and cache dtype, shared by every
sampler of that model): ``prefill`` of one group of distinct prompts, ``empty`` +
``place_rows`` to assemble a decode batch from prefilled groups, ``decode_start`` +
``decode_batch`` (the unconstrained ``while_loop`` decode, which can stop early so that its
still-going rows continue in a smaller batch, ``take_rows``), and the two per-token pieces
of the host-driven grammar-constrained loop (``decode_logits``, ``sample_masked``;
``grow_cache`` lengthens its cache as its rows go on). See ``jax_sampler``'s module
docstring for the algorithm.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from pmd_jax.models import decoder
from pmd_jax.models.config import ModelConfig
from pmd_jax.sampling import sample_ops

Params = Any


class Programs(NamedTuple):
    """The sampler's jitted programs (one family per model config, mesh and cache dtype).

    ``prefill`` runs one group of distinct prompts into a cache exactly its padded length
    (``prefill_after``: the group's suffixes after a prefix every prompt of the batch shares,
    prefilled once);
    ``empty`` makes a decode batch's cache and first-step logits; ``place`` copies a group's
    cache slots and logits into the batch rows that continue its prompts (each prompt once,
    however many samples continue it); ``start`` samples a filled batch's first token and
    ``decode`` runs the unconstrained ``while_loop`` decode from that state (until done, or
    until few enough rows are left to go on in a smaller batch); ``step`` / ``sample`` are
    the host-driven constrained loop's pieces. ``place``, ``decode`` and ``step`` donate the
    cache (updated in place: ``decode`` returns it, else the loop's state would be a copy,
    twice the batch's cache resident); ``decode`` donates its state too.
    """

    prefill: Any
    prefill_after: Any
    empty: Any
    place: Any
    start: Any
    decode: Any
    step: Any
    sample: Any


@functools.lru_cache(maxsize=32)
def compiled_programs(cfg: ModelConfig, pad_id: int, shard_ctx: Any, cache_dtype: Any,
                      prefill_matmul_dtype: str | None = None) -> Programs:
    """The jitted programs, shared by every sampler of one model; none depends on a grammar.
    ``prefill_matmul_dtype`` ('bfloat16' / 'float16'): the prefill's weight matmuls take
    operands of that dtype with float32 accumulation (``models.matmul``); the decode steps
    and the prefill's last-slot logits keep the model's own."""
    if prefill_matmul_dtype is not None:  # ModelConfig refuses an unknown dtype, here
        cfg.replace(matmul_dtype=prefill_matmul_dtype)
    kw = dict(cfg=cfg, shard_ctx=shard_ctx)
    return Programs(
        prefill=jax.jit(functools.partial(prefill, **kw, cache_dtype=cache_dtype,
                                          matmul_dtype=prefill_matmul_dtype),
                        static_argnames=("cache_len",)),
        prefill_after=jax.jit(functools.partial(prefill_after, **kw, cache_dtype=cache_dtype,
                                                matmul_dtype=prefill_matmul_dtype)),
        empty=jax.jit(functools.partial(empty_batch, **kw, cache_dtype=cache_dtype),
                      static_argnames=("b", "cache_len")),
        place=place_rows,  # array by array, each copy jitted (see place_rows)
        start=jax.jit(functools.partial(decode_start, pad_id=pad_id),
                      static_argnames=("out_len",)),
        decode=jax.jit(functools.partial(decode_batch, **kw, pad_id=pad_id),
                       donate_argnames=("cache", "state")),
        step=jax.jit(functools.partial(decode_logits, **kw), donate_argnames=("cache",)),
        sample=jax.jit(sample_masked),
    )


def new_cache(params: Params, cfg: ModelConfig, b: int, cache_len: int, cache_dtype: Any,
              shard_ctx: Any) -> Any:
    """An empty KV cache for ``b`` rows, laid out on the mesh like the params (if any)."""
    per_layer = isinstance(params["layers"], (list, tuple))
    cache = decoder.init_cache(cfg, b, cache_len, cache_dtype, per_layer=per_layer)
    if shard_ctx is not None:
        mesh, rules = shard_ctx
        cache = jax.tree.map(
            lambda x, ax: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.spec(ax))),
            cache, decoder.cache_axes(cfg, per_layer=per_layer),
            is_leaf=lambda x: isinstance(x, jax.Array))
    return cache


def prefill(params: Params, tokens: jax.Array, mask: jax.Array, *, cfg: ModelConfig,
            shard_ctx: Any, cache_dtype: Any, cache_len: int,
            matmul_dtype: str | None = None) -> tuple[Any, jax.Array]:
    """Prefill one left-padded batch: (KV cache, float32 logits [B, V] of the last slot).
    ``matmul_dtype``: low-precision operands for the layers' weight matmuls (the last-slot
    logits keep ``cfg``'s)."""
    b = tokens.shape[0]
    cache = new_cache(params, cfg, b, cache_len, cache_dtype, shard_ctx)
    positions = decoder.positions_from_mask(mask)
    fcfg = cfg if matmul_dtype is None else cfg.replace(matmul_dtype=matmul_dtype)
    hidden, cache = decoder.forward(params, tokens, positions, fcfg, attn_mask=mask,
                                    cache=cache, cache_index=0, return_hidden=True,
                                    shard_ctx=shard_ctx)
    return cache, decoder.logits_from_hidden(hidden[:, -1], params, cfg)


def prefill_after(params: Params, prefix: Any, tokens: jax.Array, mask: jax.Array, *,
                  cfg: ModelConfig, shard_ctx: Any, cache_dtype: Any,
                  matmul_dtype: str | None = None) -> tuple[Any, jax.Array]:
    """Prefill one left-padded group of prompt *suffixes* after a shared prefix: ``prefix``
    is the cache of one row holding the prefix (``prefill`` of it, ``P`` slots, no padding).
    Returns the group's cache (``P + G`` slots: the prefix in slots ``[0, P)`` of every row,
    then each row's suffix, left-padded, so padding sits between prefix and suffix) and the
    float32 logits of its last slot. Positions continue the prefix's (``P + i``), so each
    row's keys, values and logits are those of its whole prompt prefilled alone."""
    g, n = tokens.shape
    P = prefix["mask"].shape[1]
    cache = new_cache(params, cfg, g, P + n, cache_dtype, shard_ctx)

    def put(full: jax.Array, pre: jax.Array) -> jax.Array:  # [(L,) B, KV, S, hd]
        pre = jax.lax.slice_in_dim(pre, 0, 1, axis=pre.ndim - 4)  # (a mesh's several rows)
        shape = (*full.shape[:-2], P, full.shape[-1])
        return jax.lax.dynamic_update_slice_in_dim(
            full, jnp.broadcast_to(pre, shape).astype(full.dtype), 0, axis=full.ndim - 2)

    cache = {"k": jax.tree.map(put, cache["k"], prefix["k"]),
             "v": jax.tree.map(put, cache["v"], prefix["v"]),
             "mask": cache["mask"].at[:, :P].set(True), "index": cache["index"]}
    positions = P + decoder.positions_from_mask(mask)
    fcfg = cfg if matmul_dtype is None else cfg.replace(matmul_dtype=matmul_dtype)
    hidden, cache = decoder.forward(params, tokens, positions, fcfg, attn_mask=mask,
                                    cache=cache, cache_index=P, return_hidden=True,
                                    shard_ctx=shard_ctx)
    return cache, decoder.logits_from_hidden(hidden[:, -1], params, cfg)


def empty_batch(params: Params, *, cfg: ModelConfig, shard_ctx: Any, cache_dtype: Any, b: int,
                cache_len: int) -> tuple[Any, jax.Array]:
    """A decode batch before ``place_rows`` fills it: an empty cache of ``b`` rows and zero
    float32 first-step logits [b, V]. A row no group fills (a padding row) keeps both; it
    is never returned, and its decode attends only to its own new tokens."""
    cache = new_cache(params, cfg, b, cache_len, cache_dtype, shard_ctx)
    return cache, jnp.zeros((b, cfg.vocab_size), jnp.float32)


def place_rows(cache: Any, logits: jax.Array, group_cache: Any, group_logits: jax.Array,
               src: Any, dst: Any, offset: Any) -> tuple[Any, jax.Array]:
    """Copy a prefilled group into a decode batch: batch row ``dst[i]`` gets group row
    ``src[i]``'s cache slots ``[0, G)`` at slots ``[offset, offset + G)`` and its logits.

    ``dst[i] >= B`` (the batch size) skips entry ``i``. Left padding moves with the row, so
    every prompt of the batch ends at the same slot (``offset + G``) and keeps its slot
    distances (causality, sliding windows); masked slots are never attended.

    Array by array: one small jitted copy per K/V array (every layer's has the same shape, so
    one compile serves them all) and one for the mask and logits, each donating what it
    overwrites. One program over the whole cache took 30 layers x 2 scatters per compile,
    ~1.5 s for each of the ~47 (batch, group) shapes of the embedded default's run (69 s of
    its 262 s of XLA compiles); the copies are the same.
    """
    src, dst, offset = jnp.asarray(src), jnp.asarray(dst), jnp.asarray(offset)

    def put(full: jax.Array, part: jax.Array) -> jax.Array:
        return _place_kv(full, part, src, dst, offset)

    new = {kv: jax.tree.map(put, cache[kv], group_cache[kv]) for kv in ("k", "v")}
    new["index"] = cache["index"]
    new["mask"], logits = _place_mask_logits(cache["mask"], logits, group_cache["mask"],
                                             group_logits, src, dst, offset)
    return new, logits


@functools.partial(jax.jit, donate_argnames=("full",))
def _place_kv(full: jax.Array, part: jax.Array, src: jax.Array, dst: jax.Array,
              offset: jax.Array) -> jax.Array:
    """One K/V array's share of ``place_rows``: full [B, KV, S, hd], part [g, KV, G, hd]
    (or both with a leading layer axis)."""
    if full.ndim == 5:
        return jax.vmap(lambda f, p: _place_kv(f, p, src, dst, offset))(full, part)
    slots = offset + jnp.arange(part.shape[2], dtype=jnp.int32)
    vals = jnp.swapaxes(jnp.take(part, src, axis=0), 1, 2)  # [R, G, KV, hd]
    return full.at[dst[:, None], :, slots[None, :], :].set(vals.astype(full.dtype), mode="drop")


@functools.partial(jax.jit, donate_argnames=("mask", "logits"))
def _place_mask_logits(mask: jax.Array, logits: jax.Array, g_mask: jax.Array,
                       g_logits: jax.Array, src: jax.Array, dst: jax.Array,
                       offset: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The key mask's and the first-step logits' share of ``place_rows``."""
    slots = offset + jnp.arange(g_mask.shape[1], dtype=jnp.int32)
    mask = mask.at[dst[:, None], slots[None, :]].set(jnp.take(g_mask, src, axis=0), mode="drop")
    return mask, logits.at[dst].set(jnp.take(g_logits, src, axis=0), mode="drop")


@functools.partial(jax.jit, static_argnames=("new_len",))
def _pad_slots(x: jax.Array, new_len: int) -> jax.Array:
    """``x`` with its slot axis (the last but one of K/V ``[..., S, hd]``; the last of a
    ``[B, S]`` key mask) padded at the end to ``new_len``: empty, masked slots."""
    axis = x.ndim - (1 if x.dtype == jnp.bool_ else 2)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, new_len - x.shape[axis])
    return jnp.pad(x, pad)


def grow_cache(cache: Any, new_len: int) -> Any:
    """The decode cache with ``new_len`` slots (more than it has): its slots unchanged, the
    new ones empty and masked, so a decode over it attends to the same keys.

    Array by array (one per layer with per-layer caches), each old array deleted once its
    copy is made: the growth holds the new cache plus one old array, not two caches.
    """
    def grow(x: jax.Array) -> jax.Array:
        y = _pad_slots(x, new_len)
        y.block_until_ready()
        x.delete()
        return y

    def grow_kv(kv: Any) -> Any:
        if isinstance(kv, (list, tuple)):
            return tuple(grow(x) for x in kv)
        return grow(kv)

    return {"k": grow_kv(cache["k"]), "v": grow_kv(cache["v"]), "mask": grow(cache["mask"]),
            "index": cache["index"]}


def decode_logits(params: Params, cache: Any, last: jax.Array, positions: jax.Array,
                  cache_index: jax.Array, *, cfg: ModelConfig,
                  shard_ctx: Any) -> tuple[Any, jax.Array]:
    """One cached decode forward of tokens ``last`` [B]: (cache, float32 logits [B, V])."""
    b = last.shape[0]
    hidden, cache = decoder.forward(
        params, last[:, None], positions, cfg, attn_mask=jnp.ones((b, 1), jnp.bool_),
        cache=cache, cache_index=cache_index, return_hidden=True, shard_ctx=shard_ctx)
    return cache, decoder.logits_from_hidden(hidden[:, 0], params, cfg)


def sample_masked(logits: jax.Array, bitmask: jax.Array, prompt_idx: jax.Array,
                  sample_idx: jax.Array, step: jax.Array, *, seed: jax.Array,
                  temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  needs_filter: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mask the logits by the ``[B, W]`` token bitmask, then sample as the fast path does
    (same keys); the logprob is that of the masked, renormalised distribution."""
    keys = sample_ops.row_keys(seed, prompt_idx, sample_idx, step)
    return sample_ops.sample_tokens(sample_ops.apply_token_bitmask(logits, bitmask), keys,
                                    temperature, top_k, top_p, needs_filter=needs_filter)


class DecodeState(NamedTuple):
    """The unconstrained decode's loop state, per row of a batch: ``step`` (the next step to
    sample; every row of a batch is at the same step), the last sampled tokens, the output
    buffers, which rows are done (stopped, or padding rows) and which stopped, and lengths."""

    step: jax.Array
    last: jax.Array
    out_tok: jax.Array
    out_lp: jax.Array
    done: jax.Array
    stopped: jax.Array
    lengths: jax.Array


def _sample_fn(seed: jax.Array, prompt_idx: jax.Array, sample_idx: jax.Array,
               temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
               needs_filter: jax.Array) -> Any:
    def sample(logits: jax.Array, step: jax.Array) -> tuple[jax.Array, jax.Array]:
        keys = sample_ops.row_keys(seed, prompt_idx, sample_idx, step)
        return sample_ops.sample_tokens(logits, keys, temperature, top_k, top_p,
                                        needs_filter=needs_filter)
    return sample


def _is_stop(tok: jax.Array, stop_ids: jax.Array) -> jax.Array:
    return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)


def decode_start(
    logits: jax.Array,
    prompt_idx: jax.Array,
    sample_idx: jax.Array,
    valid: jax.Array,
    *,
    seed: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    needs_filter: jax.Array,
    stop_ids: jax.Array,
    pad_id: int,
    out_len: int,
) -> DecodeState:
    """Sample a filled batch's first token from its last prompt slot's ``logits``: the state
    :func:`decode_batch` continues from (padding rows, ``~valid``, are done from the start)."""
    b = logits.shape[0]
    sample = _sample_fn(seed, prompt_idx, sample_idx, temperature, top_k, top_p, needs_filter)
    tok, lp = sample(logits, jnp.int32(0))
    stopped = _is_stop(tok, stop_ids) & valid
    return DecodeState(
        step=jnp.int32(1), last=tok,
        out_tok=jnp.full((b, out_len), pad_id, jnp.int32).at[:, 0].set(tok),
        out_lp=jnp.zeros((b, out_len), jnp.float32).at[:, 0].set(lp),
        done=stopped | ~valid, stopped=stopped, lengths=jnp.ones((b,), jnp.int32))


def decode_batch(
    params: Params,
    cache: Any,
    state: DecodeState,
    prompt_len: jax.Array,
    p_len: jax.Array,
    prompt_idx: jax.Array,
    sample_idx: jax.Array,
    *,
    seed: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    needs_filter: jax.Array,
    max_tokens: jax.Array,
    stop_ids: jax.Array,
    min_active: jax.Array,
    cfg: ModelConfig,
    pad_id: int,
    shard_ctx: Any,
) -> tuple[DecodeState, Any]:
    """Decode a filled batch from ``state`` (every prompt ends at cache slot ``p_len - 1``;
    ``prompt_len`` the real prompt lengths, the positions' origin): a ``while_loop`` of cached
    one-token forwards that exits once every row is done, the step reaches ``max_tokens``, or
    no more than ``min_active`` rows are still going (0: run to the end), so the caller can
    go on with those rows alone in a smaller batch (``take_rows``). Returns (state, cache):
    the cache is returned so that the donated input buffer is the loop's (no copy)."""
    b = state.last.shape[0]
    sample = _sample_fn(seed, prompt_idx, sample_idx, temperature, top_k, top_p, needs_filter)

    def cond(carry):
        st, _ = carry
        return (st.step < max_tokens) & (jnp.sum(~st.done) > min_active)

    def body(carry):
        st, cache = carry
        step = st.step
        pos = (prompt_len + step - 1)[:, None]
        hidden, cache = decoder.forward(
            params, st.last[:, None], pos, cfg, attn_mask=jnp.ones((b, 1), jnp.bool_),
            cache=cache, cache_index=p_len + step - 1, return_hidden=True, shard_ctx=shard_ctx)
        logits = decoder.logits_from_hidden(hidden[:, 0], params, cfg)
        tok, lp = sample(logits, step)
        active = ~st.done
        col_t = jnp.where(active, tok, pad_id)
        col_l = jnp.where(active, lp, 0.0)
        hit = active & _is_stop(tok, stop_ids)
        return DecodeState(
            step=step + 1, last=tok,
            out_tok=jax.lax.dynamic_update_slice(st.out_tok, col_t[:, None], (0, step)),
            out_lp=jax.lax.dynamic_update_slice(st.out_lp, col_l[:, None], (0, step)),
            done=st.done | hit, stopped=st.stopped | hit,
            lengths=jnp.where(active, step + 1, st.lengths)), cache

    state, cache = jax.lax.while_loop(cond, body, (state, cache))
    return state, cache


@jax.jit
def _take(x: jax.Array, rows: jax.Array) -> jax.Array:
    return jnp.take(x, rows, axis=0)


def take_rows(tree: Any, rows: np.ndarray) -> Any:
    """``tree`` (a decode cache or state) with its batch axis cut to ``rows`` (in that order):
    the rows a smaller batch goes on with. Array by array (one small jitted gather per array
    shape; K/V arrays with a leading layer axis are gathered on their second axis), each old
    array deleted once its rows are copied, so the cut holds the new arrays plus one old one.
    The cache's write index is shared by all rows and kept as it is."""
    idx = jnp.asarray(rows, jnp.int32)

    def cut(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.ndim == 0:
            return x
        y = jax.vmap(_take, in_axes=(0, None))(x, idx) if x.ndim == 5 else _take(x, idx)
        y.block_until_ready()
        x.delete()
        return y

    if isinstance(tree, dict):  # the cache: k/v (stacked or per layer), mask; index kept
        return {k: (v if k == "index" else jax.tree.map(cut, v)) for k, v in tree.items()}
    return jax.tree.map(cut, tree)
