"""Library attention kernels (pmd_jax.models.attention_fused) == a float64 numpy formula and
== the dense attention, forward and gradient: jax.nn.dot_product_attention with
implementation="xla" (the cuDNN path's exact call) and the Pallas Splash kernel in interpret
mode, on CPU; implementation="cudnn" on a CUDA GPU and Splash compiled on a TPU when present.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.models import attend, decoder
from pmd_jax.models import attention as attn
from pmd_jax.models import attention_fused as fused
from pmd_jax.models.config import ModelConfig, RopeConfig

jax.config.update("jax_default_matmul_precision", "highest")
ATOL = 2e-5
ON_GPU = jax.default_backend() == "gpu"
ON_TPU = jax.default_backend() == "tpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (cuDNN flash attention); "
                               f"backend is {jax.default_backend()}")
needs_tpu = pytest.mark.skipif(not ON_TPU, reason="needs a TPU (compiled Splash kernel); "
                               f"backend is {jax.default_backend()}")


def np_attention(q, k, v, vis):
    """Float64 softmax attention, GQA by repeating kv heads; vis [B, T, S] bool."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    G = q.shape[2] // k.shape[1]
    kk, vv = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # [B, H, S, hd]
    s = np.einsum("bthd,bhsd->bhts", q, kk) / np.sqrt(q.shape[-1])
    s = np.where(vis[:, None], s, -1e300)  # (rows that see nothing: uniform, never compared)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhts,bhsd->bthd", p / p.sum(-1, keepdims=True), vv)


def make_case(T=37, B=2, H=4, KV=2, hd=8, pads=(0, 5), side="left", window=None,
              segments=False, shared=False, seed=0, padding=True):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(B, T, H, hd)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, KV, T, hd)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, KV, T, hd)), jnp.float32)
    j = np.arange(T)
    p = np.asarray(pads)[:, None]
    key_mask = (j[None] >= p) if side == "left" else (j[None] < T - p)
    if not padding:
        key_mask = np.ones((B, T), bool)
    vis = (j[None, :] <= j[:, None])[None] & key_mask[:, None, :]
    if window is not None:
        vis = vis & (j[:, None] - j[None, :] < window)[None]
    seg = None
    if segments:  # row 0: [0]*10 + [1]*.. + [2]*..; row 1: [0]*14 + [1]*..
        seg = (j[None] >= np.array([[10], [14]])).astype(np.int32)
        seg = seg + (j[None] >= np.array([[T - 9], [T + 1]])).astype(np.int32)
        same = seg[:, :, None] == seg[:, None, :]
        vis = vis & ((same | (seg[:, None, :] == 0)) if shared else same)
    real = vis.any(-1) & key_mask  # real queries that see a key (padding queries are unused)
    return dict(q=q, k=k, v=v, key_mask=key_mask if padding else None, vis=vis, seg=seg,
                real=real, window=window, shared=shared)


CASES = {
    "causal": dict(padding=False),
    "causal_gqa4": dict(H=8, KV=2, padding=False),
    "left_padding": dict(),
    "right_padding": dict(side="right"),
    "mha_padding": dict(H=4, KV=4),
    "window": dict(window=6),
    "window_right_padding": dict(window=4, side="right"),
    "segments": dict(segments=True),
    "segments_window": dict(segments=True, window=5, T=40),
    "shared_prefix": dict(segments=True, shared=True),
    "shared_prefix_right_padding": dict(segments=True, shared=True, side="right", T=44),
}
SPLASH_CASES = ("causal_gqa4", "left_padding", "window_right_padding", "segments_window")


def run_impl(impl, c, dtype=jnp.float32):
    km = None if c["key_mask"] is None else jnp.asarray(c["key_mask"])
    seg = None if c["seg"] is None else jnp.asarray(c["seg"])

    def f(q, k, v):
        q, k, v = (a.astype(dtype) for a in (q, k, v))
        if impl == "dense":
            return attn.dense_attention(q, k, v, jnp.asarray(c["vis"]))
        if impl == "splash":
            return fused.splash_attention(q, k, v, key_mask=km, window=c["window"],
                                          segment_ids=seg)
        return fused.dpa_attention(q, k, v, key_mask=km, window=c["window"], segment_ids=seg,
                                   shared_prefix=c["shared"], implementation=impl)

    return f


