"""Sampling math vs numpy formulas and HF transformers' logits warpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from pmd_jax.sampling import sample_ops


def _np_top_k(x: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= x.shape[-1]:
        return x.copy()
    kth = np.sort(x, axis=-1)[..., ::-1][..., k - 1 : k]
    return np.where(x >= kth, x, -np.inf)


def _np_top_p(x: np.ndarray, p: float) -> np.ndarray:
    out = np.full_like(x, -np.inf)
    for r in range(x.shape[0]):
        order = np.argsort(-x[r], kind="stable")
        e = np.exp(x[r] - x[r].max())
        probs = e / e.sum()
        mass = 0.0
        for i in order:
            if mass < p or p >= 1.0:
                out[r, i] = x[r, i]
            mass += probs[i]
    return out


@pytest.mark.parametrize("k", [0, 1, 5, 40, 64])
def test_top_k_matches_numpy_and_hf(k):
    rng = np.random.default_rng(k)
    x = rng.normal(size=(6, 64)).astype(np.float32) * 3
    got = np.asarray(sample_ops.top_k_filter(jnp.asarray(x), k))
    np.testing.assert_array_equal(got, _np_top_k(x, k))
    if k > 0:
        hf = TopKLogitsWarper(top_k=k, filter_value=-float("inf"))(None, torch.tensor(x)).numpy()
        np.testing.assert_array_equal(got, hf)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.7, 0.9, 0.999, 1.0])
def test_top_p_matches_numpy_and_hf(p):
    rng = np.random.default_rng(int(p * 1000))
    x = rng.normal(size=(6, 80)).astype(np.float32) * 2
    got = np.asarray(sample_ops.top_p_filter(jnp.asarray(x), p))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(_np_top_p(x, p)))
    np.testing.assert_array_equal(got[np.isfinite(got)], x[np.isfinite(got)])
    if p < 1.0:
        hf = TopPLogitsWarper(top_p=p, filter_value=-float("inf"))(None, torch.tensor(x)).numpy()
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(hf))


def test_per_row_settings_and_combined_filter():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 50)).astype(np.float32)
    temp = np.array([0.5, 1.0, 2.0], np.float32)
    ks = np.array([0, 10, 3])
    ps = np.array([0.8, 1.0, 0.5], np.float32)
    got = np.asarray(sample_ops.filter_logits(jnp.asarray(x), temp, ks, ps))
    for r in range(3):
        ref = _np_top_p(_np_top_k(x[r : r + 1] / temp[r], int(ks[r])), float(ps[r]))
        np.testing.assert_array_equal(np.isfinite(got[r]), np.isfinite(ref[0]))
        np.testing.assert_allclose(got[r][np.isfinite(got[r])], ref[0][np.isfinite(ref[0])],
                                   rtol=1e-6)


def _peaked(rng, b: int, v: int, scale: float) -> np.ndarray:
    """Logits like a small LM's: a few likely tokens over a long flat tail."""
    x = rng.normal(size=(b, v)).astype(np.float32)
    x[:, :5] += scale * rng.uniform(0.5, 1.0, size=(b, 5)).astype(np.float32)
    return x[:, rng.permutation(v)]


@pytest.mark.parametrize("k,p,scale,exact", [
    (0, 0.95, 20.0, True),    # nucleus inside the 64 largest
    (0, 0.9, 0.0, False),     # flat: the nucleus needs thousands of tokens -> sort path
    (40, 0.95, 0.0, True),    # top-k <= fast_k leaves 40 tokens
    (40, 1.0, 0.0, True),
    (500, 1.0, 0.0, False),   # k > fast_k
    (0, 1.0, 0.0, True),
])
def test_fast_filter_is_the_sorting_filters_where_it_says_exact(k, p, scale, exact):
    rng = np.random.default_rng(k + int(p * 100))
    x = _peaked(rng, 8, 4096, scale)
    ref = np.asarray(sample_ops.top_p_filter(sample_ops.top_k_filter(jnp.asarray(x), k), p))
    got, ok = sample_ops.fast_filter(jnp.asarray(x), k, p, fast_k=64)
    assert np.asarray(ok).all() == exact
    ok = np.asarray(ok)
    np.testing.assert_array_equal(np.asarray(got)[ok], ref[ok])
    # filter_logits takes the sort path for the whole batch if one row needs it
    full = np.asarray(sample_ops.filter_logits(jnp.asarray(x), 1.0, k, p, fast_k=64))
    np.testing.assert_array_equal(np.isfinite(full), np.isfinite(ref))


