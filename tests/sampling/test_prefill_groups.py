"""Prefill groups (``batching.plan_prefill_groups``, ``decode.place_rows``): a decode batch
assembled from groups of distinct prompts, each padded to its own length, holds the same
cache and logits as one prefill of the whole left-padded batch; a prompt's samples share one
prefill; sampled log-probs equal the trainer's unpadded forward on a sliding-window model;
and the group plan pads the embedded default's evaluation prompts far less."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.models import decoder
from pmd_jax.models.config import ModelConfig
from pmd_jax.sampling import decode
from pmd_jax.sampling.base import SamplingParams
from pmd_jax.sampling.batching import (
    bucket_length,
    plan_prefill_groups,
    prefill_length,
    row_bucket,
)
from pmd_jax.sampling.jax_sampler import JaxSampler

# Qwen3-style: QK norm, alternating sliding (window 8) and full attention layers.
SLIDING = ModelConfig(
    family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512, qk_norm="head",
    sliding_window=8, layer_types=("sliding_attention", "full_attention") * 2,
)


@pytest.fixture(scope="module")
def params():
    return decoder.init_params(SLIDING, jax.random.PRNGKey(3))


def _prompts(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 95, int(k)).tolist() for k in rng.integers(lo, hi, n)]


def test_prefill_length_series():
    assert [prefill_length(n) for n in (1, 16, 17, 33, 100, 129, 130, 161, 200, 257, 700)] == [
        16, 16, 18, 36, 104, 144, 144, 176, 208, 288, 704]
    for n in range(1, 3000):
        p = prefill_length(n)
        assert n <= p and (n <= 16 or p <= 1.125 * n)
        assert prefill_length(bucket_length(n)) == bucket_length(n)  # every bucket is one


@pytest.mark.parametrize("unstack", [True, False])
def test_assembled_batch_equals_one_prefill_of_the_padded_batch(params, unstack):
    """The cache slots and last logits of every row match a single prefill of the batch with
    every prompt left-padded to the batch's prompt slots (the layout before groups)."""
    prompts = _prompts(0, 7, 3, 400)
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=1)
    s = JaxSampler(SLIDING, params, max_len=512, max_batch=64, unstack_layers=unstack)
    arrays = [np.asarray(p, np.int32) for p in prompts]
    rows = [(p, k) for p in range(len(prompts)) for k in range(sp.n)]
    chunk = sorted(range(len(rows)), key=lambda r: len(arrays[rows[r][0]]))
    stats = [0, 0]
    cache, logits, (plen, pidx, sidx, valid), p_len, _ = s._fill_batch(
        chunk, rows, arrays, sp, stats)
    assert stats[0] >= 2  # several groups were assembled
    b = len(valid)
    tokens = np.zeros((b, p_len), np.int32)
    mask = np.zeros((b, p_len), bool)
    for j, r in enumerate(chunk):
        a = arrays[rows[r][0]]
        tokens[j, p_len - len(a):], mask[j, p_len - len(a):] = a, True
        assert (pidx[j], sidx[j]) == rows[r] and plen[j] == len(a)
    cache_len = cache["mask"].shape[1]
    ref_cache, ref_logits = decode.prefill(s.params, tokens, mask, cfg=SLIDING, shard_ctx=None,
                                           cache_dtype=jnp.float32, cache_len=cache_len)
    n = len(chunk)
    np.testing.assert_allclose(np.asarray(logits)[:n], np.asarray(ref_logits)[:n],
                               rtol=1e-5, atol=1e-5)
    got_mask = np.asarray(cache["mask"])[:n]
    np.testing.assert_array_equal(got_mask, np.asarray(ref_cache["mask"])[:n])
    assert not got_mask[:, p_len:].any()
    for name in ("k", "v"):
        for got, ref in zip(jax.tree.leaves(cache[name]), jax.tree.leaves(ref_cache[name]),
                            strict=True):
            got, ref = np.asarray(got), np.asarray(ref)
            if got.ndim == 4:  # one layer's
                got, ref = got[None], ref[None]
            for g_l, r_l in zip(got, ref, strict=True):  # [B, KV, S, hd] per layer
                g = np.moveaxis(g_l[:n], 2, 1)[got_mask]  # [real slots, KV, hd]
                r = np.moveaxis(r_l[:n], 2, 1)[got_mask]
                np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stacked", [False, True])
