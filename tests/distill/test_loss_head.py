"""The loss's LM head and chunks (issue 50, part 3): GEMMs in the compute dtype forward and
backward (fp32 accumulation, fp32 logits), chunk sizes that divide the response length, the
per-token metrics in one pass; fp32 results bitwise as before, bf16 gradients within bf16
rounding of before.

Reference: ``reference_losses.head_chunked_distill_stats``, a frozen copy of the chunked
statistics as they were computed before (checked bit for bit against that code when frozen).
"""

from __future__ import annotations

# isort: off
from tests.distill.distill_common import TINY, small_distill_config  # first: 8 fake devices
# isort: on

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export, lax

from pmd_jax.distill import align, chunked, losses
from pmd_jax.distill import batch as dbatch
from pmd_jax.distill import loss_fn as lf
from pmd_jax.distill import topk as topk_lib
from pmd_jax.models import decoder
from tests.distill import reference_losses as ref
from tests.fakes import tiny_model_config

CFG = losses.DistillLossConfig(alpha=0.5, topk=20)


def _inputs(dtype: str, b: int = 3, t: int = 12, d: int = 16, v: int = 300, seed: int = 0):
    r = np.random.default_rng(seed)
    hs, ht = (jnp.asarray(r.normal(size=(b, t, d)), dtype) for _ in range(2))
    ws, wt = (jnp.asarray(0.3 * r.normal(size=(d, v)), dtype) for _ in range(2))
    tok = jnp.asarray(r.integers(0, v, (b, t)), jnp.int32)
    mask = jnp.asarray(r.random((b, t)) < 0.8, jnp.float32)
    return hs, ht, ws, wt, tok, mask


def _loss_grads(stats_fn, hs, ht, ws, wt, tok, mask, cfg=CFG):
    """(loss, (d hs, d ws), metrics, per-token stats) of a chunked-statistics function."""
    def f(hs, ws):
        st = stats_fn(hs, ht, ws, wt, tok, cfg)
        loss, m = losses.finalize_distill(st, mask, None, cfg)
        return loss, (m, st)

    (loss, (m, st)), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(hs, ws)
    return loss, g, m, st


def _new(chunk: int):
    return lambda hs, ht, ws, wt, tok, cfg: chunked.chunked_distill_stats(
        hs, ht, ws, wt, tok, cfg, chunk=chunk)


def _head(chunk: int):
    return lambda hs, ht, ws, wt, tok, cfg: ref.head_chunked_distill_stats(
        hs, ht, ws, wt, tok, cfg, chunk=chunk)


def _bits(x) -> bytes:
    return np.asarray(x).tobytes()


# ------------------------------------------------------------------ chunk sizes
@pytest.mark.parametrize("length,chunk,want", [
    (512, 96, 64), (512, 512, 512), (512, 256, 256), (1000, 256, 250), (509, 96, 85),
    (12, 5, 4), (10, 512, 10), (0, 8, 1), (7, 1, 1)])
def test_chunk_for_length(length, chunk, want):
    assert chunked.chunk_for_length(length, chunk) == want


