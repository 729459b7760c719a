"""The unconstrained decode cuts a batch to its still-going rows (``JaxSampler._launch``,
``decode.take_rows``): the rows' tokens, logprobs, lengths and finish reasons are those of
the batch run to its end."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pmd_jax.models import decoder
from pmd_jax.sampling import decode
from pmd_jax.sampling.base import SamplerError, SamplingParams
from pmd_jax.sampling.jax_sampler import JaxSampler
from tests.fakes import tiny_model_config

TINY = tiny_model_config("sampler")


@pytest.fixture(scope="module")
def params():
    return decoder.init_params(TINY, jax.random.PRNGKey(3))


def _run(params, min_rows: int, sp: SamplingParams, prompts) -> list:
    s = JaxSampler(TINY, params, max_len=128, min_decode_rows=min_rows)
    return list(s.generate(prompts, sp))


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])
def test_cut_batches_give_the_tokens_of_the_whole_batch(params, monkeypatch, temperature):
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, TINY.vocab_size, int(rng.integers(3, 20))))
               for _ in range(23)]
    # a tenth of the vocabulary stops a row: rows end at many different steps
    stops = tuple(int(t) for t in rng.choice(TINY.vocab_size, TINY.vocab_size // 10,
                                             replace=False))
    sp = SamplingParams(n=2, temperature=temperature, max_tokens=40, seed=7,
                        stop_token_ids=stops)
    cuts = []
    real_take = decode.take_rows
    monkeypatch.setattr(decode, "take_rows",
                        lambda tree, rows: cuts.append(len(rows)) or real_take(tree, rows))
    whole = _run(params, 10**6, sp, prompts)
    assert not cuts
    cut = _run(params, 1, sp, prompts)
    assert cuts, "the batch was never cut"
    lengths = [len(r.tokens) for r in whole]
    assert len(set(lengths)) > 5 and "stop" in {r.finish_reason for r in whole}
    for a, b in zip(whole, cut, strict=True):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-6)
        assert a.finish_reason == b.finish_reason


def test_take_rows_cuts_cache_and_state(params):
    cache = decoder.init_cache(TINY, 4, 16, per_layer=True)
    cache = {**cache, "mask": cache["mask"].at[2, 3].set(True)}
    cut = decode.take_rows(cache, np.array([2, 0]))
    assert cut["mask"].shape == (2, 16) and bool(cut["mask"][0, 3])
    assert all(k.shape[0] == 2 for k in cut["k"]) and cut["index"] is cache["index"]
    stacked = decoder.init_cache(TINY, 4, 16)
    assert decode.take_rows(stacked, np.array([1]))["k"].shape[1] == 1


def test_min_decode_rows_refused_below_one(params):
    with pytest.raises(SamplerError, match="min_decode_rows"):
        JaxSampler(TINY, params, min_decode_rows=0)
