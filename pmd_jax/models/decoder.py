"""One pure-functional decoder for Llama (SmolLM2), Qwen2 (Qwen2.5-Coder), Qwen3 and OLMo-3.

Params are an explicit pytree (``param_shapes`` / ``param_axes`` give its shapes and logical
axis names); the layers are stacked on a leading ``layers`` axis and the forward runs
``jax.lax.scan`` over them, so compile time does not grow with depth. Everything that differs
between layers (sliding window or not, which RoPE table) is a per-layer array scanned with the
weights, never a Python branch over layers. For decoding, ``unstack_layers`` splits the
stacked arrays into per-layer arrays and the forward then loops over layers in Python (larger
program, but every weight is read in place; see ``unstack_layers``).

Param layout: every weight (shape, logical axes, init, HF name and layout, GGUF name) is
declared once in :func:`pmd_jax.models.weights.declare`; ``param_shapes``, ``param_axes``,
``init_params`` and ``check_params`` here and the HF / GGUF maps are derived from it. The
forward is :func:`decoder_layer` (one layer) run by ``_scanned_layers`` (``lax.scan`` over
the stacked weights) or ``_unrolled_layers`` (a Python loop over per-layer weights).
LoRA adapters (:mod:`pmd_jax.models.lora`) are a second, layer-stacked tree passed as
``forward(..., adapters=, lora=)``; their tensors join each layer's weight dict and
``decoder_layer`` adds ``scaling * ((x A) B)`` to the projections they target.

Attention masks: ``attn_mask`` [B, T] marks real tokens (1) and padding (0); padding keys are
never attended. Causality and sliding windows are over token slots (HF semantics: a key at slot
j is visible from slot i iff j <= i and, on sliding layers, i - j < window). ``positions`` are
given by the caller (for left padding: cumsum of the mask - 1). ``segment_ids`` (packing)
restricts attention to equal ids; with ``shared_prefix`` segment 0 is a prefix that every
segment of its row also sees (one prompt and several continuations of it in one row, each
continuation its own id >= 1 and positions that go on from the prefix's). With a KV cache,
slots are cache slots: ``cache_index`` (or the cache's own ``index``) is where the T new tokens
are written.

Attention implementations (``cfg.attention_impl`` or ``forward(..., attention_impl=)``):
"dense" builds the [B, T, S] mask and [B, KV, G, T, S] float32 scores; "chunked"
(:func:`pmd_jax.models.attention.chunked_attention`) computes each (query chunk, key chunk)
tile's mask from slot indices and runs an online softmax, so no array has two sequence axes
(forward and backward); "cudnn" / "cudnn_xla" / "splash" are library kernels
(:mod:`pmd_jax.models.attention_fused`); "auto" picks per backend and call
(:mod:`pmd_jax.models.attention_select`: on CPU chunked when T * S > 1024^2, else dense; the
per-layer closures are built in :mod:`pmd_jax.models.attend`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding

from pmd_jax.models import attend, matmul, weights
from pmd_jax.models import attention as attn_lib
from pmd_jax.models import lora as lora_lib
from pmd_jax.models import remat as remat_lib
from pmd_jax.models import rope as rope_lib
from pmd_jax.models.config import ModelConfig
from pmd_jax.models.lora import LoraConfig
from pmd_jax.models.remat import QKV_NAMES
from pmd_jax.models.weights import INIT_STD, ParamError

Params = dict[str, Any]
_BIG_WINDOW = attend.BIG_WINDOW
def _dtype(name: str) -> jnp.dtype:
    return jnp.dtype(name)


# --------------------------------------------------------------------------- layout
def param_axes(cfg: ModelConfig) -> Params:
    """Param tree of logical axis names (see ``weights.declare``)."""
    return weights.axes_tree(cfg)


def _raw_shapes(cfg: ModelConfig) -> Params:
    return weights.shape_tree(cfg)


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def param_shapes(cfg: ModelConfig) -> Params:
    dt = _dtype(cfg.param_dtype)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dt), _raw_shapes(cfg), is_leaf=_is_shape)


def check_params(params: Params, cfg: ModelConfig, *, adapters: Params | None = None,
                 lora: LoraConfig | None = None) -> None:
    """Raise ParamError naming the first tensor that is missing, extra or mis-shaped.

    With LoRA ``adapters`` (and their ``lora`` config, see :mod:`pmd_jax.models.lora`) the
    adapter tree is checked too, its tensors named ``adapters/layers/<key>``."""
    if (adapters is None) != (lora is None):
        raise ParamError("LoRA adapters and their LoraConfig go together: pass both or neither "
                         f"(adapters {'given' if adapters is not None else 'missing'}, lora "
                         f"{'given' if lora is not None else 'missing'})")
    weights.check_base(params, cfg)
    if adapters is not None and lora is not None:
        lora_lib.check_adapters(adapters, cfg, lora)


def unstack_layers(params: Params) -> Params:
    """The same params with ``layers`` split into a tuple of per-layer dicts.

    ``forward`` then runs a Python loop over layers instead of a scan. A scan reads each
    layer's weights through a dynamic slice of the stacked arrays, which XLA:CPU materialises
    as a copy (the whole model copied once per decoded token); separate per-layer arrays are
    read in place. That matters most when memory bandwidth is contended. Costs one extra copy
    of the layer weights.
    Sharded arrays keep their sharding (minus the layers axis).
    """
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = jax.tree.leaves(layers)[0].shape[0]
    out = dict(params)
    if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(layers)):
        # inside jit/grad: one split per weight, whose transpose is a single concatenate
        # (per-layer a[i] would transpose to n full-size zero pads summed together)
        parts = jax.tree.map(
            lambda a: [x[0] for x in jax.lax.split(a, [1] * n, axis=0)], layers)
        out["layers"] = tuple(jax.tree.map(lambda ps, i=i: ps[i], parts,
                                           is_leaf=lambda x: isinstance(x, list))
                              for i in range(n))
        return out
    out["layers"] = tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n))
    return out


def stack_layers(params: Params) -> Params:
    """Inverse of :func:`unstack_layers`."""
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)):
        return params
    out = dict(params)
    out["layers"] = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    return out


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Random params with HF's init: normal(0, 0.02) weights, zero biases, unit norms."""
    return _init_params_jit(cfg, key)