def check_against_references(impl, c, atol=ATOL):
    f = run_impl(impl, c)
    real = c["real"]
    assert real.any() and np.isfinite(np.asarray(f(c["q"], c["k"], c["v"]))).all()
    out = np.asarray(jax.jit(f)(c["q"], c["k"], c["v"]))
    ref = np_attention(c["q"], c["k"], c["v"], c["vis"])
    np.testing.assert_allclose(out[real], ref[real], atol=atol)
    w = jnp.asarray(np.random.default_rng(9).normal(size=out.shape) * real[..., None, None],
                    jnp.float32)  # zero cotangent on padding queries (never used)

    def loss(g):
        return lambda q, k, v: jnp.sum(jnp.sin(g(q, k, v)) * w)

    got = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(c["q"], c["k"], c["v"])
    want = jax.grad(loss(run_impl("dense", c)), argnums=(0, 1, 2))(c["q"], c["k"], c["v"])
    for name, a, b in zip("qkv", got, want):
        assert np.abs(np.asarray(b)).max() > 1e-3, name
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, err_msg=name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_dot_product_attention_xla_equals_references(name):
    check_against_references("xla", make_case(**CASES[name]))


@pytest.mark.parametrize("name", SPLASH_CASES)
def test_splash_interpret_equals_references(name):
    """The Splash kernel itself, run by Pallas' interpreter on CPU (T padded to 128)."""
    check_against_references("splash", make_case(**CASES[name]))


def test_bf16_xla_close_to_float64():
    c = make_case(T=40, window=9, segments=True)
    out = run_impl("xla", c, jnp.bfloat16)(c["q"], c["k"], c["v"])
    assert out.dtype == jnp.bfloat16
    qb, kb, vb = (np.asarray(a.astype(jnp.bfloat16), np.float32) for a in (c["q"], c["k"],
                                                                            c["v"]))
    ref = np_attention(qb, kb, vb, c["vis"])
    assert np.abs(np.asarray(out, np.float32) - ref)[c["real"]].max() < 3e-2


def test_windows_switch_statically():
    """A traced per-layer window picks among the model's distinct static windows."""
    seen = []

    def make(w):
        seen.append(w)
        return lambda q, k, v: q * (0 if w is None else w)

    big = attend.BIG_WINDOW
    assert fused.static_windows([4, big, 4, 9, 50], T=20, big=big) == [4, 9, None]
    x = jnp.ones((1, 2, 1, 1))
    for w, want in [(4, 4), (9, 9), (big, 0), (50, 0)]:
        f = jax.jit(lambda w: fused.per_layer_window(w, [4, 9, big, 50], 20, big, make)(
            x, x, x))
        assert float(f(jnp.int32(w))[0, 0, 0, 0]) == want
    assert fused.per_layer_window(7, [7], 20, big, make)(x, x, x)[0, 0, 0, 0] == 7


# ------------------------------------------------------------------ the decoder with them
OLMO = ModelConfig(
    family="olmo3", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=8, qk_norm="full", norm_placement="post",
    sliding_window=5,
    layer_types=("sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention"),
    rope=(("full_attention", RopeConfig(theta=500000.0)),
          ("sliding_attention", RopeConfig(theta=10000.0))),
)


def _batch(T=18, pads=(0, 4)):
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, OLMO.vocab_size, (2, T)), jnp.int32)
    mask = jnp.asarray(np.arange(T)[None] >= np.asarray(pads)[:, None])
    return tokens, mask, decoder.positions_from_mask(mask)


@pytest.mark.parametrize("per_layer", [False, True], ids=["scanned", "unrolled"])
def test_decoder_cudnn_xla_logits_and_grads_equal_dense(per_layer):
    """Sliding (window 5) and full layers, left padding, remat: logits and param grads."""
    params = decoder.init_params(OLMO, jax.random.PRNGKey(0))
    if per_layer:
        params = decoder.unstack_layers(params)
    tokens, mask, pos = _batch()
    w = mask.astype(jnp.float32)

    def loss(p, impl):
        lg, _ = decoder.forward(p, tokens, pos, OLMO, attn_mask=mask, attention_impl=impl,
                                remat="full")
        return jnp.sum(jax.nn.logsumexp(lg, -1) * w) / jnp.sum(w), lg

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (l0, lg0), g0 = grad(params, "dense")
    (l1, lg1), g1 = grad(params, "cudnn_xla")
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(lg1)[real], np.asarray(lg0)[real], atol=1e-5)
    assert abs(float(l1) - float(l0)) < 1e-5
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", ["cudnn_xla", "splash"])
def test_decoder_packed_segments_equal_dense(impl):
    """Packed rows (and, for cudnn_xla, the shared-prefix layout) through the whole forward."""
    cfg = OLMO.replace(layer_types=None, sliding_window=None)
    params = decoder.init_params(cfg, jax.random.PRNGKey(2))
    tokens, mask, _ = _batch(T=20, pads=(0, 0))
    mask = jnp.asarray(np.arange(20)[None] < np.array([[20], [17]]))  # right padding
    seg = jnp.asarray((np.arange(20)[None] >= np.array([[8], [11]])).astype(np.int32))
    pos = jnp.asarray(np.where(np.asarray(seg) == 0, np.arange(20), np.arange(20) - 3))
    for shared in ([False, True] if impl == "cudnn_xla" else [False]):
        def fwd(impl, shared=shared):
            return decoder.forward(params, tokens, pos, cfg, attn_mask=mask, segment_ids=seg,
                                   shared_prefix=shared, attention_impl=impl)[0]
        real = np.asarray(mask)
        np.testing.assert_allclose(np.asarray(fwd(impl))[real], np.asarray(fwd("dense"))[real],
                                   atol=1e-5)


