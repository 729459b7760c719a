"""Sampling math vs numpy formulas and HF transformers' logits warpers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import optimize, stats
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


# ------------------------------------------------------------- draws vs the target distribution
#
# The sampler's draws against the distribution they should follow, computed here with numpy in
# float64 from its definition (softmax of the temperature-scaled logits, top-k then top-p), not
# with sample_ops: a chi-square goodness-of-fit test on many independent draws of one row (one
# key per sample index, as decode gives each sample of a prompt its own key), plus an exact
# check that no token the filters exclude is ever drawn.
#
# Cells: each token holding >= CELL_MASS (0.5%) of the target mass is its own cell; the rarer
# tokens are pooled in id order, within each 256-token block, into runs of consecutive ids
# holding >= CELL_MASS each (expected counts are then >= 80, far above the 5 the chi-square
# approximation needs, and the degrees of freedom stay low enough for the power below). Level
# ALPHA = 1e-3 per case: with the fixed seeds the p-values are fixed (asserted > ALPHA; they
# are 0.13-0.93); were the seeds changed, a correct sampler would still fail a case only once
# per 1,000 seeds.
#
# Power (noncentral chi-square, scipy.stats.ncx2; _min_detectable_shift): moving delta of the
# probability mass from any one cell to any other gives the noncentrality
# n * delta**2 * (1/p_a + 1/p_b) >= n * delta**2 * (1/p_1 + 1/p_2), p_1, p_2 the two largest
# cells, so per case every such shift of at least this many points of probability is detected
# with power >= 0.9 at level ALPHA (computed once; test_chi_square_design_has_the_stated_power
# asserts these bounds, STATED_SHIFT):
#   temperature 0.6, no filter, V=1000 (4 blocks), 16,384 draws:        1.1 points
#   top-k 40 at T=1.3, V=1000, 8,192 draws:                              1.16 points
#   top-k 100 + top-p 0.5 at T=0.8, V=1000 (fast filter), 8,192 draws:   1.4 points
#   top-p 0.7 at T=0.8, V=1000 (fast filter, 143 tokens), 16,384 draws:  0.91 points
#   top-k 280 + top-p 0.3, V=300 (sorting filters), 8,192 draws:         1.8 points
#   top-k 6 + top-p 0.85 at T=1.3, V=12 (one block), 32,768 draws:       1.16 points
# (between two tokens of ~4% each, 1 point is a 25% relative bias). Any other bias whose
# noncentrality n * sum((q - p)**2 / p) over the cells reaches the same value (28-77 for these
# 4-98 degrees of freedom) is detected with the same power. The temperature case is built for
# biases at the ends of either level's CDF (a uniform scaled or clamped, a total or cumsum off
# by one): its outer blocks and the first and last token of each inner block are cells of
# ~0.6% that such a bias empties, noncentrality >= 0.006 n = 97 each, power >= 0.98 (with the
# fixed seed, either uniform scaled by 0.99 gives p < 1e-8; by 0.995, p = 1e-5 (block) and
# 7e-4 (inner), the edge of what this case detects).
# The draw count is the cost: ~0.1 ms a draw at this suite's XLA -O0 on a 2-core machine.

ALPHA = 1e-3
POWER = 0.9
CELL_MASS = 0.005
BLOCK_EDGES = (0, 1, 254, 255, 256, 257, 510, 511, 512, 513, 766, 767, 768, 769, 998, 999)


def _cdf_ends_logits(seed: int, temperature: float) -> np.ndarray:
    """Logits (V=1000) whose softmax at ``temperature`` puts 0.6% of the mass on each of the
    outer blocks (ids 0-255, 768-999) and 49.4% on each inner one. In each inner block six
    likely tokens hold 48% of the block (two on each side of the 511|512 boundary), the first
    and the last token 1.2% each, a log-normal tail the rest. Either end of either level's CDF
    is then a cell of its own that a bias there empties: the outer blocks for the block uniform,
    the first and last token of each inner block for the inner uniform."""
    rng = np.random.default_rng(seed)
    w = np.zeros(1000)
    inner = {256: [300, 350, 400, 450, 509, 510], 512: [513, 514, 600, 650, 700, 750]}
    for lo, hi in ((0, 256), (256, 512), (512, 768), (768, 1000)):
        ids = np.arange(lo, hi)
        tail = np.exp(rng.normal(size=hi - lo))
        if lo not in inner:
            w[ids] = 0.006 * tail / tail.sum()
            continue
        likely, ends = inner[lo], [lo, hi - 1]
        tail[np.isin(ids, likely + ends)] = 0.0
        w[ids] = 0.494 * 0.496 * tail / tail.sum()
        w[likely] = 0.494 * 0.48 * rng.dirichlet(np.full(len(likely), 20.0))
        w[ends] = 0.494 * 0.012
    return (temperature * np.log(w)).astype(np.float32)


def _spread_logits(seed: int, v: int = 1000) -> np.ndarray:
    """Standard normal logits but 20 tokens at 3-3.6: 16 on both sides of the 256-token block
    boundaries (and the first and last ids, the last one in the padded fourth block) and 4
    inside blocks, so the likely mass straddles every block boundary and every block matters."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=v)
    heavy = [i for i in (*BLOCK_EDGES, 100, 400, 640, 900) if i < v]
    x[heavy] = rng.uniform(3.0, 3.6, size=len(heavy))
    return x.astype(np.float32)