@jax.jit(static_argnums=0)
def _init_params_jit(cfg: ModelConfig, key: jax.Array) -> Params:
    shapes = _raw_shapes(cfg)
    inits = weights.init_tree(cfg)
    dt = _dtype(cfg.param_dtype)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)
    keys = jax.random.split(key, len(flat))  # one key per leaf, in tree order, used or not
    leaves = []
    for (path, shape), k in zip(flat, keys):
        init = _get(inits, path)
        if init == "ones":
            leaves.append(jnp.ones(shape, dt))
        elif init == "zeros":
            leaves.append(jnp.zeros(shape, dt))
        else:
            leaves.append((INIT_STD * jax.random.normal(k, shape, jnp.float32)).astype(dt))
    return jax.tree.unflatten(treedef, leaves)


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        tree = tree[k.key]
    return tree


def unembed_matrix(params: Params, cfg: ModelConfig) -> jnp.ndarray:
    return params["embed"].T if cfg.tie_embeddings else params["lm_head"]


def logits_from_hidden(hidden: jnp.ndarray, params: Params, cfg: ModelConfig) -> jnp.ndarray:
    """hidden [..., D] (after the final norm) -> float32 logits [..., V].

    One 2-D matmul (XLA:CPU is faster on a plain [N, D] x [D, V] dot than on a batched
    einsum); when tied, the embedding is contracted on its D axis without a transpose.
    With ``cfg.matmul_dtype``, or hidden states in bfloat16 / float16 (a bf16 model), the
    product is :func:`pmd_jax.models.matmul.lowp_einsum` in that dtype: the same forward
    (fp32 accumulation, fp32 logits) and a backward whose dX and dW are GEMMs in that dtype
    too, not an fp32 cotangent against bf16 operands (fp32 / TF32; MaxText's
    ``logits_dot_in_fp32=False``, ``cast_logits_to_fp32=True``). float32 hidden states take
    the plain fp32 dot, as before.
    """
    lowp = cfg.matmul_dtype or (hidden.dtype.name if hidden.dtype.name in matmul.LOWP_DTYPES
                                else None)
    if lowp is not None:  # N-D einsum: its dW takes XLA's fast layout
        w = params["embed"] if cfg.tie_embeddings else params["lm_head"]
        spec = "...d,vd->...v" if cfg.tie_embeddings else "...d,dv->...v"
        return matmul.lowp_einsum(spec, hidden, w, lowp)
    lead, d = hidden.shape[:-1], hidden.shape[-1]
    h2 = hidden.reshape(-1, d)
    if cfg.tie_embeddings:
        w = params["embed"].astype(hidden.dtype)
        out = jax.lax.dot_general(h2, w, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32)
    else:
        w = params["lm_head"].astype(hidden.dtype)
        out = jnp.dot(h2, w, preferred_element_type=jnp.float32)
    return out.reshape(*lead, out.shape[-1])