def test_decoder_splash_sharded_over_a_mesh():
    """Splash under jit on a (data 2, fsdp 2, tensor 2) mesh: shard_map over batch and heads."""
    from pmd_jax.run import sharding as shd

    if jax.device_count() < 8:
        pytest.skip(f"needs 8 devices, have {jax.device_count()}")
    mesh = shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = shd.ShardingRules.from_mapping()
    cfg = OLMO.replace(num_heads=4, num_kv_heads=2)
    params = decoder.init_params(cfg, jax.random.PRNGKey(3))
    tokens, mask, pos = _batch(T=16)
    tokens, mask, pos = (jnp.concatenate([a, a[::-1]]) for a in (tokens, mask, pos))

    def fwd(impl, ctx):
        f = jax.jit(lambda p, t, q, m: decoder.forward(p, t, q, cfg, attn_mask=m,
                                                       attention_impl=impl, shard_ctx=ctx)[0])
        return np.asarray(f(params, tokens, pos, mask))

    real = np.asarray(mask)
    np.testing.assert_allclose(fwd("splash", (mesh, rules))[real], fwd("dense", None)[real],
                               atol=1e-5)


# ------------------------------------------------------------------ on the accelerators
@needs_gpu
@pytest.mark.parametrize("name", ["causal_gqa4", "left_padding", "window_right_padding",
                                  "segments", "shared_prefix"])
def test_cudnn_on_gpu_close_to_xla_and_dense(name):
    """cuDNN (bf16; T even for its masked backward) vs the xla implementation and dense."""
    c = make_case(**dict(CASES[name], T=64, hd=64))
    args = [a.astype(jnp.bfloat16) for a in (c["q"], c["k"], c["v"])]
    real = c["real"]
    outs = {impl: np.asarray(jax.jit(run_impl(impl, c, jnp.bfloat16))(*args), np.float32)
            for impl in ("cudnn", "xla", "dense")}
    for impl in ("xla", "dense"):
        assert np.abs(outs["cudnn"] - outs[impl])[real].max() < 2e-2, impl
    w = jnp.asarray(real[..., None, None], jnp.float32)
    grads = {impl: jax.jit(jax.grad(lambda q, k, v, impl=impl: jnp.sum(
        run_impl(impl, c, jnp.bfloat16)(q, k, v).astype(jnp.float32) * w), argnums=(0, 1, 2)))(
        *args) for impl in ("cudnn", "dense")}
    for a, b in zip(grads["cudnn"], grads["dense"]):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() < 3e-2 * max(1.0, np.abs(b).max())


@needs_gpu
def test_decoder_auto_runs_cudnn_on_gpu():
    cfg = OLMO.replace(dtype="bfloat16", head_dim=16, num_heads=4, num_kv_heads=2)
    got = attend.choose(cfg, "auto", T=256, S=256, has_cache=False, key_padding=True,
                        segments=False, shared_prefix=False)
    assert got.impl == "cudnn", got
    params = decoder.init_params(cfg, jax.random.PRNGKey(0))
    tokens, mask, pos = _batch(T=256, pads=(0, 30))
    a = decoder.forward(params, tokens, pos, cfg, attn_mask=mask)[0]
    b = decoder.forward(params, tokens, pos, cfg, attn_mask=mask, attention_impl="dense")[0]
    real = np.asarray(mask)
    assert np.abs(np.asarray(a) - np.asarray(b))[real].max() < 0.1


@needs_tpu
@pytest.mark.parametrize("name", SPLASH_CASES)
def test_splash_compiled_on_tpu(name):
    c = make_case(**dict(CASES[name], T=256, hd=128))
    out = np.asarray(jax.jit(run_impl("splash", c))(c["q"], c["k"], c["v"]))
    ref = np_attention(c["q"], c["k"], c["v"], c["vis"])
    assert np.abs(out - ref)[c["real"]].max() < 2e-2  # TPU matmuls: bf16 passes
