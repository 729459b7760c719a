"""A batch's shared prompt prefix is prefilled once (``decode.prefill_after``): the rows'
tokens and logprobs are those of each prompt prefilled whole, and of the trainer's forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.models import decoder
from pmd_jax.sampling import jax_sampler
from pmd_jax.sampling.base import SamplingParams
from pmd_jax.sampling.jax_sampler import JaxSampler
from tests.fakes import tiny_model_config

TINY = tiny_model_config("sampler")


@pytest.fixture(scope="module")
def params():
    return decoder.init_params(TINY, jax.random.PRNGKey(5))


def _prompts(prefix_len: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    prefix = list(rng.integers(1, TINY.vocab_size, prefix_len))
    return [prefix + list(rng.integers(1, TINY.vocab_size, int(rng.integers(1, 30))))
            for _ in range(9)]


@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])
def test_shared_prefix_gives_the_tokens_of_whole_prefills(params, monkeypatch, temperature):
    prompts = _prompts(45)
    sp = SamplingParams(n=2, temperature=temperature, max_tokens=10, seed=3)
    shared = JaxSampler(TINY, params, max_len=128)
    assert shared._shared_prefix([np.asarray(p) for p in prompts], 64) == 44  # a length bucket
    a = list(shared.generate(prompts, sp))
    positions_shared = shared.last_metrics.prefill_positions
    monkeypatch.setattr(jax_sampler, "MIN_SHARED_PREFIX", 10**6)
    whole = JaxSampler(TINY, params, max_len=128)
    b = list(whole.generate(prompts, sp))
    assert positions_shared < whole.last_metrics.prefill_positions
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
    # and the trainer's view: one forward over prompt + response
    t = temperature or 1.0
    for r in a:
        seq = np.asarray(prompts[r.prompt_index] + r.tokens.tolist(), np.int32)
        logits, _ = decoder.forward(params, jnp.asarray(seq)[None],
                                    jnp.arange(len(seq))[None], TINY)
        lp = jax.nn.log_softmax(logits[0, len(prompts[r.prompt_index]) - 1:-1] / t, -1)
        ref = np.asarray(lp)[np.arange(len(r.tokens)), r.tokens]
        np.testing.assert_allclose(r.logprobs, ref, atol=1e-5)


def test_no_shared_prefix_when_short_or_alone(params):
    s = JaxSampler(TINY, params, max_len=128)
    short = [np.asarray(p) for p in _prompts(20)]
    assert s._shared_prefix(short, 64) == 0
    assert s._shared_prefix(short[:1], 64) == 0
    same = [np.arange(1, 50), np.arange(1, 50)]  # a prompt keeps one token of its own
    assert s._shared_prefix(same, 64) == 48


def test_shared_system_prompt_greedy_equals_hf_generate():
    """Real SmolLM2 weights, chat prompts that share a long system message (prefilled once):
    the greedy tokens are HF transformers' ``generate`` on the same left-padded prompts."""
    import torch

    from tests.sampling.test_jax_sampler import QUESTIONS, _smollm2

    tok, hf, cfg, params = _smollm2(from_gguf=False)
    system = ("You are a careful science tutor. Read the question, think about which "
              "principle of physics, chemistry or biology applies, and answer in one short, "
              "precise sentence without any preamble.")
    prompts = []
    for q in QUESTIONS[:6]:
        ids = tok.apply_chat_template([{"role": "system", "content": system},
                                       {"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    s = JaxSampler(cfg, params, max_len=512, pad_id=tok.pad_token_id)
    assert s._shared_prefix([np.asarray(p) for p in prompts], 512) >= 32
    max_new = 16
    out = s.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new,
                                             stop_token_ids=(tok.eos_token_id,)))
    tok.padding_side = "left"
    enc = tok.pad({"input_ids": prompts}, return_tensors="pt")
    with torch.no_grad():
        ref = hf.generate(**enc, do_sample=False, max_new_tokens=max_new,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    width = enc["input_ids"].shape[1]
    for i, r in enumerate(out):
        want = [int(t) for t in ref[i, width:]]
        if tok.eos_token_id in want:
            want = want[: want.index(tok.eos_token_id) + 1]
        assert r.tokens.tolist() == want, f"prompt {i}"
