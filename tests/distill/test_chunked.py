"""Chunked (scan + remat) loss == the direct loss on materialised logits; memory stays bounded."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pmd_jax.distill import chunked as C
from pmd_jax.distill import losses as L
from tests.distill import reference_losses as R

ATOL = 1e-5
B, T, D, V = 2, 11, 8, 37  # T not a multiple of the chunk sizes used


def inputs(seed: int, dtype=np.float32):
    rng = np.random.default_rng(seed)
    hs = rng.normal(size=(B, T, D)).astype(dtype)
    ht = rng.normal(size=(B, T, D)).astype(dtype)
    hr = rng.normal(size=(B, T, D)).astype(dtype)
    ws = (rng.normal(size=(D, V)) * 0.7).astype(dtype)
    wt = (rng.normal(size=(D, V)) * 0.7).astype(dtype)
    wr = (rng.normal(size=(D, V)) * 0.7).astype(dtype)
    tok = rng.integers(0, V, size=(B, T)).astype(np.int32)
    resp = (rng.random((B, T)) < 0.85).astype(dtype)
    sd = np.asarray([1.0, 1.0], dtype)
    old = rng.normal(size=(B, T)).astype(dtype) - 3.0
    return [jnp.asarray(x) for x in (hs, ht, hr, ws, wt, wr, tok, resp, sd, old)]


CFGS = [
    L.DistillLossConfig(alpha=0.5, topk=5, add_tail=True, is_clip=2.0),
    L.DistillLossConfig(alpha=1.0, topk=None, temperature=0.7, is_clip=None),
    L.DistillLossConfig(alpha=0.0, topk=7, add_tail=False),
    L.DistillLossConfig(alpha=1.0, full_logit_distillation=False),
]


EQ_CASES = [(cfg, 4, False) for cfg in CFGS] + [(CFGS[0], 64, True), (CFGS[1], 3, True)]


@pytest.mark.parametrize(
    "cfg,chunk,trust_region",
    EQ_CASES,
    ids=[
        f"a{c.alpha}-k{c.topk}-full{int(c.full_logit_distillation)}-chunk{n}-tr{int(tr)}"
        for c, n, tr in EQ_CASES
    ],
)
def test_chunked_equals_direct_values_and_grads(cfg, chunk, trust_region):
    with jax.enable_x64(True):
        hs, ht, hr, ws, wt, wr, tok, resp, sd, old = inputs(0, np.float64)
        tr_alpha = 0.3

        def teacher_logits(ht, wt):
            cur = ht @ wt
            return (hr @ wr) + tr_alpha * (cur - hr @ wr) if trust_region else cur

        def direct(hs, ws, ht, wt):
            return R.self_distillation_loss(
                hs @ ws, teacher_logits(ht, wt), tok, resp, sd, cfg, old_token_logp=old
            )[0]

        kw = {}
        if trust_region:
            kw = dict(ref_teacher_hidden=hr, ref_teacher_unembed=wr, trust_region_alpha=tr_alpha)

        def chunk_fn(hs, ws, ht, wt):
            return R.chunked_distill_loss(
                hs, ht, ws, wt, tok, resp, sd, cfg, chunk=chunk, old_token_logp=old, **kw
            )[0]

        args = (hs, ws, ht, wt)
        v_d, g_d = jax.jit(jax.value_and_grad(direct, argnums=(0, 1, 2, 3)))(*args)
        v_c, g_c = jax.jit(jax.value_and_grad(chunk_fn, argnums=(0, 1, 2, 3)))(*args)
    assert float(v_c) == pytest.approx(float(v_d), abs=ATOL)
    for a, b in zip(g_c[:2], g_d[:2], strict=True):  # student hidden, student unembed
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL)
        assert np.abs(np.asarray(b)).max() > 1e-4
    # the teacher never receives gradients on either path
    for g in (*g_c[2:], *g_d[2:]):
        assert not np.any(np.asarray(g))


def test_chunked_stats_equal_direct_stats_float32():
    hs, ht, _, ws, wt, _, tok, *_ = inputs(1)
    cfg = CFGS[0]
    direct = L.token_distill_stats(hs @ ws, ht @ wt, tok, cfg)
    got = jax.jit(lambda *a: C.chunked_distill_stats(*a, cfg, chunk=3))(hs, ht, ws, wt, tok)
    assert set(got) == set(direct)
    for k in direct:
        assert got[k].shape == (B, T)
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(direct[k]), atol=ATOL, err_msg=k)


@pytest.mark.parametrize("temp", [1.0, 0.6])
def test_chunked_token_logprobs_match_torch(temp):
    hs, _, _, ws, _, _, tok, resp, *_ = inputs(2)
    mask = np.asarray(resp)

    def f(h, w):
        lp = C.chunked_token_logprobs(h, w, tok, temp, 4)
        return jnp.sum(lp * resp), lp

    (val, lp), (gh, gw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(hs, ws)
    h = torch.tensor(np.asarray(hs), dtype=torch.float64, requires_grad=True)
    w = torch.tensor(np.asarray(ws), dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(h @ w / temp, -1).gather(
        -1, torch.tensor(np.asarray(tok)).long()[..., None]
    )[..., 0]
    (ref * torch.tensor(mask)).sum().backward()
    np.testing.assert_allclose(np.asarray(lp), ref.detach().numpy(), atol=ATOL)
    np.testing.assert_allclose(np.asarray(gh), h.grad.numpy(), atol=ATOL)
    np.testing.assert_allclose(np.asarray(gw), w.grad.numpy(), atol=ATOL)
    lp2, ent = C.chunked_token_logprobs(hs, ws, tok, temp, 64, return_entropy=True)
    ref_lp = torch.log_softmax(h.detach() @ w.detach() / temp, -1)
    np.testing.assert_allclose(np.asarray(lp2), np.asarray(lp), atol=ATOL)
    np.testing.assert_allclose(np.asarray(ent), -(ref_lp.exp() * ref_lp).sum(-1).numpy(), atol=ATOL)


def test_bf16_hidden_runs_and_is_close_to_fp32():
    hs, ht, _, ws, wt, _, tok, resp, sd, _ = inputs(3)
    cfg = CFGS[0]
    l32 = R.chunked_distill_loss(hs, ht, ws, wt, tok, resp, sd, cfg, chunk=4)[0]
    l16 = R.chunked_distill_loss(
        hs.astype(jnp.bfloat16), ht.astype(jnp.bfloat16), ws, wt, tok, resp, sd, cfg, chunk=4
    )[0]
    assert l16.dtype == jnp.float32
    assert abs(float(l16) - float(l32)) < 0.05 * abs(float(l32)) + 1e-3


def test_bad_inputs():
    hs, ht, hr, ws, wt, wr, tok, *_ = inputs(4)
    cfg = CFGS[0]
    with pytest.raises(ValueError, match="same"):
        C.chunked_distill_stats(hs, ht[:, :-1], ws, wt, tok, cfg)
    with pytest.raises(ValueError, match="unembed"):
        C.chunked_distill_stats(hs, ht, ws[:-1], wt, tok, cfg)
    with pytest.raises(ValueError, match="differ"):
        C.chunked_distill_stats(hs, ht, ws, wt[:, :-1], tok, cfg)
    with pytest.raises(ValueError, match="tokens shape"):
        C.chunked_distill_stats(hs, ht, ws, wt, tok[:, :-1], cfg)
    with pytest.raises(ValueError, match="trust_region_alpha"):
        C.chunked_distill_stats(
            hs, ht, ws, wt, tok, cfg, ref_teacher_hidden=hr, ref_teacher_unembed=wr
        )
    with pytest.raises(ValueError, match=r"trust_region_alpha must be in \[0, 1\]"):
        C.chunked_distill_stats(
            hs,
            ht,
            ws,
            wt,
            tok,
            cfg,
            ref_teacher_hidden=hr,
            ref_teacher_unembed=wr,
            trust_region_alpha=1.5,
        )
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        C.chunked_distill_stats(hs, ht, ws, wt, tok, L.DistillLossConfig(topk=V + 1))
    with pytest.raises(ValueError, match="chunk"):
        C.chunked_token_logprobs(hs, ws, tok, 1.0, 0)


# --------------------------------------------------------------------------------------------
# memory at scale (compile only, abstract shapes, nothing allocated)
# --------------------------------------------------------------------------------------------

BIG_D, BIG_V = 4096, 151936  # Qwen3-8B hidden size and vocabulary


def _compiled_temp_bytes(
    t_len: int, chunk: int, direct: bool = False, w_dtype: jnp.dtype = jnp.float32
) -> int:
    cfg = L.DistillLossConfig(alpha=0.5, topk=100, add_tail=True, is_clip=2.0)
    S = jax.ShapeDtypeStruct
    h = S((1, t_len, BIG_D), jnp.bfloat16)
    w = S((BIG_D, BIG_V), w_dtype)
    tok, m, sd = S((1, t_len), jnp.int32), S((1, t_len), jnp.float32), S((1,), jnp.float32)

    def step(hs, ht, ws, wt, tok, m, sd):
        def loss(hs, ws):
            if direct:
                return R.self_distillation_loss(
                    C.project(hs, ws), C.project(ht, wt), tok, m, sd, cfg
                )[0]
            return R.chunked_distill_loss(hs, ht, ws, wt, tok, m, sd, cfg, chunk=chunk)[0]

        return jax.value_and_grad(loss, argnums=(0, 1))(hs, ws)

    compiled = jax.jit(step).lower(h, h, w, w, tok, m, sd).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def test_memory_bounded_at_qwen3_8b_vocab_and_8k_tokens():
    """Loss + grads w.r.t. student hidden and unembed, T=8192, D=4096, V=151936, bf16 hidden.

    Temp memory holds the unembed-gradient accumulator (D*V*4 bytes, the size of the
    parameter, independent of T) plus O(chunk * V) logits; never a [T, V] fp32 tensor.
    """
    t_len, chunk = 8192, 256
    full_logits = 1 * t_len * BIG_V * 4
    dw = BIG_D * BIG_V * 4
    temp = _compiled_temp_bytes(t_len, chunk)
    temp_small_t = _compiled_temp_bytes(2048, chunk)
    print(
        f"\n[memory] B=1 T={t_len} D={BIG_D} V={BIG_V} chunk={chunk}: temp "
        f"{temp / 2**30:.2f} GiB (of which unembed-grad accumulator {dw / 2**30:.2f} GiB); "
        f"one fp32 [B,T,V] logits tensor = {full_logits / 2**30:.2f} GiB; "
        f"T=2048 temp {temp_small_t / 2**30:.2f} GiB"
    )
    # everything apart from the parameter-sized gradient buffer is far below one logits tensor
    assert temp - dw < 0.2 * full_logits
    # each added token costs far less than one fp32 logits row (V * 4 bytes): only [T, D]-sized
    # arrays (hidden-state gradients) grow with T
    per_token = (temp - temp_small_t) / (t_len - 2048)
    print(
        f"[memory] growth per added token {per_token / 1024:.1f} KiB vs logits row "
        f"{BIG_V * 4 / 1024:.1f} KiB"
    )
    assert per_token < 0.1 * BIG_V * 4


@pytest.mark.slow
def test_memory_bf16_unembed():
    """bf16 unembed too. The CPU backend upcasts bf16 matmuls, adding [D, V] fp32 buffers
    (independent of T); the growth with T stays [T, D]-sized."""
    temp = _compiled_temp_bytes(8192, 256, w_dtype=jnp.bfloat16)
    temp_small_t = _compiled_temp_bytes(2048, 256, w_dtype=jnp.bfloat16)
    per_token = (temp - temp_small_t) / (8192 - 2048)
    print(
        f"\n[memory] bf16 unembed: T=8192 temp {temp / 2**30:.2f} GiB, T=2048 temp "
        f"{temp_small_t / 2**30:.2f} GiB, growth per token {per_token / 1024:.1f} KiB"
    )
    assert per_token < 0.1 * BIG_V * 4


@pytest.mark.slow
def test_memory_direct_path_for_comparison():
    temp = _compiled_temp_bytes(8192, 256, direct=True)
    print(f"\n[memory] direct (materialised logits) temp {temp / 2**30:.2f} GiB")
    assert temp > 8192 * BIG_V * 4


@pytest.mark.parametrize("vocab_major,remat", [(True, True), (False, False), (True, False)])
def test_vocab_major_unembed_and_no_remat_equal_default(vocab_major, remat):
    """[V, D] unembedding (tied embedding table, no transposed copy) and the non-recomputing
    chunk body give the default path's values and gradients (itself tested above against the
    direct formulas)."""
    hs, ht, hr, ws, wt, wr, tok, resp, sd, old = inputs(3)
    cfg = CFGS[0]
    kw = dict(ref_teacher_hidden=hr, trust_region_alpha=0.3)

    def loss(hs, ws, ht, wt, *, major, rm):
        t = (lambda w: w.T) if major else (lambda w: w)
        return R.chunked_distill_loss(
            hs, ht, t(ws), t(wt), tok, resp, sd, cfg, chunk=3, old_token_logp=old,
            ref_teacher_unembed=t(wr), vocab_major=major, remat=rm, **kw,
        )[0]

    def logp(hs, ws, *, major, rm):
        w = ws.T if major else ws
        return jnp.sum(C.chunked_token_logprobs(hs, w, tok, 0.8, 3, vocab_major=major,
                                                remat=rm) * resp)

    args = (hs, ws, ht, wt)
    for fn, n in ((loss, 4), (logp, 2)):
        ref = jax.jit(jax.value_and_grad(partial(fn, major=False, rm=True),
                                         argnums=tuple(range(n))))(*args[:n])
        got = jax.jit(jax.value_and_grad(partial(fn, major=vocab_major, rm=remat),
                                         argnums=tuple(range(n))))(*args[:n])
        np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=1e-5)
        for a, b in zip(got[1], ref[1], strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"unembed must be \[V, D\]"):
        C.chunked_token_logprobs(hs, ws, tok, vocab_major=True)  # [D, V] given as [V, D]