# --------------------------------------------------------------------------- KV cache
def init_cache(
    cfg: ModelConfig, batch: int, max_len: int, dtype: Any = None, *, per_layer: bool = False
) -> dict[str, Any]:
    """Empty KV cache: k/v [L, B, KV, S, hd] (or, ``per_layer``, a tuple of L arrays
    [B, KV, S, hd], for params split by :func:`unstack_layers`), key mask [B, S], write index.

    Keys/values are stored heads-major so attention reads them without a transpose.
    """
    dt = _dtype(cfg.dtype) if dtype is None else jnp.dtype(dtype)
    one = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    if per_layer:
        k: Any = tuple(jnp.zeros(one, dt) for _ in range(cfg.num_layers))
        v: Any = tuple(jnp.zeros(one, dt) for _ in range(cfg.num_layers))
    else:
        k = jnp.zeros((cfg.num_layers, *one), dt)
        v = jnp.zeros((cfg.num_layers, *one), dt)
    return {
        "k": k,
        "v": v,
        "mask": jnp.zeros((batch, max_len), jnp.bool_),
        "index": jnp.zeros((), jnp.int32),
    }


def cache_axes(cfg: ModelConfig, *, per_layer: bool = False) -> dict[str, Any]:
    one = ("batch", "kv_heads", "cache_seq", "head_dim")
    kv: Any = tuple(one for _ in range(cfg.num_layers)) if per_layer else ("layers", *one)
    return {"k": kv, "v": kv, "mask": ("batch", "cache_seq"), "index": ()}


# --------------------------------------------------------------------------- pieces
def rms_norm(x: jnp.ndarray, w: jnp.ndarray, eps: float) -> jnp.ndarray:
    """HF RMSNorm: float32 statistics, weight applied in float32, cast back to x.dtype."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    return (w.astype(jnp.float32) * (xf * jax.lax.rsqrt(var + eps))).astype(x.dtype)


def _rms_norm_heads(x: jnp.ndarray, w: jnp.ndarray, eps: float) -> jnp.ndarray:
    """RMSNorm over the whole projection (heads x head_dim) of x [B, T, H, hd]; w [H*hd]."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(xf), axis=(-2, -1), keepdims=True)
    w = w.astype(jnp.float32).reshape(x.shape[-2:])
    return (w * (xf * jax.lax.rsqrt(var + eps))).astype(x.dtype)


attention = attn_lib.dense_attention  # the dense reference (materialised [B, T, S] mask)


def silu(x: jnp.ndarray) -> jnp.ndarray:
    """x / (1 + exp(-x)): measurably more accurate in float32 on XLA:CPU than jax.nn.silu
    (x * logistic(x)); on the real SmolLM2 weights it cut the logit error vs a float64
    reference from 2.5e-4 to 8e-5."""
    return x / (1 + jnp.exp(-x))


ShardCtx = tuple[Any, Any]  # (jax.sharding.Mesh, pmd_jax.run.sharding.ShardingRules)


def _constrain(x: jnp.ndarray, axes: tuple[str | None, ...], ctx: ShardCtx | None):
    if ctx is None:
        return x

    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.spec(axes)))


# --------------------------------------------------------------------------- one layer
def _project(mm: Callable, spec: str, h: jnp.ndarray, p: Params, name: str,
             lora_scaling: float | None) -> jnp.ndarray:
    """``h`` times the weight ``p[name]`` (``spec``), plus the LoRA path
    ``lora_scaling * ((h A) B)`` when the layer holds ``<name>_lora_a`` / ``<name>_lora_b``."""
    y = mm(spec, h, p[name])
    a_key = lora_lib.adapter_key(name, "a")
    if a_key not in p:
        return y
    if lora_scaling is None:
        raise ValueError(f"layer weights hold {a_key} but no lora_scaling was given")
    spec_a, spec_b = lora_lib.SPECS[name]
    return y + lora_scaling * mm(spec_b, mm(spec_a, h, p[a_key]),
                                 p[lora_lib.adapter_key(name, "b")])


