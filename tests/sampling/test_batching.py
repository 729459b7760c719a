"""The sampler's batch plan: optimal under its cost model (checked against exhaustive search of
every contiguous cut), padding-aware, compile-aware, and invisible in what is sampled."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from pmd_jax.models import decoder
from pmd_jax.sampling.base import SamplingParams
from pmd_jax.sampling.batching import CostModel, bucket_length, plan_batches, row_bucket
from pmd_jax.sampling.jax_sampler import JaxSampler
from tests.fakes import tiny_model_config


def _shape(b: int, plen: int) -> tuple[int, int]:
    return (b, bucket_length(plen))


def _cost(plan, lengths, out_len, divisor, compiled, cm: CostModel) -> float:
    total = 0.0
    for s, e in plan:
        rows = row_bucket(e - s, divisor)
        key = _shape(rows, lengths[e - 1])
        total += rows * key[1] + out_len * (cm.decode_step_base + cm.decode_step_per_row * rows)
        total += 0.0 if key in compiled else cm.compile_tokens
    return total


def _all_plans(n: int, max_rows: int):
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            edges = (0, *cuts, n)
            plan = list(zip(edges, edges[1:], strict=False))
            if all(e - s <= max_rows for s, e in plan):
                yield plan


def test_row_bucket_series_and_divisor():
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 36, 49)] == [
        1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 48, 64]
    assert [row_bucket(n, 8) for n in (1, 9, 17, 36)] == [8, 16, 24, 48]


@pytest.mark.parametrize("seed", range(12))
def test_plan_is_optimal_against_exhaustive_search(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    lengths = sorted(int(x) for x in rng.integers(5, 700, n))
    max_rows = int(rng.integers(1, 8))
    divisor = int(rng.choice([1, 2]))
    out_len = int(rng.choice([16, 32]))
    compiled = {_shape(row_bucket(int(rng.integers(1, 8)), divisor), int(rng.integers(5, 700)))
                for _ in range(3)}
    cm = CostModel(compile_tokens=float(rng.choice([0.0, 2000.0, 8192.0])))
    plan = plan_batches(lengths, max_rows, _shape, out_len, divisor=divisor, compiled=compiled,
                        cost=cm)
    assert [s for s, _ in plan] == [0] + [e for _, e in plan[:-1]] and plan[-1][1] == n
    assert all(0 < e - s <= max_rows for s, e in plan)
    got = _cost(plan, lengths, out_len, divisor, compiled, cm)
    best = min(_cost(p, lengths, out_len, divisor, compiled, cm)
               for p in _all_plans(n, max_rows))
    assert got == pytest.approx(best)


def test_long_tail_gets_its_own_batch_and_rows_are_not_padded_to_a_power_of_two():
    # 64 short prompts and 36 long ones (the shape of SciQ-with-passage evaluation): the old
    # split (64 rows, then 36 padded to 64 at the longest length) wastes half the prefill.
    lengths = sorted([150] * 64 + [300] * 30 + [570] * 6)
    plan = plan_batches(lengths, 64, _shape, 32)
    def padded(p):
        return sum(row_bucket(e - s) * bucket_length(lengths[e - 1]) for s, e in p)

    old_padded = 64 * 192 + 64 * 768  # 64 rows at bucket(150), 36 padded to 64 at bucket(570)
    assert padded(plan) < 0.55 * old_padded
    assert padded(plan) < 1.25 * sum(bucket_length(x) for x in lengths)


def test_compiled_shapes_are_preferred():
    lengths = [100] * 20
    fresh = plan_batches(lengths, 64, _shape, 16)
    assert fresh == [(0, 20)]  # one batch of 24 padded rows
    # With a 16-row program already compiled and compiles expensive, reuse it (16 + 4 rows is
    # then cheaper than compiling a 24-row program).
    reuse = plan_batches(lengths, 64, _shape, 16, compiled={(16, 128), (4, 128)},
                         cost=CostModel(compile_tokens=1e6))
    assert [e - s for s, e in reuse] == [16, 4] or [e - s for s, e in reuse] == [4, 16]


def test_unsorted_lengths_are_refused():
    with pytest.raises(ValueError, match="sorted"):
        plan_batches([5, 3], 4, _shape, 16)


def test_sampled_tokens_do_not_depend_on_the_plan():
    cfg = tiny_model_config("sampler")
    params = decoder.init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 95, int(n)).tolist() for n in rng.integers(2, 120, 11)]
    sp = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=10, seed=3)
    planned = JaxSampler(cfg, params, max_len=160, max_batch=8)
    out = planned.generate(prompts, sp)
    assert planned.last_metrics.batches >= 2  # 22 rows, at most 8 each
    one_by_one = JaxSampler(cfg, params, max_len=160, max_batch=1)
    ref = one_by_one.generate(prompts, sp)
    assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
    np.testing.assert_allclose([r.logprobs.sum() for r in out], [r.logprobs.sum() for r in ref],
                               rtol=1e-5, atol=1e-5)