def _target_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float
                  ) -> np.ndarray:
    """The distribution the sampler must follow, in float64 from the definitions (vLLM / HF
    order: temperature, top-k, then top-p on the top-k-renormalised probabilities)."""
    x = _np_top_k(logits.astype(np.float64)[None] / temperature, top_k)[0]
    if top_p < 1.0:
        e = np.exp(x - x.max())
        probs = np.sort(e / e.sum())[::-1]
        before = np.cumsum(probs) - probs
        # design check: no token's mass-before within float32 rounding of top_p
        assert np.abs(before - top_p).min() > 1e-4, "ambiguous nucleus: choose another row"
        x = _np_top_p(x[None], top_p)[0]
    p = np.where(np.isfinite(x), np.exp(x - x.max()), 0.0)
    return p / p.sum()


def _cells(p: np.ndarray, block: int = 256) -> list[np.ndarray]:
    """Token ids of each chi-square cell (see above): tokens with p >= CELL_MASS alone; the
    other tokens with p > 0 pooled in id order, within each 256-token block, into runs of
    >= CELL_MASS (a block's short last run joins the block's previous run, if it has one)."""
    cells: list[np.ndarray] = []
    for start in range(0, len(p), block):
        runs: list[list[int]] = []
        run: list[int] = []
        for i in range(start, min(start + block, len(p))):
            if p[i] >= CELL_MASS:
                cells.append(np.array([i]))
            elif p[i] > 0:
                run.append(i)
                if p[run].sum() >= CELL_MASS:
                    runs.append(run)
                    run = []
        if run and runs:
            runs[-1] += run
        elif run:
            runs.append(run)
        cells += [np.array(r) for r in runs]
    return cells


def _min_detectable_shift(cell_probs: np.ndarray, n: int) -> float:
    """Smallest mass shift between two cells that the test detects with probability POWER
    (the two largest cells: the hardest pair)."""
    df = len(cell_probs) - 1
    crit = stats.chi2.ppf(1 - ALPHA, df)
    lam = optimize.brentq(lambda nc: stats.ncx2.sf(crit, df, nc) - POWER, 1e-3, 1e4)
    p1, p2 = np.sort(cell_probs)[-2:]
    return float(np.sqrt(lam / (n * (1 / p1 + 1 / p2))))


@functools.partial(jax.jit, static_argnames=("rows",))
def _draw_counts(logits: jax.Array, prompt: jax.Array, start: jax.Array, temperature: jax.Array,
                 top_k: jax.Array, top_p: jax.Array, *, rows: int) -> jax.Array:
    """Token counts of ``rows`` draws from one logits row: sample indices ``start + i`` of one
    prompt, each with its own key, through ``sample_tokens`` as decode calls it."""
    x = jnp.broadcast_to(logits, (rows, logits.shape[0]))
    keys = sample_ops.row_keys(11, jnp.full((rows,), prompt), start + jnp.arange(rows), 0)
    tok, _ = sample_ops.sample_tokens(x, keys, temperature, top_k, top_p)
    return jnp.bincount(tok, length=logits.shape[0])


# (id, logits, temperature, top_k, top_p, draws): prompt index = the case's position
GOF_CASES = [
    ("temperature", _cdf_ends_logits(20, 0.6), 0.6, 0, 1.0, 1 << 14),
    ("top_k", _spread_logits(21), 1.3, 40, 1.0, 1 << 13),
    ("top_k_top_p", _spread_logits(22), 0.8, 100, 0.5, 1 << 13),
    ("top_p", _spread_logits(23), 0.8, 0, 0.7, 1 << 14),
    ("top_k_top_p_sorting", _spread_logits(24, 300), 1.0, 280, 0.3, 1 << 13),
    ("small_vocab", np.random.default_rng(4).normal(size=12).astype(np.float32), 1.3, 6, 0.85,
     1 << 15),
]
STATED_SHIFT = {"temperature": 0.011, "top_k": 0.0116, "top_k_top_p": 0.014, "top_p": 0.0091,
                "top_k_top_p_sorting": 0.018, "small_vocab": 0.0116}