def test_wide_filter_when_the_first_fast_k_is_not_enough():
    """Nuclei of 41-177 tokens: none within the 16 largest, five within the 8 x 16 = 128
    largest, one beyond; every level gives the sorting filters' (and HF's) result."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(6, 4096)).astype(np.float32)
    for r, m in enumerate((60, 80, 100, 120, 150, 300)):
        x[r, :m] += 9.0
    ref = np.asarray(sample_ops.top_p_filter(jnp.asarray(x), 0.9))
    assert not np.asarray(sample_ops.fast_filter(jnp.asarray(x), 0, 0.9, fast_k=16)[1]).any()
    wide_ok = np.asarray(sample_ops.fast_filter(jnp.asarray(x), 0, 0.9, fast_k=128)[1])
    assert wide_ok[:5].all() and not wide_ok[5]
    for rows in (slice(0, 5), slice(0, 6)):  # all rows exact at 128 / one row needs the sort
        got = np.asarray(sample_ops.filter_logits(jnp.asarray(x[rows]), 1.0, 0, 0.9, fast_k=16))
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref[rows]))
        hx = TopPLogitsWarper(top_p=0.9, filter_value=-float("inf"))(None, torch.tensor(x[rows]))
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(hx.numpy()))


@pytest.mark.parametrize("fast_k", [8, 256])
def test_filter_logits_matches_numpy_and_hf_on_both_paths(fast_k):
    rng = np.random.default_rng(fast_k)
    x = _peaked(rng, 6, 200, 8.0)
    for k, p in [(0, 0.9), (5, 0.95), (0, 0.3), (20, 0.99), (0, 1.0)]:
        got = np.asarray(sample_ops.filter_logits(jnp.asarray(x), 1.0, k, p, fast_k=fast_k))
        ref = _np_top_p(_np_top_k(x, k), p)
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref), err_msg=f"{k} {p}")
        hx = torch.tensor(x)
        if k > 0:
            hx = TopKLogitsWarper(top_k=k, filter_value=-float("inf"))(None, hx)
        if p < 1.0:
            hx = TopPLogitsWarper(top_p=p, filter_value=-float("inf"))(None, hx)
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(hx.numpy()))


def test_scaled_log_probs_formula():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 30)).astype(np.float32) * 4
    t = np.array([0.0, 0.7, 1.0, 1.5], np.float32)
    got = np.asarray(sample_ops.scaled_log_probs(jnp.asarray(x), t))
    ref = torch.log_softmax(torch.tensor(x) / torch.tensor([1.0, 0.7, 1.0, 1.5])[:, None], -1)
    np.testing.assert_allclose(got, ref.numpy(), atol=1e-6)


def test_greedy_and_logprobs():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 100)).astype(np.float32)
    keys = sample_ops.row_keys(0, jnp.arange(5), jnp.zeros(5, jnp.int32), 0)
    tok, lp = sample_ops.sample_tokens(jnp.asarray(x), keys, 0.0, 0, 1.0)
    np.testing.assert_array_equal(np.asarray(tok), x.argmax(-1))
    ref = torch.log_softmax(torch.tensor(x), -1).numpy()[np.arange(5), x.argmax(-1)]
    np.testing.assert_allclose(np.asarray(lp), ref, atol=1e-6)


def test_sampled_logprob_is_unfiltered_at_temperature():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(8, 40)).astype(np.float32)
    keys = sample_ops.row_keys(7, jnp.arange(8), jnp.arange(8), 3)
    tok, lp = sample_ops.sample_tokens(jnp.asarray(x), keys, 0.8, 5, 0.9)
    tok = np.asarray(tok)
    ref = torch.log_softmax(torch.tensor(x) / 0.8, -1).numpy()[np.arange(8), tok]
    np.testing.assert_allclose(np.asarray(lp), ref, atol=1e-6)
    allowed = np.isfinite(_np_top_p(_np_top_k(x / 0.8, 5), 0.9))
    assert allowed[np.arange(8), tok].all()


def test_empirical_distribution_matches_filtered_softmax():
    # one row repeated with many different keys: frequencies ~ renormalised filtered probs
    rng = np.random.default_rng(4)
    row = rng.normal(size=(12,)).astype(np.float32)
    n = 20000
    x = jnp.broadcast_to(jnp.asarray(row), (n, 12))
    keys = sample_ops.row_keys(1, jnp.zeros(n, jnp.int32), jnp.arange(n), 0)
    tok, _ = jax.jit(lambda a, k: sample_ops.sample_tokens(a, k, 1.3, 6, 0.85))(x, keys)
    freq = np.bincount(np.asarray(tok), minlength=12) / n
    f = _np_top_p(_np_top_k(row[None] / 1.3, 6), 0.85)[0]
    probs = np.where(np.isfinite(f), np.exp(f - f[np.isfinite(f)].max()), 0.0)
    probs /= probs.sum()
    assert (freq[probs == 0] == 0).all()
    np.testing.assert_allclose(freq, probs, atol=0.015)


def test_row_keys_depend_on_each_coordinate_only():
    base = sample_ops.row_keys(3, jnp.array([0, 1]), jnp.array([2, 2]), 5)
    again = sample_ops.row_keys(3, jnp.array([1]), jnp.array([2]), 5)
    np.testing.assert_array_equal(np.asarray(base[1]), np.asarray(again[0]))
    for other in (
        sample_ops.row_keys(4, jnp.array([0]), jnp.array([2]), 5),
        sample_ops.row_keys(3, jnp.array([0]), jnp.array([1]), 5),
        sample_ops.row_keys(3, jnp.array([0]), jnp.array([2]), 6),
    ):
        assert not np.array_equal(np.asarray(base[0]), np.asarray(other[0]))


def test_traced_needs_filter_skips_sort():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(4, 20)).astype(np.float32))
    keys = sample_ops.row_keys(0, jnp.arange(4), jnp.zeros(4, jnp.int32), 0)
    f = jax.jit(lambda a, k, nf: sample_ops.sample_tokens(a, k, 1.0, 0, 1.0, needs_filter=nf))
    t1, l1 = f(x, keys, jnp.array(True))
    t2, l2 = f(x, keys, jnp.array(False))
    np.testing.assert_array_equal(np.asarray(t1), np.asarray(t2))
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2))


def _two_level_reference(logp: np.ndarray, u: np.ndarray, block: int
                         ) -> tuple[np.ndarray, np.ndarray]:
    """The draw by its formula, in float64: the block whose cumulative mass first exceeds
    ``u0 * total``, then the token in it whose cumulative mass first exceeds ``u1 * block
    mass``. Returns the indices and each row's distance to the nearest boundary of either
    level (where float32 rounding may legitimately choose the neighbour)."""
    rows, v = logp.shape
    nb = -(-v // block)
    p = np.where(np.isfinite(logp), np.exp(logp.astype(np.float64) - logp.max(-1, keepdims=True)),
                 0.0)
    pb = np.pad(p, ((0, 0), (0, nb * block - v))).reshape(rows, nb, block)
    bcdf = np.cumsum(pb.sum(-1), -1) / pb.sum((-2, -1))[:, None]
    idx, margin = np.zeros(rows, np.int64), np.zeros(rows)
    for r in range(rows):
        blk = int(np.searchsorted(bcdf[r], u[r, 0], side="right"))
        icdf = np.cumsum(pb[r, blk]) / pb[r, blk].sum()
        idx[r] = blk * block + int(np.searchsorted(icdf, u[r, 1], side="right"))
        margin[r] = min(np.abs(bcdf[r] - u[r, 0]).min(), np.abs(icdf - u[r, 1]).min())
    return idx, margin


@pytest.mark.parametrize("v,block", [(1000, 256), (49152, 256), (37, 8)])
def test_inverse_cdf_matches_numpy_searchsorted(v, block):
    rng = np.random.default_rng(v)
    logp = rng.normal(scale=3.0, size=(6, v)).astype(np.float32)
    logp[:, rng.choice(v, size=v // 3, replace=False)] = -np.inf
    u = rng.uniform(size=(6, 64, 2)).astype(np.float32)
    fn = jax.jit(lambda lp, uu: sample_ops.inverse_cdf_sample(lp, uu, block=block))
    checked = 0
    for c in range(u.shape[1]):
        got = np.asarray(fn(jnp.asarray(logp), jnp.asarray(u[:, c])))
        want, margin = _two_level_reference(logp, u[:, c].astype(np.float64), block)
        assert np.isfinite(logp[np.arange(6), got]).all()  # never an excluded token
        away = margin > 1e-5  # away from float32 rounding at a boundary of either level
        np.testing.assert_array_equal(got[away], want[away])
        checked += int(away.sum())
    assert checked > 300


def test_inverse_cdf_resolves_a_near_uniform_vocabulary():
    # 49,152 near-uniform logits (a random model's): each token holds ~2e-5 of the mass. The
    # two-level draw follows the float64 formula on every row away from a boundary (almost
    # all: each level's boundaries are ~1/256 of its scale apart), and logits moved by ~1 ulp
    # (another summation order) leave the draws where they were. What the old one-uniform
    # draw did under the same moves is the slow test below.
    rng = np.random.default_rng(3)
    v, rows = 49152, 256
    logits = rng.normal(scale=0.2, size=(rows, v)).astype(np.float32)
    moved = (logits * (1 + rng.normal(scale=1e-7, size=logits.shape))).astype(np.float32)
    u = rng.uniform(size=(rows, 2)).astype(np.float32)
    fn = jax.jit(lambda x, uu: sample_ops.inverse_cdf_sample(jax.nn.log_softmax(x), uu))
    got = np.asarray(fn(jnp.asarray(logits), jnp.asarray(u)))
    want, margin = _two_level_reference(logits, u.astype(np.float64), 256)
    away = margin > 1e-5
    assert away.mean() >= 0.95
    np.testing.assert_array_equal(got[away], want[away])
    assert int((np.asarray(fn(jnp.asarray(moved), jnp.asarray(u))) != got).sum()) <= 1


def test_inverse_cdf_extremes_never_pick_excluded():
    logp = np.full((3, 600), -np.inf, np.float32)
    logp[0, 0] = 0.0          # only the first token
    logp[1, 599] = 0.0        # only the last token (in the padded last block)
    logp[2, [10, 300]] = [0.0, -30.0]  # a tiny second mass in another block
    for uu in (0.0, 0.5, np.nextafter(np.float32(1.0), np.float32(0.0))):
        got = np.asarray(sample_ops.inverse_cdf_sample(
            jnp.asarray(logp), jnp.full((3, 2), uu, jnp.float32)))
        assert got[0] == 0 and got[1] == 599 and got[2] in (10, 300)


def _one_uniform_draw(logp: jax.Array, u: jax.Array) -> jax.Array:
    """The draw before a51b6f0, for comparison: one float32 uniform against the whole CDF."""
    p = jnp.exp(logp - logp.max(-1, keepdims=True))
    cdf = jnp.cumsum(p, axis=-1)
    return jnp.sum(cdf <= (u * cdf[:, -1])[:, None], axis=-1).astype(jnp.int32)


@pytest.mark.slow
def test_two_uniforms_flip_far_fewer_draws_than_one_under_ulp_moves():
    # The measurement behind inverse_cdf_sample's docstring at one logit scale: 16,384 rows
    # of 49,152 logits (std 1), the logits scaled by (1 + 1e-7 noise), i.e. moved by about an
    # ulp, as another summation order moves them. Measured here: 25 draws flipped with one
    # uniform, 0 with two. (~4 min on a 2-core machine, ~2 GiB)
    rng = np.random.default_rng(0)
    rows, v = 4096, 49152
    one = jax.jit(lambda x, uu: _one_uniform_draw(jax.nn.log_softmax(x), uu[:, 0]))
    two = jax.jit(lambda x, uu: sample_ops.inverse_cdf_sample(jax.nn.log_softmax(x), uu))
    flips = {"one": 0, "two": 0}
    for _ in range(4):
        x = rng.normal(scale=1.0, size=(rows, v)).astype(np.float32)
        moved = jnp.asarray((x * (1 + rng.normal(scale=1e-7, size=x.shape))).astype(np.float32))
        x = jnp.asarray(x)
        u = jnp.asarray(rng.uniform(size=(rows, 2)), jnp.float32)
        for name, fn in (("one", one), ("two", two)):
            flips[name] += int((fn(x, u) != fn(moved, u)).sum())
    assert flips["one"] >= 8, flips  # the effect is there to be removed
    assert flips["two"] <= 3 and flips["two"] * 5 <= flips["one"], flips