def decoder_layer(
    x: jnp.ndarray,
    p: Params,
    cos: jnp.ndarray,
    sin: jnp.ndarray,
    attend: Callable,
    kv_update: Callable | None,
    cfg: ModelConfig,
    shard_ctx: ShardCtx | None = None,
    lora_scaling: float | None = None,
) -> jnp.ndarray:
    """One decoder layer: x [B, T, D] -> x [B, T, D]; ``p`` is this layer's weights.

    ``cos``/``sin`` are the layer's RoPE tables at the tokens' positions. ``attend(q, k, v)`` is
    the layer's masked attention (see ``attend.attend_fn``). ``kv_update(k, v)`` (k/v [B,KV,T,hd])
    writes the new keys and values into the cache and returns the layer's full cached k/v; None
    without a cache. A projection whose LoRA adapter is in ``p`` (``q_lora_a``, ``q_lora_b``,
    ...; :mod:`pmd_jax.models.lora`) adds ``lora_scaling * ((h A) B)``.
    """
    dt = _dtype(cfg.dtype)
    eps = cfg.rms_norm_eps
    mm = functools.partial(matmul.weight_einsum, matmul_dtype=cfg.matmul_dtype)
    proj = functools.partial(_project, mm, lora_scaling=lora_scaling)
    p = jax.tree.map(lambda a: a.astype(dt), p)
    h = rms_norm(x, p["attn_norm"], eps) if cfg.norm_placement == "pre" else x
    q = proj("btd,dhk->bthk", h, p, "q")
    k = proj("btd,dhk->bthk", h, p, "k")
    v = proj("btd,dhk->bthk", h, p, "v")
    if cfg.attention_bias or cfg.qkv_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    # (names for the remat policies: identities that a policy may save or offload)
    q, k, v = (checkpoint_name(t, n) for t, n in zip((q, k, v), QKV_NAMES))
    if cfg.qk_norm == "per_head":
        q, k = rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps)
    elif cfg.qk_norm == "full":
        q, k = _rms_norm_heads(q, p["q_norm"], eps), _rms_norm_heads(k, p["k_norm"], eps)
    q = _constrain(q, ("batch", "seq", "heads", "head_dim"), shard_ctx)
    q = rope_lib.apply_rope(q, cos, sin)
    k = rope_lib.apply_rope(k, cos, sin)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if kv_update is not None:
        k, v = kv_update(k, v)
    a = checkpoint_name(attend(q, k, v), "context")
    a = proj("bthk,hkd->btd", a, p, "o")
    if cfg.attention_bias:
        a = a + p["o_bias"]
    a = checkpoint_name(a, "out_proj")
    if cfg.norm_placement == "post":
        a = rms_norm(a, p["attn_norm"], eps)
    x = _constrain(x + a, ("batch", "seq", "embed"), shard_ctx)

    # MLP (SwiGLU)
    h = rms_norm(x, p["mlp_norm"], eps) if cfg.norm_placement == "pre" else x
    g = checkpoint_name(proj("btd,df->btf", h, p, "gate"), "mlpwi_0")
    u = checkpoint_name(proj("btd,df->btf", h, p, "up"), "mlpwi_1")
    m = _constrain(silu(g) * u, ("batch", "seq", "mlp"), shard_ctx)
    m = checkpoint_name(proj("btf,fd->btd", m, p, "down"), "mlpwo")
    if cfg.norm_placement == "post":
        m = rms_norm(m, p["mlp_norm"], eps)
    return _constrain(x + m, ("batch", "seq", "embed"), shard_ctx)


class _Layers(NamedTuple):
    """What every layer of one forward call shares: the layer function (config and sharding
    bound), the attention factory and the per-layer tables (window, RoPE table index)."""

    layer: Callable  # decoder_layer with cfg and shard_ctx bound
    attend_fn: Callable  # window -> attend(q, k, v)
    cos_all: jnp.ndarray  # [n_rope_tables, B, T, hd]
    sin_all: jnp.ndarray
    rope_idx: np.ndarray  # [L] which RoPE table each layer uses
    windows: np.ndarray  # [L] sliding window, _BIG_WINDOW for full attention
    dt: Any  # compute dtype