def test_place_rows_copies_exactly_what_numpy_indexing_says(stacked):
    """``place_rows`` (array by array) against a direct numpy copy: batch row dst[i] gets
    group row src[i]'s slots [0, G) at [offset, offset + G) and its logits; dst >= B drops
    the entry; every other row and slot keeps its values; per-layer and stacked caches."""
    rng = np.random.default_rng(7)
    n_layers, b, kv, s, hd, g, g_len, vocab = 3, 5, 2, 12, 4, 3, 6, 11

    def arr(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    def cache(rows, slots):
        ks = [arr(rows, kv, slots, hd) for _ in range(n_layers)]
        vs = [arr(rows, kv, slots, hd) for _ in range(n_layers)]
        return {"k": np.stack(ks) if stacked else ks, "v": np.stack(vs) if stacked else vs,
                "mask": rng.random((rows, slots)) > 0.5, "index": np.int32(0)}

    full, part = cache(b, s), cache(g, g_len)
    logits, g_logits = arr(b, vocab), arr(g, vocab)
    src = np.array([2, 0, 1, 2], np.int32)
    dst = np.array([4, 1, b, 0], np.int32)  # the third entry is dropped
    offset = 4
    want_k = [np.array(x) for x in (full["k"] if not stacked else list(full["k"]))]
    want_v = [np.array(x) for x in (full["v"] if not stacked else list(full["v"]))]
    want_mask, want_logits = full["mask"].copy(), logits.copy()
    for i, j in zip(src, dst, strict=True):
        if j >= b:
            continue
        for layer in range(n_layers):
            want_k[layer][j, :, offset:offset + g_len] = part["k"][layer][i]
            want_v[layer][j, :, offset:offset + g_len] = part["v"][layer][i]
        want_mask[j, offset:offset + g_len] = part["mask"][i]
        want_logits[j] = g_logits[i]
    on_device = jax.tree.map(jnp.asarray, full)
    got, got_logits = decode.place_rows(on_device, jnp.asarray(logits),
                                        jax.tree.map(jnp.asarray, part), jnp.asarray(g_logits),
                                        src, dst, np.int32(offset))
    got_k = list(got["k"]) if not stacked else list(np.asarray(got["k"]))
    got_v = list(got["v"]) if not stacked else list(np.asarray(got["v"]))
    for layer in range(n_layers):
        np.testing.assert_array_equal(np.asarray(got_k[layer]), want_k[layer])
        np.testing.assert_array_equal(np.asarray(got_v[layer]), want_v[layer])
    np.testing.assert_array_equal(np.asarray(got["mask"]), want_mask)
    np.testing.assert_array_equal(np.asarray(got_logits), want_logits)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_the_unpadded_forward_with_sliding_windows(params, temperature):
    """Rows of many lengths (so prompts sit at different offsets of the batch cache, past the
    window), several samples each: every sampled log-prob equals log_softmax(logits / T) of
    one unpadded, uncached forward over prompt + response."""
    prompts = _prompts(1, 6, 2, 40)
    sp = SamplingParams(n=2, temperature=temperature, max_tokens=12, seed=5)
    s = JaxSampler(SLIDING, params, max_len=128)
    out = s.generate(prompts, sp)
    t = temperature if temperature > 0 else 1.0
    for r in out:
        seq = np.concatenate([prompts[r.prompt_index], r.tokens]).astype(np.int32)
        lg, _ = decoder.forward(params, jnp.asarray(seq)[None], jnp.arange(len(seq))[None],
                                SLIDING)
        lg = np.asarray(lg[0, len(prompts[r.prompt_index]) - 1: -1], np.float64) / t
        lp = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - lg.max(-1, keepdims=True)
        want = lp[np.arange(len(r.tokens)), r.tokens]
        np.testing.assert_allclose(r.logprobs, want, rtol=2e-4, atol=2e-4)
        if temperature == 0:
            assert (r.tokens == np.argmax(lg, -1)).all()


def test_samples_of_one_prompt_share_one_prefill(params):
    prompts = _prompts(2, 5, 5, 60)
    s = JaxSampler(SLIDING, params, max_len=128)
    one = s.generate(prompts, SamplingParams(n=1, temperature=0.0, max_tokens=6))
    m1 = s.last_metrics
    four = s.generate(prompts, SamplingParams(n=4, temperature=0.0, max_tokens=6))
    m4 = s.last_metrics
    assert (m4.prefill_groups, m4.prefill_positions) == (m1.prefill_groups, m1.prefill_positions)
    assert m1.prefill_positions <= row_bucket(5) * prefill_length(max(map(len, prompts)))
    for r in four:
        np.testing.assert_array_equal(r.tokens, one.items[r.prompt_index].tokens)


def test_groups_pad_the_default_evaluation_prompts_far_less():
    """Lengths shaped like the embedded default's 100 SciQ evaluation prompts (126-574
    tokens): one prefill of a 64-row batch at the batch's length bucket pads it by 90%; its
    groups stay within 30% of the real tokens with at most 6 programs."""
    rng = np.random.default_rng(0)
    lengths = sorted(int(x) for x in np.concatenate([rng.integers(126, 300, 80),
                                                     rng.integers(300, 575, 20)]))
    groups = plan_prefill_groups(lengths[:64], 64)
    assert [s for s, *_ in groups] == [0] + [e for _, e, *_ in groups[:-1]]
    assert groups[-1][1] == 64 and len(groups) <= 6
    padded = sum(g * p for *_, g, p in groups)
    whole = row_bucket(64) * bucket_length(lengths[63])
    assert whole > 1.9 * sum(lengths[:64])
    assert padded < 1.3 * sum(lengths[:64]) and padded < 0.7 * whole
    for s, e, g, p in groups:
        assert g == row_bucket(e - s) and p == prefill_length(lengths[e - 1])
    # Near the context length the batch's prompt slots are exact: no group is longer.
    capped = plan_prefill_groups(lengths[:64], 64, limit=lengths[63])
    assert max(p for *_, p in capped) == lengths[63]


def test_prefill_token_cap_bounds_every_group_of_several_prompts():
    """``max_tokens``: no group of several prompts holds more padded positions than the cap;
    a prompt longer than the cap is prefilled alone; no cap plans bigger groups."""
    rng = np.random.default_rng(1)
    lengths = sorted(int(x) for x in rng.integers(100, 1500, 40))
    free = plan_prefill_groups(lengths, 64)
    assert max(g * p for *_, g, p in free) > 2048
    for cap in (1024, 2048, 4096):
        groups = plan_prefill_groups(lengths, 64, max_tokens=cap)
        assert [s for s, *_ in groups] == [0] + [e for _, e, *_ in groups[:-1]]
        assert groups[-1][1] == len(lengths)
        for s, e, g, p in groups:
            assert e - s == 1 or g * p <= cap, (cap, s, e, g, p)
        assert any(e - s > 1 for s, e, *_ in groups)
        alone = [grp for grp in groups if grp[2] * grp[3] > cap]
        assert all(e - s == 1 and g == 1 for s, e, g, _ in alone)


def test_prefill_token_cap_changes_no_token(params):
    """A sampler whose prefill groups are capped samples the same tokens and log-probs as one
    that prefills each batch's prompts in one or two groups; the metrics show the extra
    calls, and a negative cap is refused."""
    prompts = _prompts(5, 9, 20, 300)
    sp = SamplingParams(n=2, temperature=0.9, max_tokens=8, seed=3)
    free = JaxSampler(SLIDING, params, max_len=512)
    ref = free.generate(prompts, sp)
    capped = JaxSampler(SLIDING, params, max_len=512, max_prefill_tokens=300)
    out = capped.generate(prompts, sp)
    assert capped.last_metrics.prefill_groups > free.last_metrics.prefill_groups
    for a, b in zip(out, ref, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="max_prefill_tokens"):
        JaxSampler(SLIDING, params, max_prefill_tokens=-1)


def test_cache_budget_splits_batches_and_changes_no_token(params):
    prompts = _prompts(4, 6, 5, 200)
    sp = SamplingParams(n=2, temperature=0.9, max_tokens=8, seed=2)
    free = JaxSampler(SLIDING, params, max_len=256)
    ref = free.generate(prompts, sp)
    assert free.last_metrics.batches == 1
    slot_bytes = 2 * SLIDING.num_layers * SLIDING.num_kv_heads * SLIDING.head_dim * 4 + 1
    tight = JaxSampler(SLIDING, params, max_len=256, max_cache_gib=4 * 64 * slot_bytes / 2**30)
    assert tight.max_cache_slots == 4 * 64
    out = tight.generate(prompts, sp)
    assert tight.last_metrics.batches >= 3
    for a, b in zip(out, ref, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="max_cache_gib"):
        JaxSampler(SLIDING, params, max_cache_gib=-1.0)


def test_prefill_matmul_dtype_rounds_the_prefill_only(params):
    """rollout.prefill_matmul_dtype: the prefill's weight matmuls take bf16 operands with
    float32 accumulation (the lowered program holds bf16 dots; the float32 one none), its
    cache and logits are the float32 prefill's to bf16 rounding but not bitwise, and the
    decode step's program is the float32 one."""
    from pmd_jax.models.config import ConfigError

    prompts = _prompts(5, 4, 20, 60)
    p_len = max(len(p) for p in prompts)
    tokens = np.zeros((4, p_len), np.int32)
    mask = np.zeros((4, p_len), bool)
    for j, a in enumerate(prompts):
        tokens[j, p_len - len(a):], mask[j, p_len - len(a):] = a, True
    kw = dict(cfg=SLIDING, shard_ctx=None, cache_dtype=jnp.float32, cache_len=p_len + 8)
    c32, l32 = decode.prefill(params, tokens, mask, **kw)
    c16, l16 = decode.prefill(params, tokens, mask, **kw, matmul_dtype="bfloat16")
    l32, l16 = np.asarray(l32), np.asarray(l16)
    assert l16.dtype == np.float32 and not np.array_equal(l16, l32)
    np.testing.assert_allclose(l16, l32, atol=0.05 * np.abs(l32).max())
    k32, k16 = (np.asarray(jax.tree.leaves(c)[0]) for c in (c32, c16))
    np.testing.assert_allclose(k16, k32, atol=0.05 * np.abs(k32).max())

    s32 = JaxSampler(SLIDING, params, max_len=512)
    s16 = JaxSampler(SLIDING, params, max_len=512, prefill_matmul_dtype="bfloat16")

    def dots(fn, *args, **kwargs) -> list[str]:
        text = fn.lower(*args, **kwargs).as_text()
        return [ln for ln in text.splitlines() if "dot_general" in ln]

    pre16 = dots(s16._fns.prefill, s16.params, tokens, mask, cache_len=p_len + 8)
    pre32 = dots(s32._fns.prefill, s32.params, tokens, mask, cache_len=p_len + 8)
    assert any("bf16" in d for d in pre16) and not any("bf16" in d for d in pre32)
    cache = decode.new_cache(s16.params, SLIDING, 4, p_len + 8, jnp.float32, None)
    step16 = dots(s16._fns.step, s16.params, cache, jnp.zeros((4,), jnp.int32),
                  jnp.full((4, 1), p_len, jnp.int32), jnp.int32(p_len))
    assert step16 and not any("bf16" in d for d in step16)
    with pytest.raises(ConfigError, match="matmul_dtype='int8'"):
        JaxSampler(SLIDING, params, max_len=512, prefill_matmul_dtype="int8")