def test_chunk_for_length_bounds():
    for length in range(1, 300):
        for chunk in (1, 3, 7, 16, 50, 96):
            c = chunked.chunk_for_length(length, chunk)
            n = -(-length // chunk)
            assert 1 <= c <= chunk
            assert length % c == 0 or -(-length // c) * c - length < n
            if length % c == 0:
                assert length // c <= 2 * n


def test_no_padded_rows_when_a_divisor_is_near():
    hs, ht, ws, wt, tok, _ = _inputs("float32", b=1, t=512, d=8, v=40)
    jaxpr = jax.make_jaxpr(lambda h: chunked.chunked_distill_stats(
        h, ht, ws, wt, tok, losses.DistillLossConfig(topk=4), chunk=96))(hs)
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == [8]
    assert all(e.primitive.name != "pad" for e in jaxpr.jaxpr.eqns)  # 8 x 64 = 512 rows


# ------------------------------------------------------------------ fp32 unchanged, bf16 close
@pytest.mark.parametrize("impl", ["auto", "sort", "two_stage"])
def test_fp32_loss_grads_and_metrics_bitwise_as_before(impl, monkeypatch):
    monkeypatch.setattr(topk_lib, "BLOCK", 32)  # V = 300: 10 strided blocks, 160 candidates
    cfg = losses.DistillLossConfig(alpha=0.5, topk=20, top_k_impl=impl)
    x = _inputs("float32")
    want = _loss_grads(_head(4), *x, cfg=cfg)  # 4 divides T = 12: the same chunks as before
    got = _loss_grads(_new(4), *x, cfg=cfg)
    assert _bits(got[0]) == _bits(want[0])
    for a, b in zip(got[1], want[1]):
        assert _bits(a) == _bits(b)
    for k in want[3]:
        assert _bits(got[3][k]) == _bits(want[3][k]), k
    for k in want[2]:
        assert _bits(got[2][k]) == _bits(want[2][k]), k


def test_fp32_chunk_that_no_longer_pads_stays_within_rounding():
    x = _inputs("float32")
    want = _loss_grads(_head(5), *x)  # 12 rows in chunks of 5: 15 rows before, now 3 x 4
    got = _loss_grads(_new(5), *x)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)


def test_bf16_forward_bitwise_and_grads_within_bf16_rounding_of_before():
    x = _inputs("bfloat16")
    want = _loss_grads(_head(4), *x)
    got = _loss_grads(_new(4), *x)
    assert _bits(got[0]) == _bits(want[0])  # the same forward GEMMs, fp32 logits
    for k in want[3]:
        assert _bits(got[3][k]) == _bits(want[3][k]), k
    for a, b in zip(got[1], want[1]):
        assert a.dtype == b.dtype == jnp.bfloat16
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = np.max(np.abs(b32))
        np.testing.assert_allclose(a32, b32, rtol=2 ** -7, atol=2 ** -8 * scale)
        assert np.linalg.norm(a32 - b32) <= 2 ** -8 * np.linalg.norm(b32)


def _dot_operand_types(text: str) -> list[tuple[str, str]]:
    """(lhs, rhs) element types of every stablehlo.dot_general of a lowered program."""
    return re.findall(r"stablehlo\.dot_general %\S+, %\S+,.*?: \(tensor<[\dx]+x(\w+)>, "
                      r"tensor<[\dx]+x(\w+)>\)", text)


def test_bf16_backward_gemms_take_bf16_operands():
    hs, ht, ws, wt, tok, mask = _inputs("bfloat16")

    def lowered(fn):
        return jax.jit(jax.grad(lambda h, w: losses.finalize_distill(
            fn(h, ht, w, wt, tok, CFG), mask, None, CFG)[0], argnums=(0, 1))).lower(
            hs, ws).as_text()

    new = _dot_operand_types(lowered(_new(4)))
    assert len(new) >= 4 and set(new) == {("bf16", "bf16")}, new  # fwd x2, remat fwd, dX, dW
    old = _dot_operand_types(lowered(_head(4)))
    assert ("f32", "f32") in old  # before: the fp32 cotangent against upcast bf16 operands


def test_fp32_program_has_fp32_gemms_only():
    hs, ht, ws, wt, tok, mask = _inputs("float32")
    text = jax.jit(jax.grad(lambda h, w: losses.finalize_distill(
        _new(4)(h, ht, w, wt, tok, CFG), mask, None, CFG)[0], argnums=(0, 1))).lower(
        hs, ws).as_text()
    assert set(_dot_operand_types(text)) == {("f32", "f32")}


# ------------------------------------------------------------------ decoder.logits_from_hidden
def _old_logits_from_hidden(hidden, params, cfg):
    """The function before issue 50, for a config without matmul_dtype."""
    lead, d = hidden.shape[:-1], hidden.shape[-1]
    h2 = hidden.reshape(-1, d)
    if cfg.tie_embeddings:
        w = params["embed"].astype(hidden.dtype)
        out = lax.dot_general(h2, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    else:
        w = params["lm_head"].astype(hidden.dtype)
        out = jnp.dot(h2, w, preferred_element_type=jnp.float32)
    return out.reshape(*lead, out.shape[-1])


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_from_hidden(tie, dtype):
    cfg = tiny_model_config(dtype=dtype, tie_embeddings=tie)
    params = decoder.init_params(cfg, jax.random.PRNGKey(0))  # fp32 master weights
    h = jax.random.normal(jax.random.key(1), (2, 5, cfg.hidden_size)).astype(dtype)
    ct = jax.random.normal(jax.random.key(2), (2, 5, cfg.vocab_size))

    def vjp(fn):
        out, pull = jax.vjp(lambda h, p: fn(h, p, cfg), h, params)
        return out, pull(ct)

    (new, g_new), (old, g_old) = vjp(decoder.logits_from_hidden), vjp(_old_logits_from_hidden)
    assert new.dtype == jnp.float32 and _bits(new) == _bits(old)  # forward unchanged
    for a, b in zip(jax.tree.leaves(g_new), jax.tree.leaves(g_old)):
        assert a.dtype == b.dtype
        if dtype == "float32":
            assert _bits(a) == _bits(b)
        else:
            a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
            np.testing.assert_allclose(a32, b32, rtol=2 ** -7,
                                       atol=2 ** -8 * float(np.max(np.abs(b32))))
    if dtype == "bfloat16":  # forward, dX and dW: bf16 GEMMs
        def pull(h, p):
            return jax.vjp(lambda h, p: decoder.logits_from_hidden(h, p, cfg), h, p)[1](ct)

        text = jax.jit(pull).lower(h, params).as_text()
        assert set(_dot_operand_types(text)) == {("bf16", "bf16")}


# ------------------------------------------------------------------ metrics
def test_metrics_take_the_student_argmax_from_its_top_k():
    r = np.random.default_rng(3)
    s = jax.nn.log_softmax(jnp.asarray(r.integers(0, 3, (4, 6, 700)), jnp.float32))  # ties
    t = jax.nn.log_softmax(jnp.asarray(r.integers(0, 3, (4, 6, 700)), jnp.float32))
    tok = jnp.zeros((4, 6), jnp.int32)
    want = (jnp.argmax(s, -1) == jnp.argmax(t, -1)).astype(jnp.float32)
    for top1 in (None, lax.top_k(s, 5)[1][..., 0]):
        m = losses.token_metrics(s, t, top1)
        np.testing.assert_array_equal(np.asarray(m["top1_agree"]), np.asarray(want))
    m = losses.token_distill_stats(s, t, tok, losses.DistillLossConfig(topk=5))
    np.testing.assert_array_equal(np.asarray(m["top1_agree"]), np.asarray(want))

    def stats(s, t):
        return losses.token_distill_stats(s, t, tok, losses.DistillLossConfig(topk=5))

    # lowered for a GPU: one argmax (the teacher's) and one top-K (the student's)
    cuda = export.export(jax.jit(stats), platforms=["cuda"])(s, t).mlir_module()
    assert cuda.count('composite "chlo.top_k"') == 1
    assert len(re.findall(r"call @argmax\(", cuda)) == 1  # before: two
    # on CPU the student's argmax is its own reduction: XLA:CPU keeps lax.top_k as its TopK
    # kernel only while nothing but the gather reads the indices (a slice [..., 0] of them
    # made it a stable sort of every whole row: the train step 1.6x slower)
    text = jax.jit(stats).lower(s, t).as_text()
    assert text.count("chlo.top_k") == 1
    assert len(re.findall(r"call @argmax\(", text)) == 2


def test_cpu_loss_keeps_the_top_k_kernel():
    """The distillation loss compiled by XLA:CPU, forward and backward, runs the student's
    top-K as the TopK kernel, never as a sort of the vocabulary (fails when the metrics read
    the top-K's indices on CPU)."""
    r = np.random.default_rng(4)
    s = jnp.asarray(r.normal(size=(2, 8, 4096)), jnp.float32)
    t = jnp.asarray(r.normal(size=(2, 8, 4096)), jnp.float32)
    tok = jnp.asarray(r.integers(0, 4096, (2, 8)), jnp.int32)

    def loss(s, t):
        st = losses.token_distill_stats(s, t, tok, losses.DistillLossConfig(topk=100))
        return st["loss"].sum(), {k: st[k] for k in ("kl", "top1_agree", "entropy")}

    text = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(s, t).compile().as_text()
    assert 'custom_call_target="TopK"' in text
    assert " sort(" not in text


# ------------------------------------------------------------------ the distill step
def _step_batch(vocab: int, seed: int = 0):
    r = np.random.default_rng(seed)
    b = 4
    sp = [r.integers(1, vocab, r.integers(2, 6)).tolist() for _ in range(b)]
    tp = [r.integers(1, vocab, r.integers(3, 10)).tolist() for _ in range(b)]
    rs = [r.integers(1, vocab, r.integers(2, 7)).tolist() for _ in range(b)]
    db = align.build_distill_batch(sp, tp, rs, pad_id=0)
    return dbatch.make_batch(db, sd_mask=np.ones(b, np.float32),
                             rewards=np.array([1.0, 0.0, 0.0, 1.0], np.float32))


def test_distill_step_loss_and_grads_bitwise_with_two_stage_forced(monkeypatch):
    """make_loss_fn (student + teacher forwards, chunked JSD over top-8) with top_k_impl
    'two_stage' (blocks shrunk so a 48-token vocabulary takes it: 6 strided blocks of 8,
    4 candidates each) against 'sort' (lax.top_k): the same loss, metrics and gradients."""
    monkeypatch.setattr(topk_lib, "BLOCK", 8)
    monkeypatch.setattr(topk_lib, "PER_BLOCK", 4)
    params = decoder.init_params(TINY, jax.random.PRNGKey(0))
    teacher = decoder.init_params(TINY, jax.random.PRNGKey(7))
    batch = {k: jnp.asarray(v) for k, v in _step_batch(TINY.vocab_size).items()}
    out = {}
    for impl in ("sort", "two_stage"):
        c = small_distill_config(teacher__rule="frozen", loss__chunk_size=3,
                                 loss__top_k_impl=impl)
        opts = lf.StepOptions.from_config(c, TINY.vocab_size)
        fn = lf.make_loss_fn(TINY, opts)
        vg = jax.jit(jax.value_and_grad(lambda p, t, b: fn(p, t, b), has_aux=True))
        out[impl] = vg(params, teacher, batch)
        if impl == "two_stage":
            text = jax.jit(fn).lower(params, teacher, batch).as_text()
            assert "k = 4" in text and "stablehlo.case" in text  # the two-stage program
    (l0, m0), g0 = out["sort"]
    (l1, m1), g1 = out["two_stage"]
    assert _bits(l0) == _bits(l1)
    assert m0.keys() == m1.keys() and all(_bits(m0[k]) == _bits(m1[k]) for k in m0)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        assert _bits(a) == _bits(b)
