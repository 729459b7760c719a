"""Right padding as sequence lengths on the cuDNN path (issue 50, part 1) and the chunked
attention's static tile list.

* ``dpa_attention(..., seq_lengths=)`` with ``implementation="xla"`` (the ``cudnn_xla`` twin,
  the very call cuDNN gets) against the dense reference on every valid query, forward and
  gradient (q, k, v); the outputs of padding queries are don't-care (never compared).
* The program JAX lowers for cuDNN (lowered for the ``cuda`` platform on this CPU, JAX's
  cuDNN version check stubbed): with lengths, the forward is ``__cudnn$fmhaSoftmax`` with
  ``PADDING_CAUSAL`` and the backward returns no ``dbias``; with a mask, ``ScaleBias`` calls
  and a ``dbias`` output (so the check can tell the two apart).
* Chunked attention: a static tile list (a scan, no while loop over traced bounds) for every
  cache-free pass, bitwise equal to the traced-bounds loops it replaced.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.models import attend, decoder
from pmd_jax.models import attention as attn
from pmd_jax.models import attention_fused as fused
from pmd_jax.models import attention_select as sel
from tests.models.test_attention_fused import OLMO, np_attention

jax.config.update("jax_default_matmul_precision", "highest")
ATOL = 2e-5


def right_padded_case(T=37, B=3, H=4, KV=2, hd=8, lengths=(37, 30, 1), window=None, seed=0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.normal(size=(B, T, H, hd)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, KV, T, hd)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, KV, T, hd)), jnp.float32)
    j = np.arange(T)
    key_mask = j[None] < np.asarray(lengths)[:, None]
    vis = (j[None, :] <= j[:, None])[None] & key_mask[:, None, :]
    if window is not None:
        vis = vis & (j[:, None] - j[None, :] < window)[None]
    return dict(q=q, k=k, v=v, key_mask=key_mask, vis=vis, valid=key_mask, window=window)


LENGTH_CASES = {
    "causal_gqa": dict(),
    "mha": dict(H=4, KV=4),
    "gqa4_even": dict(T=40, H=8, KV=2, lengths=(40, 33, 2)),
    "window": dict(window=6),
    "window_gqa4": dict(window=4, H=8, KV=2, lengths=(37, 12, 5)),
}


def _lengths_fn(c: dict[str, Any], implementation: str = "xla"):
    n = fused.right_padded_lengths(jnp.asarray(c["key_mask"]))

    def f(q, k, v):
        return fused.dpa_attention(q, k, v, seq_lengths=n, window=c["window"],
                                   implementation=implementation)  # type: ignore[arg-type]
    return f


def _quick(names, cases):  # a few unmarked, the rest with the slow runs
    return [n if n in names else pytest.param(n, marks=pytest.mark.slow) for n in sorted(cases)]


@pytest.mark.parametrize("name", _quick(("causal_gqa", "window_gqa4"), LENGTH_CASES))
def test_lengths_equal_dense_on_valid_rows_forward_and_grad(name):
    c = right_padded_case(**LENGTH_CASES[name])
    valid = c["valid"]
    f = _lengths_fn(c)
    dense = jax.tree_util.Partial(attn.dense_attention, mask=jnp.asarray(c["vis"]))
    out = np.asarray(jax.jit(f)(c["q"], c["k"], c["v"]))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[valid], np.asarray(dense(c["q"], c["k"], c["v"]))[valid],
                               atol=ATOL)
    np.testing.assert_allclose(out[valid], np_attention(c["q"], c["k"], c["v"], c["vis"])[valid],
                               atol=ATOL)
    # a cotangent on valid queries only (padding queries' outputs are never read)
    w = jnp.asarray(np.random.default_rng(5).normal(size=out.shape) * valid[..., None, None],
                    jnp.float32)

    def loss(g):
        return lambda q, k, v: jnp.sum(jnp.sin(g(q, k, v)) * w)

    got = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(c["q"], c["k"], c["v"])
    want = jax.grad(loss(dense), argnums=(0, 1, 2))(c["q"], c["k"], c["v"])
    for nm, a, b in zip("qkv", got, want):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(b).max() > 1e-3, nm
        if nm != "q":  # k, v [B, KV, S, hd] -> [B, S, KV, hd]: indexed by valid slots
            a, b = a.transpose(0, 2, 1, 3), b.transpose(0, 2, 1, 3)
        # at valid positions (padding keys get no gradient from valid queries either way)
        np.testing.assert_allclose(a[valid], b[valid], atol=ATOL, err_msg=nm)


def test_lengths_refuse_a_mask_and_clamp_empty_rows():
    c = right_padded_case()
    n = fused.right_padded_lengths(jnp.asarray(np.zeros((2, 5), bool)))
    assert n.dtype == jnp.int32 and np.asarray(n).tolist() == [1, 1]
    with pytest.raises(ValueError, match="seq_lengths replace"):
        fused.dpa_attention(c["q"], c["k"], c["v"], seq_lengths=jnp.ones((3,), jnp.int32),
                            key_mask=jnp.asarray(c["key_mask"]), implementation="xla")


# ------------------------------------------------------------------ the decoder with lengths
def _right_padded_batch(T=18, lengths=(18, 13)):
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, OLMO.vocab_size, (2, T)), jnp.int32)
    mask = jnp.asarray(np.arange(T)[None] < np.asarray(lengths)[:, None])
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
    return tokens, mask, pos


def test_decoder_lengths_logits_and_grads_equal_dense():
    """OLMo-shaped: sliding (window 5) and full layers, scanned, remat; right padding as
    lengths through ``forward(..., right_padded=True)``: valid logits and param grads."""
    params = decoder.init_params(OLMO, jax.random.PRNGKey(0))
    tokens, mask, pos = _right_padded_batch()
    w = mask.astype(jnp.float32)

    def loss(p, impl):
        lg, _ = decoder.forward(p, tokens, pos, OLMO, attn_mask=mask, attention_impl=impl,
                                remat="full", right_padded=True)
        return jnp.sum(jax.nn.logsumexp(lg, -1) * w) / jnp.sum(w), lg

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (l0, lg0), g0 = grad(params, "dense")
    (l1, lg1), g1 = grad(params, "cudnn_xla")
    valid = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(lg1)[valid], np.asarray(lg0)[valid], atol=1e-5)
    assert abs(float(l1) - float(l0)) < 1e-5
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ what cuDNN is handed
@pytest.fixture
def cuda_lowering(monkeypatch):
    """Lower programs for the ``cuda`` platform on this CPU: JAX's cuDNN checks stubbed (a
    cuDNN 9.8, a Hopper GPU), the decoder told it runs on a GPU of compute capability 9.0."""
    fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    for name in ("check_cudnn_version", "check_compute_capability"):
        if not hasattr(fa, name):
            pytest.skip(f"this JAX has no {name} to stub")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(fa, "check_compute_capability", lambda cc: True)
    monkeypatch.setattr(attend, "backend_facts", lambda: ("gpu", "9.0"))

    def lower(f, *args) -> str:
        try:
            return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"cannot lower for cuda here: {type(e).__name__}: {e}")

    return lower


def cudnn_calls(text: str) -> list[dict[str, Any]]:
    """Each cuDNN attention custom call of a lowered program: its target, operand count,
    result count and mask type."""
    out = []
    for line in text.splitlines():
        m = re.search(r"%\S+?(?::(\d+))? = stablehlo\.custom_call @(__cudnn\$fmha\w+)\((.*?)\)",
                      line)
        if not m:
            continue
        mt = re.search(r"mask_type\\22: \\22(\w+)\\22", line)
        out.append({"target": m.group(2), "results": int(m.group(1) or 1),
                    "operands": len([a for a in m.group(3).split(",") if a.strip()]),
                    "mask_type": mt.group(1) if mt else None})
    return out


def _grad_program(lower, f, B=2, T=64, H=4, KV=2, hd=64):
    q = jax.ShapeDtypeStruct((B, T, H, hd), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, KV, T, hd), jnp.bfloat16)
    km = jax.ShapeDtypeStruct((B, T), jnp.bool_)

    def loss(q, k, v, km):
        return jnp.sum(f(q, k, v, km).astype(jnp.float32))

    return lower(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, km)


def test_cudnn_gets_lengths_without_bias_or_dbias(cuda_lowering):
    lengths = _grad_program(cuda_lowering, lambda q, k, v, km: fused.dpa_attention(
        q, k, v, seq_lengths=fused.right_padded_lengths(km), window=16))
    calls = cudnn_calls(lengths)
    assert [c["target"] for c in calls] == ["__cudnn$fmhaSoftmax",
                                            "__cudnn$fmhaSoftmaxBackward"], calls
    assert all(c["mask_type"] == "PADDING_CAUSAL" for c in calls), calls
    # forward: q, k, v, q lengths, kv lengths (no bias); backward: dq, dk, dv, workspace
    assert calls[0]["operands"] == 5 and calls[1]["results"] == 4, calls
    assert "sliding_window_length\\22: 16" in lengths
    masked = cudnn_calls(_grad_program(cuda_lowering, lambda q, k, v, km: fused.dpa_attention(
        q, k, v, key_mask=km)))
    assert [c["target"] for c in masked] == ["__cudnn$fmhaScaleBiasSoftmax",
                                             "__cudnn$fmhaScaleBiasSoftmaxBackward"], masked
    assert masked[1]["results"] == 5  # dq, dk, dv, dbias (T x S, never read), workspace


def test_decoder_sends_cudnn_lengths_only_for_right_padding(cuda_lowering):
    cfg = OLMO.replace(dtype="bfloat16", head_dim=16, layer_types=None, sliding_window=None)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          decoder.param_shapes(cfg))
    B, T = 2, 128
    tok = jax.ShapeDtypeStruct((B, T), jnp.int32)
    mask = jax.ShapeDtypeStruct((B, T), jnp.bool_)

    def program(right_padded, segments=False):
        def loss(p, tokens, m, seg):
            h, _ = decoder.forward(p, tokens, tokens, cfg, attn_mask=m, return_hidden=True,
                                   remat="full", right_padded=right_padded,
                                   segment_ids=seg if segments else None,
                                   shared_prefix=segments)
            return jnp.sum(h.astype(jnp.float32))
        return cudnn_calls(cuda_lowering(jax.grad(loss), params, tok, mask, tok))

    assert {c["target"] for c in program(True)} == {"__cudnn$fmhaSoftmax",
                                                    "__cudnn$fmhaSoftmaxBackward"}
    # left padding possible (no promise) and shared-prefix segments: the mask, as a bias
    for calls in (program(False), program(True, segments=True)):
        assert {c["target"] for c in calls} == {"__cudnn$fmhaScaleBiasSoftmax",
                                                "__cudnn$fmhaScaleBiasSoftmaxBackward"}


def test_auto_rules_with_lengths():
    def call(**kw):
        return sel.AttentionCall(backend="gpu", T=1025, S=1025, dtype="bfloat16",
                                 head_dim=128, gpu_compute_capability="9.0", **kw)

    got = sel.select("auto", call(key_padding=True, right_padded=True))
    assert got.impl == "cudnn" and "sequence lengths" in got.reason, got
    assert sel.select("auto", call(key_padding=True)).impl == "chunked"  # a bias: even T
    got = sel.select("auto", call(key_padding=True, right_padded=True, segments=True))
    assert got.impl == "chunked" and "even lengths" in got.reason  # segments: still a mask
    assert call(key_padding=True, right_padded=True).seq_lengths
    assert not call(key_padding=True, right_padded=True, shared_prefix=True).seq_lengths
    assert not call(right_padded=True).needs_mask


# ------------------------------------------------------------------ chunked: static bounds
def _primitives(jaxpr: Any) -> set[str]:
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for sub in jax.core.jaxprs_in_params(eqn.params):
            out |= _primitives(sub)
    return out


CHUNKED_CASES = {
    "causal_gqa": dict(kw=dict(q_chunk=8, k_chunk=8), H=8, KV=2),
    "window": dict(kw=dict(q_chunk=8, k_chunk=6, window=5)),
    "bf16_uneven_chunks": dict(kw=dict(q_chunk=16, k_chunk=8), dtype=jnp.bfloat16),
    "offset_longer_keys": dict(kw=dict(q_chunk=8, k_chunk=8, q_offset=11), T=20, S=40),
    "shared_segments": dict(kw=dict(q_chunk=8, k_chunk=8, shared_segment_zero=True), T=40,
                            segments=True),
}


# The suite compiles at LLVM -O0 (tests/conftest.py), where the two programs' code rounds a
# few elements 1 ulp apart; at the optimised level a run uses they are the same bits.
OPTIMISED = {"xla_backend_optimization_level": 3}


@pytest.mark.parametrize("name", _quick(("causal_gqa", "offset_longer_keys", "shared_segments"),
                                        CHUNKED_CASES))
def test_chunked_static_tiles_bitwise_equal_traced_bounds(name):
    """The static tile list and the traced-bounds loops (what every pass ran before) visit
    the same tiles in the same order: forward and gradients, the same bits."""
    spec = dict(CHUNKED_CASES[name])
    kw = dict(spec.pop("kw"))
    B, T, S, H, KV, hd = 2, spec.get("T", 37), spec.get("S", spec.get("T", 37)), \
        spec.get("H", 4), spec.get("KV", 2), 8
    dt = spec.get("dtype", jnp.float32)
    r = np.random.default_rng(3)
    q = jnp.asarray(r.normal(size=(B, T, H, hd)), dt)
    k, v = (jnp.asarray(r.normal(size=(B, KV, S, hd)), dt) for _ in range(2))
    km = jnp.asarray(np.arange(S)[None] < np.array([[S], [S - 5]]))
    if spec.get("segments"):
        seg = jnp.asarray((np.arange(S)[None] >= np.array([[10], [14]])).astype(np.int32))
        kw.update(q_segment_ids=seg, k_segment_ids=seg)
    w = jnp.asarray(r.normal(size=q.shape), jnp.float32)

    def f(traced):
        kk = dict(kw)
        if traced:  # the same call with traced offset and window: the loops of before
            kk["q_offset"] = jnp.int32(kk.get("q_offset", 0))
            if "window" in kk:
                kk["window"] = jnp.int32(kk["window"])
        return lambda q, k, v: attn.chunked_attention(q, k, v, km, **kk)

    def run(fn):  # at XLA:CPU's optimised codegen (LLVM -O3), as a run compiles
        return jax.jit(fn).lower(q, k, v).compile(OPTIMISED)(q, k, v)

    res = {}
    for traced in (False, True):
        g = f(traced)
        loss = jax.value_and_grad(lambda q, k, v, g=g: jnp.sum(
            g(q, k, v).astype(jnp.float32) * w), argnums=(0, 1, 2))
        prims = _primitives(jax.make_jaxpr(loss)(q, k, v).jaxpr)
        assert ("while" in prims) == traced, prims  # static: scans only
        res[traced] = (run(g), *run(loss)[1])
    for a, b in zip(res[False], res[True], strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tile_schedule_is_the_causal_window_band():
    # 4 query chunks of 8 over 32 keys in chunks of 8: causal = lower triangle
    assert attn.tile_schedule(32, 32, 8, 8, 0, 2**30) == tuple(
        (i, j) for i in range(4) for j in range(i + 1))
    # window 5: query chunk i (slots 8i..8i+7) sees keys from 8i - 4 on
    assert attn.tile_schedule(32, 32, 8, 8, 0, 5) == (
        (0, 0), (1, 0), (1, 1), (2, 1), (2, 2), (3, 2), (3, 3))
    # queries at slots 11..30 of a 40-slot cache, chunks of 8: key chunks 0..1, 0..2, 0..3
    assert attn.tile_schedule(20, 40, 8, 8, 11, 2**30) == (
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2),
        (2, 3))


def test_decoder_chunked_has_no_traced_loop_bounds():
    """Scanned OLMo layers (traced per-layer window, two distinct windows): the chunked
    attention switches over static windows; no while loop in the whole forward + backward;
    logits and grads equal dense."""
    params = decoder.init_params(OLMO, jax.random.PRNGKey(4))
    tokens, mask, pos = _right_padded_batch(T=20, lengths=(20, 15))

    def loss(p, impl):
        lg, _ = decoder.forward(p, tokens, pos, OLMO, attn_mask=mask, attention_impl=impl,
                                remat="full")
        return jnp.sum(jnp.where(mask[..., None], lg, 0.0) ** 2) / 1e3

    prims = _primitives(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, "chunked")
                        .jaxpr)
    assert "while" not in prims and "cond" in prims, prims
    g = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (l0, g0), (l1, g1) = g(params, "dense"), g(params, "chunked")
    assert abs(float(l1) - float(l0)) < 1e-5 * max(1.0, abs(float(l0)))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
