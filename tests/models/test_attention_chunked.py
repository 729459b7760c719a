"""Chunked (flash-style) attention == dense attention, and the decoder with it == HF."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.models import attention as attn
from pmd_jax.models import decoder
from pmd_jax.models.config import ConfigError, ModelConfig
from tests.host import matmul_tol

jax.config.update("jax_default_matmul_precision", "highest")
# Attention outputs and grads vs float64 numpy and chunked vs dense: 1e-5 is for XLA:CPU's
# true-fp32 matmuls (CI's backend, as measured); gpu/tpu reduce in another order with other
# kernels even at "highest": tests/host.py's matmul_tol (an unmeasured 10x there).
ATOL = matmul_tol(cpu=1e-5, accelerator=1e-4)


def _np_attention(q, k, v, mask):
    """Float64 numpy softmax attention with GQA (the formula, written independently)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, hd = q.shape
    G = H // k.shape[1]
    kk = np.repeat(k, G, axis=1)  # [B, H, S, hd]
    vv = np.repeat(v, G, axis=1)
    s = np.einsum("bthd,bhsd->bhts", q, kk) / np.sqrt(hd)
    s = np.where(mask[:, None], s, -1e300)  # (fully masked rows: uniform, never compared)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bhts,bhsd->bthd", p, vv)


