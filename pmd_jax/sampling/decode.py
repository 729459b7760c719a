"""The jitted programs of the in-process JAX sampler (``jax_sampler.JaxSampler``).

``compiled_generate``: prefill + ``while_loop`` decode of one padded batch in one program
(``generate_batch``). ``compiled_constrained``: the three pieces of the host-driven
grammar-constrained loop (``prefill``, one cached ``decode_logits`` step, and
``sample_masked``). Both are cached per (model config, mesh, cache dtype) and shared by
every sampler of that model. See ``jax_sampler``'s module docstring for the algorithm.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from pmd_jax.models import decoder
from pmd_jax.models.config import ModelConfig
from pmd_jax.sampling import sample_ops

Params = Any


@functools.lru_cache(maxsize=32)
def compiled_generate(cfg: ModelConfig, pad_id: int, shard_ctx: Any, cache_dtype: Any):
    """One jitted program family per (config, pad id, mesh, cache dtype), shared by samplers."""
    return jax.jit(
        functools.partial(generate_batch, cfg=cfg, pad_id=pad_id, shard_ctx=shard_ctx,
                          cache_dtype=cache_dtype),
        static_argnames=("cache_len", "out_len"),
    )


class ConstrainedFns(NamedTuple):
    prefill: Any
    step: Any
    sample: Any


@functools.lru_cache(maxsize=32)
def compiled_constrained(cfg: ModelConfig, shard_ctx: Any, cache_dtype: Any) -> ConstrainedFns:
    """The three jitted pieces of the constrained loop, shared by samplers of one model.

    ``step`` donates the KV cache (updated in place). None of them depends on the grammar.
    """
    return ConstrainedFns(
        prefill=jax.jit(functools.partial(prefill, cfg=cfg, shard_ctx=shard_ctx,
                                          cache_dtype=cache_dtype),
                        static_argnames=("cache_len",)),
        step=jax.jit(functools.partial(decode_logits, cfg=cfg, shard_ctx=shard_ctx),
                     donate_argnames=("cache",)),
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
            shard_ctx: Any, cache_dtype: Any, cache_len: int) -> tuple[Any, jax.Array]:
    """Prefill one left-padded batch: (KV cache, float32 logits [B, V] of the last slot)."""
    b = tokens.shape[0]
    cache = new_cache(params, cfg, b, cache_len, cache_dtype, shard_ctx)
    positions = decoder.positions_from_mask(mask)
    hidden, cache = decoder.forward(params, tokens, positions, cfg, attn_mask=mask, cache=cache,
                                    cache_index=0, return_hidden=True, shard_ctx=shard_ctx)
    return cache, decoder.logits_from_hidden(hidden[:, -1], params, cfg)


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


def generate_batch(
    params: Params,
    tokens: jax.Array,
    mask: jax.Array,
    prompt_idx: jax.Array,
    sample_idx: jax.Array,
    valid: jax.Array,
    *,
    seed: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    needs_filter: jax.Array,
    max_tokens: jax.Array,
    stop_ids: jax.Array,
    cfg: ModelConfig,
    pad_id: int,
    shard_ctx: Any,
    cache_dtype: Any,
    cache_len: int,
    out_len: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Prefill + decode one padded batch. Returns (tokens, logprobs, lengths, stopped)."""
    b, p_len = tokens.shape
    cache = new_cache(params, cfg, b, cache_len, cache_dtype, shard_ctx)
    positions = decoder.positions_from_mask(mask)
    prompt_len = jnp.sum(mask, axis=-1, dtype=jnp.int32)

    def sample(logits, step):
        keys = sample_ops.row_keys(seed, prompt_idx, sample_idx, step)
        return sample_ops.sample_tokens(logits, keys, temperature, top_k, top_p,
                                        needs_filter=needs_filter)

    def is_stop(tok):
        return jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)

    # ---- prefill: the last slot is always a real token (left padding)
    hidden, cache = decoder.forward(params, tokens, positions, cfg, attn_mask=mask, cache=cache,
                                    cache_index=0, return_hidden=True, shard_ctx=shard_ctx)
    logits = decoder.logits_from_hidden(hidden[:, -1], params, cfg)
    tok, lp = sample(logits, jnp.int32(0))
    out_tok = jnp.full((b, out_len), pad_id, jnp.int32).at[:, 0].set(tok)
    out_lp = jnp.zeros((b, out_len), jnp.float32).at[:, 0].set(lp)
    stopped = is_stop(tok) & valid
    done = stopped | ~valid
    lengths = jnp.ones((b,), jnp.int32)

    def cond(state):
        step, _, _, _, _, done, _, _ = state
        return (step < max_tokens) & ~jnp.all(done)

    def body(state):
        step, cache, last, out_tok, out_lp, done, stopped, lengths = state
        pos = (prompt_len + step - 1)[:, None]
        hidden, cache = decoder.forward(
            params, last[:, None], pos, cfg, attn_mask=jnp.ones((b, 1), jnp.bool_), cache=cache,
            cache_index=p_len + step - 1, return_hidden=True, shard_ctx=shard_ctx)
        logits = decoder.logits_from_hidden(hidden[:, 0], params, cfg)
        tok, lp = sample(logits, step)
        active = ~done
        col_t = jnp.where(active, tok, pad_id)
        col_l = jnp.where(active, lp, 0.0)
        out_tok = jax.lax.dynamic_update_slice(out_tok, col_t[:, None], (0, step))
        out_lp = jax.lax.dynamic_update_slice(out_lp, col_l[:, None], (0, step))
        lengths = jnp.where(active, step + 1, lengths)
        hit = active & is_stop(tok)
        return (step + 1, cache, tok, out_tok, out_lp, done | hit, stopped | hit, lengths)

    state = (jnp.int32(1), cache, tok, out_tok, out_lp, done, stopped, lengths)
    _, _, _, out_tok, out_lp, _, stopped, lengths = jax.lax.while_loop(cond, body, state)
    return out_tok, out_lp, lengths, stopped