# --------------------------------------------------------------------------- drivers
def _unrolled_layers(
    x: jnp.ndarray, layer_params: Sequence[Params], ls: _Layers, remat: str,
    cache: dict[str, Any] | None, idx: jnp.ndarray | None,
) -> tuple[jnp.ndarray, tuple[list, list]]:
    """Python loop over separate per-layer arrays (see unstack_layers): every weight and cache
    buffer is read in place; the window and RoPE table of each layer are static. Returns x and
    the layers' updated cache k/v (empty lists without a cache)."""
    ks: list[jnp.ndarray] = []
    vs: list[jnp.ndarray] = []
    for i, p in enumerate(layer_params):
        attend = ls.attend_fn(int(ls.windows[i]))
        cos, sin = ls.cos_all[int(ls.rope_idx[i])], ls.sin_all[int(ls.rope_idx[i])]
        kv_update = None
        if cache is not None:
            def kv_update(k, v, i=i):
                ks.append(jax.lax.dynamic_update_slice(
                    cache["k"][i], k.astype(cache["k"][i].dtype), (0, 0, idx, 0)))
                vs.append(jax.lax.dynamic_update_slice(
                    cache["v"][i], v.astype(cache["v"][i].dtype), (0, 0, idx, 0)))
                return ks[-1].astype(ls.dt), vs[-1].astype(ls.dt)
        if cache is None:
            # (attend is a closure, not an array: close over it inside the remat)
            def layer(x, p, cos, sin, attend=attend):
                return ls.layer(x, p, cos, sin, attend, None)

            x = remat_lib.remat(layer, remat, prevent_cse=True)(x, p, cos, sin)
        else:
            x = ls.layer(x, p, cos, sin, attend, kv_update)
    return x, (ks, vs)


def _scanned_layers(
    x: jnp.ndarray, layer_params: Params, ls: _Layers, remat: str, unroll: int | bool,
    cache: dict[str, Any] | None, idx: jnp.ndarray | None,
) -> tuple[jnp.ndarray, tuple[Any, Any]]:
    """``lax.scan`` over the layer-stacked weights (window and RoPE table index scanned with
    them). Returns x and the updated stacked cache k/v (None, None without a cache)."""
    xs: dict[str, Any] = {
        "p": layer_params,
        "window": jnp.asarray(ls.windows),
        "rope": jnp.asarray(ls.rope_idx),
    }

    # With a cache, the stacked [L, B, KV, S, hd] buffers ride in the scan carry and each
    # layer writes its new keys/values in place (a scanned output would copy the whole
    # cache on every decode step).
    def body(carry: Any, xs: dict[str, Any]):
        cos = jax.lax.dynamic_index_in_dim(ls.cos_all, xs["rope"], 0, keepdims=False)
        sin = jax.lax.dynamic_index_in_dim(ls.sin_all, xs["rope"], 0, keepdims=False)
        attend = ls.attend_fn(xs["window"])
        if cache is None:
            return ls.layer(carry, xs["p"], cos, sin, attend, None), None
        x, ck_all, cv_all, li = carry
        out: dict[str, jnp.ndarray] = {}

        def kv_update(k, v):
            out["k"] = jax.lax.dynamic_update_slice(
                ck_all, k.astype(ck_all.dtype)[None], (li, 0, 0, idx, 0))
            out["v"] = jax.lax.dynamic_update_slice(
                cv_all, v.astype(cv_all.dtype)[None], (li, 0, 0, idx, 0))
            return (
                jax.lax.dynamic_index_in_dim(out["k"], li, 0, keepdims=False).astype(ls.dt),
                jax.lax.dynamic_index_in_dim(out["v"], li, 0, keepdims=False).astype(ls.dt))

        x = ls.layer(x, xs["p"], cos, sin, attend, kv_update)
        return (x, out["k"], out["v"], li + 1), None

    step = remat_lib.remat(body, remat)
    if cache is not None:
        carry0 = (x, cache["k"], cache["v"], jnp.int32(0))
        (x, ck_new, cv_new, _), _ = jax.lax.scan(step, carry0, xs, unroll=unroll)
        return x, (ck_new, cv_new)
    x, _ = jax.lax.scan(step, x, xs, unroll=unroll)
    return x, (None, None)


