"""Rotary position embeddings, computed exactly like HF transformers' ``modeling_rope_utils``.

Supported ``rope_type`` values: ``default``, ``linear``, ``llama3`` and ``yarn`` (the ones the
Llama / Qwen3 / OLMo-3 checkpoints we target use); ``ModelConfig`` refuses any other type when
it is built, so e.g. ``dynamic`` fails at config load, never at the first forward. The inverse
frequencies are computed on the host in float32 with the same operations HF uses; cos / sin are
built from ``positions`` inside the jitted forward (float32, ``cat(freqs, freqs)`` layout,
times the attention scaling), and applied with HF's ``rotate_half`` convention (not the
interleaved one).

Per-layer-type RoPE (OLMo-3: yarn on full-attention layers, default on sliding layers) is
expressed as a small table of inverse frequencies, one row per layer type, plus an integer per
layer that selects its row; the decoder scans over that integer, never over Python branches.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from pmd_jax.models.config import ROPE_TYPES, ModelConfig, RopeConfig, UnsupportedModelConfig


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    # HF: 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)


def inv_freq_and_scaling(
    rope: RopeConfig, head_dim: int, max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the cos/sin scaling factor."""
    dim = head_dim
    kind = rope.rope_type
    if kind == "default":
        return _base_inv_freq(rope.theta, dim), 1.0
    if kind == "linear":
        return (_base_inv_freq(rope.theta, dim) / np.float32(rope.factor)).astype(np.float32), 1.0
    if kind == "llama3":
        inv_freq = _base_inv_freq(rope.theta, dim)
        factor = rope.factor
        old_ctx = rope.original_max_position_embeddings or max_position_embeddings
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = (np.float32(2 * math.pi) / inv_freq).astype(np.float32)
        inv_llama = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(is_medium, smoothed, inv_llama).astype(np.float32), 1.0
    if kind == "yarn":
        base = rope.theta
        orig = rope.original_max_position_embeddings or max_position_embeddings
        factor = rope.factor if rope.factor else max_position_embeddings / orig

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        attention_factor = (
            float(rope.attention_factor) if rope.attention_factor is not None
            else get_mscale(factor)
        )
        beta_fast = rope.beta_fast or 32
        beta_slow = rope.beta_slow or 1

        def correction_dim(num_rot: float) -> float:
            return (dim * math.log(orig / (num_rot * 2 * math.pi))) / (2 * math.log(base))

        low = correction_dim(beta_fast)
        high = correction_dim(beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        pos_freqs = (np.float32(base) ** (
            np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(np.float32)
        inv_extra = (np.float32(1.0) / pos_freqs).astype(np.float32)
        inv_inter = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
        ramp = np.clip(
            (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low),
            0, 1,
        ).astype(np.float32)
        extra_factor = (1 - ramp).astype(np.float32)
        inv = inv_inter * (1 - extra_factor) + inv_extra * extra_factor
        return inv.astype(np.float32), float(attention_factor)
    raise UnsupportedModelConfig("model.rope.rope_type", kind,
                                 f"the decoder implements rope_type in {ROPE_TYPES}")


def layer_type_names(cfg: ModelConfig) -> tuple[str, ...]:
    """The distinct layer types, in a fixed (sorted) order: row order of ``rope_tables``."""
    if cfg.layer_types is None:
        return ("full_attention",)
    return tuple(sorted(set(cfg.layer_types)))


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inv_freq [n_types, head_dim//2] f32, scaling [n_types] f32, type index per layer [L])."""
    names = layer_type_names(cfg)
    invs, scales = [], []
    for name in names:
        inv, scale = inv_freq_and_scaling(
            cfg.rope_for(name), cfg.head_dim, cfg.max_position_embeddings
        )
        invs.append(inv)
        scales.append(scale)
    idx = np.array([names.index(cfg.layer_type(i)) for i in range(cfg.num_layers)], np.int32)
    return np.stack(invs), np.asarray(scales, np.float32), idx


def cos_sin(positions: jnp.ndarray, inv_freq: jnp.ndarray, scaling: jnp.ndarray):
    """cos, sin of shape [..., T, head_dim] (float32) for integer ``positions`` [..., T].

    ``inv_freq`` is [n, head_dim//2] and ``scaling`` [n]; the result gets a leading n axis.
    """
    freqs = positions.astype(jnp.float32)[None, ..., None] * inv_freq.reshape(
        (inv_freq.shape[0],) + (1,) * positions.ndim + (inv_freq.shape[1],)
    )
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    scale = scaling.reshape((-1,) + (1,) * (emb.ndim - 1))
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def rotate_half(x: jnp.ndarray) -> jnp.ndarray:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x [B, T, H, hd]; cos/sin [B, T, hd] (float32). Returns x's dtype."""
    c = cos[:, :, None, :]
    s = sin[:, :, None, :]
    xf = x.astype(jnp.float32) if x.dtype != cos.dtype else x
    out = xf * c + rotate_half(xf) * s
    return out.astype(x.dtype)