def _case(T=37, S=None, B=2, H=4, KV=2, hd=8, seed=0, pads=(0, 5), window=None, segments=False,
          offset=0):
    S = T if S is None else S
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(B, T, H, hd)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, KV, S, hd)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, KV, S, hd)), jnp.float32)
    key_mask = np.arange(S)[None] >= np.asarray(pads)[:, None]  # left padding
    qi = offset + np.arange(T)
    kj = np.arange(S)
    mask = (kj[None] <= qi[:, None])[None] & key_mask[:, None]
    if window is not None:
        mask = mask & (qi[:, None] - kj[None] < window)[None]
    seg = None
    if segments:
        seg = (np.arange(T)[None] >= np.array([[T // 2], [2 * T // 3]])).astype(np.int32)
        seg = seg + (np.arange(T)[None] >= np.array([[T - 4], [T]])).astype(np.int32)
        mask = mask & (seg[:, :, None] == seg[:, None, :])
    # real queries: at least one visible key
    real = mask.any(-1)
    return q, k, v, key_mask, mask, seg, real


CASES = {
    "causal_divides": dict(T=32, chunks=(8, 8)),
    "causal_ragged": dict(T=37, chunks=(8, 5)),
    "window": dict(T=37, window=6, chunks=(8, 5)),
    "window_one_chunk": dict(T=37, window=9, chunks=(64, 64)),
    "segments": dict(T=30, segments=True, chunks=(7, 4)),
    "segments_window": dict(T=30, segments=True, window=5, chunks=(4, 7)),
    "gqa4_keychunk1": dict(T=11, H=8, KV=2, chunks=(3, 1)),
    "cache_offset": dict(T=9, S=23, offset=6, chunks=(4, 5)),
    "cache_offset_window": dict(T=9, S=23, offset=10, window=4, chunks=(2, 8)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_equals_dense_outputs_and_grads(name):
    kw = dict(CASES[name])
    cq, ck = kw.pop("chunks")
    q, k, v, key_mask, mask, seg, real = _case(**kw)
    window, offset = kw.get("window"), kw.get("offset", 0)

    def chunked(q, k, v):
        return attn.chunked_attention(
            q, k, v, jnp.asarray(key_mask), q_offset=offset, window=window,
            q_segment_ids=None if seg is None else jnp.asarray(seg),
            k_segment_ids=None if seg is None else jnp.asarray(seg),
            q_chunk=cq, k_chunk=ck)

    def dense(q, k, v):
        return attn.dense_attention(q, k, v, jnp.asarray(mask))

    out_c = np.asarray(jax.jit(chunked)(q, k, v))
    out_d = np.asarray(dense(q, k, v))
    ref = _np_attention(q, k, v, mask)
    assert real.sum() > 0 and (offset > 0 or (~real).sum() > 0)  # padding queries exist
    np.testing.assert_allclose(out_c[real], ref[real], atol=ATOL)
    np.testing.assert_allclose(out_d[real], ref[real], atol=ATOL)
    assert np.isfinite(out_c).all()

    w = jnp.asarray(np.random.default_rng(9).normal(size=out_c.shape) * real[..., None, None],
                    jnp.float32)  # cotangent zero on padding queries (they are never used)

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)) * w)

    gc = jax.jit(jax.grad(loss(chunked), argnums=(0, 1, 2)))(q, k, v)
    gd = jax.grad(loss(dense), argnums=(0, 1, 2))(q, k, v)
    for name_, a, b in zip("qkv", gc, gd):
        assert np.abs(np.asarray(b)).max() > 1e-3, name_
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, err_msg=name_)


def test_bf16_inputs_close_to_dense():
    q, k, v, key_mask, mask, _, real = _case(T=40, window=9)
    qb, kb, vb = (a.astype(jnp.bfloat16) for a in (q, k, v))
    out = attn.chunked_attention(qb, kb, vb, jnp.asarray(key_mask), window=9, q_chunk=16,
                                 k_chunk=16)
    assert out.dtype == jnp.bfloat16
    ref = _np_attention(qb.astype(jnp.float32), kb.astype(jnp.float32), vb.astype(jnp.float32),
                        mask)
    assert np.abs(np.asarray(out, np.float32) - ref)[real].max() < 2e-2


def test_resolve_and_validation():
    assert attn.resolve_impl("auto", 1, 100_000) == "dense"  # decoding
    assert attn.resolve_impl("auto", 1024, 1024) == "dense"
    assert attn.resolve_impl("auto", 1024, 1025) == "chunked"
    assert attn.resolve_impl("dense", 10**5, 10**5) == "dense"
    with pytest.raises(ConfigError, match="attention_impl='flash'"):
        attn.resolve_impl("flash", 4, 4)
    base = dict(family="llama", vocab_size=11, hidden_size=8, intermediate_size=8, num_layers=1,
                num_heads=2, num_kv_heads=1, head_dim=4)
    with pytest.raises(ConfigError, match="model.attention_impl='flash'"):
        ModelConfig(**base, attention_impl="flash")
    with pytest.raises(ConfigError, match="attention_chunk"):
        ModelConfig(**base, attention_chunk=0)
    q = jnp.zeros((1, 4, 2, 4))
    with pytest.raises(ValueError, match="both q_segment_ids and k_segment_ids"):
        attn.chunked_attention(q, jnp.zeros((1, 1, 4, 4)), jnp.zeros((1, 1, 4, 4)),
                               q_segment_ids=jnp.zeros((1, 4), jnp.int32))


def test_memory_is_bounded_by_the_chunk():
    """Compiled forward+backward temp memory: dense grows with T*S, chunked does not."""
    B, H, KV, hd = 1, 8, 2, 32

    def temp(impl: str, T: int) -> int:
        q = jax.ShapeDtypeStruct((B, T, H, hd), jnp.float32)
        k = jax.ShapeDtypeStruct((B, KV, T, hd), jnp.float32)

        def f(q, k, v):
            if impl == "dense":
                i = jnp.arange(T)
                o = attn.dense_attention(q, k, v, (i[None, :] <= i[:, None])[None])
            else:
                o = attn.chunked_attention(q, k, v, q_chunk=256, k_chunk=256)
            return jnp.sum(o ** 2)

        c = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, k, k).compile()
        return int(c.memory_analysis().temp_size_in_bytes)

    T = 4096
    scores = B * H * T * T * 4  # one float32 [B, H, T, T] tensor: 512 MiB
    dense = temp("dense", T)
    chunked = temp("chunked", T)
    assert dense >= scores
    # O(T) residuals (q/k/v-sized grads, output, lse) + O(chunk^2) tiles: a few MiB
    qkv = B * T * H * hd * 4
    assert chunked < 12 * qkv + 4 * B * H * 256 * 256 * 4, (chunked, dense)
    assert temp("chunked", 2 * T) < 2.5 * chunked  # linear in T, not quadratic


# ------------------------------------------------------------------ the decoder with it
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from tests.models.test_models_parity import CASES as HF_CASES  # noqa: E402
from tests.models.test_models_parity import (  # noqa: E402
    OLMO_KW,
    TOL,
    hf_logits,
    left_padded_batch,
    make_hf,
)


def _fwd(params, tokens, positions, cfg, mask, impl, **kw):
    fn = jax.jit(lambda p, t, pos, m: decoder.forward(p, t, pos, cfg, attn_mask=m,
                                                      attention_impl=impl, **kw)[0])
    return np.asarray(fn(params, jnp.asarray(tokens), jnp.asarray(positions),
                         jnp.asarray(mask)))


@pytest.mark.parametrize("case", ["llama3_rope_tied", "qwen3_untied", "olmo3"])
def test_chunked_forward_matches_hf(case):
    """Full forward with chunks (5) smaller than T (16) and a window (OLMo-3: 5) vs HF."""
    kind, kw = HF_CASES[case]
    model, cfg, params = make_hf(kind, **kw)
    cfg = cfg.replace(attention_chunk=5)
    tokens, mask, positions = left_padded_batch(np.random.default_rng(0), cfg.vocab_size,
                                                [16, 11, 3], 16)
    ref = hf_logits(model, tokens, mask, positions)
    ours = _fwd(params, tokens, positions, cfg, mask, "chunked")
    real = mask.astype(bool)
    err = np.abs(ours - ref)[real].max()
    assert err < TOL, f"{case}: max abs logit diff {err}"
    if case == "olmo3":  # the default (dense at this size) agrees with chunked too
        dense = _fwd(params, tokens, positions, cfg, mask, "auto")
        assert np.abs(dense - ours)[real].max() < ATOL * 10


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per_layer"])
def test_chunked_forward_grads_equal_dense(per_layer):
    """jax.grad through the whole (OLMo-3: sliding + full layers) forward, left padding,
    chunk 4 (divides T=12) and 5 (does not), remat on."""
    _, cfg, params = make_hf("olmo3", **OLMO_KW)
    tokens, mask, positions = left_padded_batch(np.random.default_rng(5), cfg.vocab_size,
                                                [12, 7], 12)
    if per_layer:
        params = decoder.unstack_layers(params)
    w = jnp.asarray(mask, jnp.float32)

    def loss(p, impl, chunk):
        c = cfg.replace(attention_chunk=chunk)
        lg, _ = decoder.forward(p, jnp.asarray(tokens), jnp.asarray(positions), c,
                                attn_mask=jnp.asarray(mask), attention_impl=impl,
                                remat="full")
        return jnp.sum(jax.nn.logsumexp(lg, -1) * w) / jnp.sum(w)

    grad = jax.jit(jax.value_and_grad(loss), static_argnums=(1, 2))
    l0, g0 = grad(params, "dense", 4)
    for chunk in (4, 5):
        l1, g1 = grad(params, "chunked", chunk)
        assert abs(float(l1) - float(l0)) < ATOL
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
            np.testing.assert_allclose(a, b, atol=ATOL, rtol=1e-4)


def test_chunked_packed_segments_equal_separate_sequences():
    _, cfg, params = make_hf("olmo3", **OLMO_KW)
    cfg = cfg.replace(attention_chunk=3)
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, cfg.vocab_size, 9), rng.integers(0, cfg.vocab_size, 5)
    packed = jnp.asarray(np.concatenate([a, b])[None])
    seg = jnp.asarray([[0] * 9 + [1] * 5])
    pos = jnp.asarray([list(range(9)) + list(range(5))])
    out, _ = decoder.forward(params, packed, pos, cfg, segment_ids=seg,
                             attention_impl="chunked")
    dense, _ = decoder.forward(params, packed, pos, cfg, segment_ids=seg,
                               attention_impl="dense")
    ra, _ = decoder.forward(params, jnp.asarray(a[None]), jnp.arange(9)[None], cfg)
    rb, _ = decoder.forward(params, jnp.asarray(b[None]), jnp.arange(5)[None], cfg)
    np.testing.assert_allclose(out[0, :9], ra[0], atol=TOL)
    np.testing.assert_allclose(out[0, 9:], rb[0], atol=TOL)
    np.testing.assert_allclose(out, dense, atol=ATOL * 10)


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per_layer"])
def test_chunked_prefill_with_cache_then_decode(per_layer):
    """Prefill (chunked, chunk 4 < prefill 9, cache longer than the sequence) then decode
    (chunked too) == the full dense forward, on OLMo-3 (window 5)."""
    _, cfg, params = make_hf("olmo3", **OLMO_KW)
    cfg = cfg.replace(attention_chunk=4, attention_impl="chunked")
    T, P = 14, 9
    tokens, mask, positions = left_padded_batch(np.random.default_rng(2), cfg.vocab_size,
                                                [14, 8], T)
    full = _fwd(params, tokens, positions, cfg, mask, "dense")
    if per_layer:
        params = decoder.unstack_layers(params)
    step = jax.jit(lambda p, t, pos, m, c: decoder.forward(p, t, pos, cfg, attn_mask=m,
                                                           cache=c))
    cache = decoder.init_cache(cfg, batch=2, max_len=23, dtype=jnp.float32,
                               per_layer=per_layer)
    out, cache = step(params, tokens[:, :P], positions[:, :P], mask[:, :P], cache)
    outs = [np.asarray(out)]
    for i in range(P, T, 2):  # two tokens per step: the query offset is not chunk-aligned
        out, cache = step(params, tokens[:, i:i + 2], positions[:, i:i + 2],
                          mask[:, i:i + 2], cache)
        outs.append(np.asarray(out))
    cached = np.concatenate(outs, axis=1)
    assert int(cache["index"]) == T
    real = mask.astype(bool)
    assert np.abs(cached - full)[real].max() < TOL