# --------------------------------------------------------------------------- forward
def _check_inputs(params: Params, tokens: jnp.ndarray, positions: jnp.ndarray,
                  cfg: ModelConfig, attn_mask: Any, segment_ids: Any, cache: Any,
                  adapters: Params | None = None, lora: LoraConfig | None = None) -> None:
    check_params(params, cfg, adapters=adapters, lora=lora)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    if positions.shape != tokens.shape:
        raise ValueError(f"positions shape {positions.shape} != tokens shape {tokens.shape}")
    if attn_mask is not None and attn_mask.shape != tokens.shape:
        raise ValueError(f"attn_mask shape {attn_mask.shape} != tokens shape {tokens.shape}")
    if segment_ids is not None and segment_ids.shape != tokens.shape:
        raise ValueError(f"segment_ids shape {segment_ids.shape} != tokens shape {tokens.shape}")
    if segment_ids is not None and cache is not None:
        raise ValueError("segment_ids (packed sequences) cannot be combined with a KV cache")
    per_layer = isinstance(params["layers"], (list, tuple))
    if cache is not None and isinstance(cache["k"], (list, tuple)) != per_layer:
        raise ValueError(
            "params and cache layouts differ: use init_cache(..., per_layer=True) with params "
            "split by unstack_layers, and a stacked cache with stacked params")