def _gof_case(name: str) -> tuple:
    return next(c for c in GOF_CASES if c[0] == name)


def _sample_counts(case: int) -> np.ndarray:
    _, logits, t, k, p, n = GOF_CASES[case]
    rows = min(n, 8192)
    got = np.zeros(logits.shape[0], np.int64)
    for start in range(0, n, rows):
        got += np.asarray(_draw_counts(jnp.asarray(logits), jnp.int32(case), jnp.int32(start),
                                       jnp.float32(t), jnp.int32(k), jnp.float32(p), rows=rows))
    return got


@pytest.mark.parametrize("case", range(len(GOF_CASES)), ids=[c[0] for c in GOF_CASES])
def test_draws_follow_the_target_distribution(case: int) -> None:
    """``sample_tokens``'s draws from one row, with a key per sample index, follow the softmax
    of the temperature-scaled, top-k / top-p filtered logits computed here in float64: no
    excluded token is ever drawn (exact), and a chi-square test at level ALPHA does not reject
    (its power is in the comment above). The V=1000 rows span four 256-token blocks of the
    two-uniform draw with likely tokens on both sides of block boundaries; the temperature
    case's CDF ends are small cells of their own, so a bias of either uniform, of the block
    sums or of a cumsum shows; the top-p cases take the fast filter (nucleus within the 256
    largest logits) and the sorting filters (top-k 280 > FAST_FILTER_K)."""
    name, logits, t, k, p, n = GOF_CASES[case]
    target = _target_probs(logits, t, k, p)
    got = _sample_counts(case)
    assert got.sum() == n
    excluded = np.flatnonzero(target == 0)
    assert got[excluded].sum() == 0, f"excluded tokens drawn: {excluded[got[excluded] > 0]}"
    cells = _cells(target)
    obs = np.array([got[c].sum() for c in cells])
    exp = np.array([target[c].sum() for c in cells]) * n
    assert exp.min() >= 5
    stat, pval = stats.chisquare(obs, exp)
    worst = np.argsort(-(obs - exp) ** 2 / exp)[:3]
    assert pval > ALPHA, (
        f"{name}: chi2 {stat:.1f} on {len(cells) - 1} df, p = {pval:.2e}; worst cells (first "
        f"token, observed, expected): "
        f"{[(int(cells[i][0]), int(obs[i]), round(float(exp[i]), 1)) for i in worst]}")


def test_chi_square_design_has_the_stated_power() -> None:
    """The power figures quoted above hold for the cases as they are (draw counts, cells):
    for each case, a mass shift of STATED_SHIFT between any two cells is detected with
    probability >= POWER at level ALPHA. Also what the cases are built for: every block of
    the spread V=1000 rows holds > 5% of the mass; in the temperature case the outer blocks
    and the ends of the inner blocks are cells of their own holding 0.5-1% (so a 1% bias at
    either end of either level's CDF empties at least one of them); the top-p cases take
    the filter path they are meant to cover."""
    for name, logits, t, k, p, n in GOF_CASES:
        target = _target_probs(logits, t, k, p)
        cells = _cells(target)
        shift = _min_detectable_shift(np.array([target[c].sum() for c in cells]), n)
        assert shift <= STATED_SHIFT[name], (name, shift)
        if logits.shape[0] == 1000:
            blocks = np.pad(target, (0, 24)).reshape(4, 256).sum(-1)
            assert blocks.min() > (0.005 if name == "temperature" else 0.05), (name, blocks)
    _, logits, t, k, p, _ = _gof_case("temperature")
    target = _target_probs(logits, t, k, p)
    ends = {tuple(c) for c in _cells(target)}
    for end in (range(256), [256], [511], [512], [767], range(768, 1000)):
        assert tuple(end) in ends and 0.005 <= target[list(end)].sum() <= 0.01, end
    for name, fast in (("top_k_top_p", True), ("top_p", True), ("top_k_top_p_sorting", False)):
        _, logits, t, k, p, _ = _gof_case(name)
        x = jnp.asarray(logits[None] / t)
        assert bool(sample_ops.fast_filter(x, k, p)[1][0]) == fast, name


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