def forward(
    params: Params,
    tokens: jnp.ndarray,
    positions: jnp.ndarray,
    cfg: ModelConfig,
    *,
    attn_mask: jnp.ndarray | None = None,
    segment_ids: jnp.ndarray | None = None,
    shared_prefix: bool = False,
    cache: dict[str, jnp.ndarray] | None = None,
    cache_index: jnp.ndarray | int | None = None,
    return_hidden: bool = False,
    remat: str = "none",
    shard_ctx: ShardCtx | None = None,
    unroll: int | bool = 1,
    attention_impl: str | None = None,
    adapters: Params | None = None,
    lora: LoraConfig | None = None,
    right_padded: bool = False,
) -> tuple[jnp.ndarray, dict[str, Any] | None]:
    """Run the decoder: embed, the layers (``decoder_layer``, scanned over stacked weights or
    looped over per-layer ones), final norm, LM head.

    Returns ``(logits [B,T,V] float32, new_cache)``, or the hidden states after the final norm
    ``[B,T,D]`` (compute dtype) when ``return_hidden``. ``new_cache`` is None without a cache.
    ``remat`` wraps the layer body in ``jax.checkpoint`` with the policy of that name (one of
    ``remat.REMAT_POLICIES``: "none", "full", "dots", "dots_no_batch", MaxText's "minimal",
    "save_qkv_proj", "save_out_proj", ..., and host-offloading ones;
    :func:`pmd_jax.models.remat.remat_policy`);
    ``shard_ctx=(mesh, rules)`` adds activation sharding constraints;
    ``unroll`` is passed to the layer ``lax.scan``. ``attention_impl`` (one of
    ``ATTENTION_IMPLS``) overrides ``cfg.attention_impl``; chunked attention never builds a [T, S]
    mask or score matrix (see :mod:`pmd_jax.models.attention`). ``shared_prefix``: segment 0
    of ``segment_ids`` is seen by every segment of its row (module docstring).
    ``adapters`` (with their ``lora`` config): LoRA adapters, a layer-stacked tree
    (:mod:`pmd_jax.models.lora`) added to the projections they target; the base ``params``
    are used as they are (differentiate with respect to ``adapters`` to train only them).
    ``right_padded``: the caller promises that ``attn_mask`` marks a prefix of every row
    (right padding, as the train step's batches are); cuDNN attention then gets each row's
    length instead of a [B, 1, T, S] mask (no bias, no ``dbias``; :mod:`pmd_jax.models.attend`).
    Not checked on the device: a left-padded row under it is attended wrongly by the cuDNN
    paths (dense, chunked and splash read the mask and ignore the flag).
    """
    _check_inputs(params, tokens, positions, cfg, attn_mask, segment_ids, cache, adapters, lora)
    if shared_prefix and (segment_ids is None or cfg.windows_shorter_than(tokens.shape[1])):
        raise ValueError(  # windows count slots: a continuation sits further from its prefix
            f"shared_prefix needs segment_ids and no sliding window shorter than the row "
            f"({tokens.shape[1]} slots; layers {cfg.windows_shorter_than(tokens.shape[1])[:4]} "
            f"have window {cfg.sliding_window})")
    B, T = tokens.shape
    dt = _dtype(cfg.dtype)
    kmask_new = jnp.ones((B, T), jnp.bool_) if attn_mask is None else attn_mask.astype(jnp.bool_)
    per_layer = isinstance(params["layers"], (list, tuple))

    # ---- masks over slots
    if cache is None:
        S = T
        idx = None
        new_mask = None
        key_mask = kmask_new
    else:
        k0 = cache["k"][0]
        S = k0.shape[2]
        want = (B, cfg.num_kv_heads, S, cfg.head_dim)
        n_layers = len(cache["k"]) if per_layer else cache["k"].shape[0]
        if tuple(k0.shape) != want or n_layers != cfg.num_layers:
            raise ValueError(
                f"cache['k'] ({n_layers} layers of {tuple(k0.shape)}) does not match "
                f"config/batch ({cfg.num_layers} layers of {want})"
            )
        if isinstance(cache_index, int) and cache_index + T > S:
            raise ValueError(f"cache_index {cache_index} + {T} tokens exceeds cache length {S}")
        idx = jnp.asarray(cache["index"] if cache_index is None else cache_index, jnp.int32)
        new_mask = jax.lax.dynamic_update_slice(cache["mask"], kmask_new, (0, idx))
        key_mask = new_mask
    windows = np.array(
        [cfg.sliding_window if cfg.layer_type(i) == "sliding_attention" else _BIG_WINDOW
         for i in range(cfg.num_layers)], np.int32,
    )
    choice = attend.choose(
        cfg, cfg.attention_impl if attention_impl is None else attention_impl, T=T, S=S,
        has_cache=cache is not None, key_padding=attn_mask is not None or cache is not None,
        segments=segment_ids is not None, shared_prefix=shared_prefix,
        right_padded=right_padded and cache is None)
    attend_fn = attend.attend_fn(cfg, choice.impl, T, S, key_mask, idx, segment_ids,
                                 shared_prefix, windows=windows,
                                 key_padding=attn_mask is not None, shard_ctx=shard_ctx,
                                 right_padded=right_padded and cache is None)

    # ---- per-layer tables
    inv_freq, scaling, rope_idx = rope_lib.rope_tables(cfg)
    cos_all, sin_all = rope_lib.cos_sin(positions, jnp.asarray(inv_freq), jnp.asarray(scaling))
    ls = _Layers(functools.partial(decoder_layer, cfg=cfg, shard_ctx=shard_ctx,
                                   lora_scaling=None if lora is None else lora.scaling),
                 attend_fn, cos_all, sin_all, rope_idx, windows, dt)
    layers = _with_adapters(params["layers"], adapters)

    x = jnp.take(params["embed"], tokens, axis=0).astype(dt)
    x = _constrain(x, ("batch", "seq", "embed"), shard_ctx)
    ck: Any
    cv: Any
    if per_layer:
        x, (ck_list, cv_list) = _unrolled_layers(x, layers, ls, remat, cache, idx)
        ck, cv = tuple(ck_list), tuple(cv_list)
    else:
        x, (ck, cv) = _scanned_layers(x, layers, ls, remat, unroll, cache, idx)
    new_cache = None
    if cache is not None and idx is not None:  # (idx is set exactly when there is a cache)
        new_cache = {"k": ck, "v": cv, "mask": new_mask, "index": idx + T}
    x = rms_norm(x, params["final_norm"], eps=cfg.rms_norm_eps)
    if return_hidden:
        return x, new_cache
    return logits_from_hidden(x, params, cfg), new_cache


def _with_adapters(layers: Any, adapters: Params | None) -> Any:
    """The layer weights with the LoRA adapter tensors added to each layer's dict (stacked, or
    split per layer like ``layers``), so the scan or loop carries them with the layer."""
    if adapters is None:
        return layers
    if isinstance(layers, (list, tuple)):
        per = unstack_layers(adapters)["layers"]
        return tuple({**lp, **ap} for lp, ap in zip(layers, per))
    return {**layers, **adapters["layers"]}


def positions_from_mask(attn_mask: jnp.ndarray) -> jnp.ndarray:
    """Position ids for a left-padded batch: cumsum(mask) - 1, clipped at 0 on padding."""
    m = attn_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0)
