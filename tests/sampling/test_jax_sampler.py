"""In-process JAX sampler: HF generate parity on real SmolLM2 weights, logprobs vs the trainer
forward, seeded reproducibility, top-k / top-p, stop handling, bad input, weight swapping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pmd_jax.models import decoder
from pmd_jax.models.config import from_hf_config
from pmd_jax.sampling import sample_ops
from pmd_jax.sampling.base import Sampler, SamplerError, SamplingParams
from pmd_jax.sampling.jax_sampler import JaxSampler, bucket_length
from tests.fakes import tiny_model_config
from tests.host import matmul_tol, smollm2_gguf, smollm2_hf_dir

TINY = tiny_model_config("sampler")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [11]]
# Log-prob tolerances. The CPU values are for XLA:CPU, whose float32 matmuls are true fp32
# (CI's backend; kept as measured). This module leaves jax's default matmul precision, so on
# gpu/tpu the sampler's cached decode and the full forward run their matmuls in TF32 or bf16
# passes, rounded differently, and neither is torch's fp32: tests/host.py's matmul_tol picks
# a looser bound there (not measured on this CPU machine).
LOGPROB_ATOL = matmul_tol(cpu=1e-5, accelerator=1e-2)  # sampler vs the trainer's forward
HF_LOGPROB_ATOL = matmul_tol(cpu=1e-4, accelerator=1e-2)  # SmolLM2: vs our forward, HF


@pytest.fixture(scope="module")
def tiny_params():
    return decoder.init_params(TINY, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def tiny(tiny_params):
    return JaxSampler(TINY, tiny_params, max_len=128)


def _teacher_forced_logits(params, cfg, prompt, response):
    """The trainer's view: one full forward over prompt + response (no cache, no padding)."""
    seq = np.concatenate([np.asarray(prompt), np.asarray(response)]).astype(np.int32)
    logits, _ = decoder.forward(params, jnp.asarray(seq)[None], jnp.arange(len(seq))[None], cfg)
    return np.asarray(logits[0, len(prompt) - 1 : -1])  # logits predicting each response token


def test_bucket_length():
    assert [bucket_length(n) for n in (1, 16, 17, 24, 25, 33, 48, 49, 64, 65, 100)] == [
        16, 16, 24, 24, 32, 48, 48, 64, 64, 96, 128]


def test_is_a_sampler(tiny):
    assert isinstance(tiny, Sampler)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_equal_teacher_forced_forward(tiny, tiny_params, temperature):
    sp = SamplingParams(n=4, temperature=temperature, max_tokens=12, seed=5)
    out = tiny.generate(PROMPTS, sp)
    assert [(r.prompt_index, r.sample_index) for r in out] == [
        (p, s) for p in range(3) for s in range(4)]
    t = temperature if temperature > 0 else 1.0
    for r in out:
        logits = _teacher_forced_logits(tiny_params, TINY, PROMPTS[r.prompt_index], r.tokens)
        ref = torch.log_softmax(torch.tensor(logits) / t, -1).numpy()
        ref = ref[np.arange(len(r.tokens)), r.tokens]
        np.testing.assert_allclose(r.logprobs, ref, atol=LOGPROB_ATOL)
        assert r.tokens.dtype == np.int32 and r.logprobs.dtype == np.float32
        if temperature == 0.0:  # greedy = argmax of the trainer's logits at every step
            np.testing.assert_array_equal(r.tokens, logits.argmax(-1))


def test_seeded_sampling_reproducible_and_layout_independent(tiny_params):
    a = JaxSampler(TINY, tiny_params, max_len=128)
    b = JaxSampler(TINY, tiny_params, max_len=128, max_batch=1)  # one row per batch
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=11)
    r1 = [x.tokens.tolist() for x in a.generate(PROMPTS, sp)]
    r2 = [x.tokens.tolist() for x in a.generate(PROMPTS, sp)]
    r3 = [x.tokens.tolist() for x in b.generate(PROMPTS, sp)]
    assert r1 == r2 == r3
    assert len({tuple(x) for x in r1}) > 1  # samples of one prompt differ
    r4 = [x.tokens.tolist() for x in a.generate(PROMPTS, SamplingParams(
        n=3, temperature=1.0, max_tokens=12, seed=12))]
    assert r4 != r1


def test_top_k_one_and_tiny_top_p_are_greedy(tiny):
    greedy = [x.tokens.tolist() for x in tiny.generate(PROMPTS, SamplingParams(
        temperature=0.0, max_tokens=12))]
    for sp in (SamplingParams(temperature=1.5, top_k=1, max_tokens=12, seed=3),
               SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=12, seed=3)):
        assert [x.tokens.tolist() for x in tiny.generate(PROMPTS, sp)] == greedy


def _np_allowed(logits: np.ndarray, t: float, k: int, p: float) -> np.ndarray:
    """numpy reference: tokens that top-k then top-p (on softmax(logits / t)) can draw."""
    x = logits / t
    allowed = np.ones_like(x, bool)
    if k > 0:
        kth = np.sort(x, -1)[:, ::-1][:, k - 1 : k]
        allowed &= x >= kth
    z = np.where(allowed, x, -np.inf)
    for r in range(z.shape[0]):
        e = np.exp(z[r] - z[r].max())
        probs = e / e.sum()
        order = np.argsort(-z[r], kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        keep = np.zeros(z.shape[1], bool)
        keep[order[before < p]] = True
        allowed[r] &= keep
    return allowed


@pytest.mark.parametrize("k,p", [(5, 1.0), (0, 0.6), (8, 0.8)])
def test_sampled_tokens_respect_filters(tiny, tiny_params, k, p):
    sp = SamplingParams(n=4, temperature=1.2, top_k=k, top_p=p, max_tokens=12, seed=k)
    for r in tiny.generate(PROMPTS, sp):
        logits = _teacher_forced_logits(tiny_params, TINY, PROMPTS[r.prompt_index], r.tokens)
        allowed = _np_allowed(logits, 1.2, k, p)
        assert allowed[np.arange(len(r.tokens)), r.tokens].all()
        if k:
            assert allowed.sum(-1).max() <= k + 1  # (ties aside) at most k candidates


def test_stop_tokens_and_finish_reasons(tiny):
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=1)
    free = tiny.generate(PROMPTS, sp)
    # pick as stop tokens ones that occur mid-way in some free-running samples
    stops = sorted({int(r.tokens[3]) for r in free})[:2]
    out = tiny.generate(PROMPTS, SamplingParams(
        n=4, temperature=1.0, max_tokens=12, seed=1, stop_token_ids=tuple(stops)))
    n_stop = 0
    for f, r in zip(free, out):
        hits = [i for i, t in enumerate(f.tokens.tolist()) if t in stops]
        if hits:  # same draws up to and including the first stop token, then nothing
            n_stop += 1
            assert r.finish_reason == "stop"
            np.testing.assert_array_equal(r.tokens, f.tokens[: hits[0] + 1])
            np.testing.assert_array_equal(r.logprobs, f.logprobs[: hits[0] + 1])
        else:
            assert r.finish_reason == "length"
            assert len(r.tokens) == 12
            np.testing.assert_array_equal(r.tokens, f.tokens)
    assert n_stop >= 2


def test_max_tokens_one_and_large_batch_split(tiny_params):
    s = JaxSampler(TINY, tiny_params, max_len=64, max_batch=4)
    prompts = [[i + 1, (i * 7) % 90 + 1] for i in range(5)]
    out = s.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=1))
    # 10 rows, at most 4 per batch: 3 batches or more (the plan may prefer programs this
    # process has already compiled, see sampling/batching.py)
    assert len(out) == 10 and s.last_metrics.batches >= 3
    assert all(len(r.tokens) == 1 and r.finish_reason == "length" for r in out)
    # prompt + max_tokens exactly at max_len is allowed
    long = s.generate([list(range(1, 61))], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(long.items[0].tokens) == 4


@pytest.mark.parametrize(
    "prompts,sp,msg",
    [
        ([[1, 2]], SamplingParams(n=0, max_tokens=8), "n must be >= 1"),
        ([[1] * 120], SamplingParams(max_tokens=12), "context length max_len=128"),
        ([[1, 2]], SamplingParams(stop_token_ids=(5, 96), max_tokens=8), "outside the vocab"),
        ([[1, 2], []], SamplingParams(max_tokens=8), "prompt 1 is empty"),
        ([[1, 200]], SamplingParams(max_tokens=8), "token id 200 outside the vocabulary"),
        ([[1.5, 2.0]], SamplingParams(max_tokens=8), "non-integer"),
        ([[1, 2]], SamplingParams(top_p=0.0, max_tokens=8), "top_p"),
    ],
)
def test_bad_input_raises_clear_error(tiny, prompts, sp, msg):
    before = tiny.params
    with pytest.raises(SamplerError, match=msg):
        tiny.generate(prompts, sp)
    assert tiny.params is before


def test_empty_prompt_list(tiny):
    assert len(tiny.generate([], SamplingParams())) == 0


def test_set_params_validates_and_swaps(tiny_params):
    s = JaxSampler(TINY, tiny_params, max_len=128)
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    before = [r.tokens.tolist() for r in s.generate(PROMPTS, sp)]
    bad = dict(tiny_params, embed=tiny_params["embed"][:, :8])
    with pytest.raises(SamplerError, match="embed"):
        s.set_params(bad)
    assert [r.tokens.tolist() for r in s.generate(PROMPTS, sp)] == before  # nothing applied
    other = decoder.init_params(TINY, jax.random.PRNGKey(1))
    s.set_params(other, version=7)
    assert s.params["embed"] is other["embed"]  # device arrays are used as they are
    out = s.generate(PROMPTS, sp)
    assert out.weights_version == 7
    assert [r.tokens.tolist() for r in out] != before
    with pytest.raises(SamplerError, match="weight_source"):
        s.set_weights(3)


def test_release_params_until_set_params(tiny_params):
    """The trainer drops the sampler's weights during a train step: generate refuses until
    set_params hands it weights again, which then sample as before."""
    s = JaxSampler(TINY, tiny_params, max_len=128)
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    before = [r.tokens.tolist() for r in s.generate(PROMPTS, sp)]
    s.release_params()
    assert s.params is None
    with pytest.raises(SamplerError, match="holds no weights"):
        s.generate(PROMPTS, sp)
    s.set_params(tiny_params, version=2)
    out = s.generate(PROMPTS, sp)
    assert out.weights_version == 2
    assert [r.tokens.tolist() for r in out] == before


def test_set_weights_from_weight_store(tmp_path, tiny_params):
    from pmd_jax.models import hf_io
    from pmd_jax.sampling.weight_store import WeightStore

    store = WeightStore(tmp_path / "w", timeout_s=30)
    other = decoder.init_params(TINY, jax.random.PRNGKey(2))
    store.publish(dict(hf_io.iter_hf_tensors(other, TINY)), version=3, step=30)
    s = JaxSampler(TINY, tiny_params, max_len=128, weight_source=store)
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    ref = [r.tokens.tolist() for r in JaxSampler(TINY, other, max_len=128).generate(PROMPTS, sp)]
    s.set_weights(3)
    out = s.generate(PROMPTS, sp)
    assert out.weights_version == 3
    assert [r.tokens.tolist() for r in out] == ref
    with pytest.raises(SamplerError, match="set_weights\\(4\\)"):
        s.set_weights(4)  # not committed
    assert s.weights_version == 3  # old weights kept
    # a version with arrays that do not fit the config is refused, old weights kept
    wrong = dict(hf_io.iter_hf_tensors(other, TINY))
    wrong["model.embed_tokens.weight"] = wrong["model.embed_tokens.weight"][:, :16]
    store.publish(wrong, version=5)
    with pytest.raises(SamplerError, match="do not match"):
        s.set_weights(5)
    assert s.weights_version == 3
    assert [r.tokens.tolist() for r in s.generate(PROMPTS, sp)] == ref


def test_prefill_row_keys_match_sample_ops(tiny, tiny_params):
    # the first sampled token equals a direct draw with the documented key folding
    sp = SamplingParams(n=4, temperature=0.9, max_tokens=1, seed=21)
    out = tiny.generate(PROMPTS, sp)
    for r in out:
        p = PROMPTS[r.prompt_index]
        logits, _ = decoder.forward(tiny_params, jnp.asarray([p]), jnp.arange(len(p))[None], TINY)
        key = sample_ops.row_keys(21, jnp.array([r.prompt_index]), jnp.array([r.sample_index]), 0)
        tok, _ = sample_ops.sample_tokens(logits[:, -1], key, 0.9, 0, 1.0)
        assert int(tok[0]) == int(r.tokens[0])


# ------------------------------------------------------------------ real SmolLM2-135M-Instruct
QUESTIONS = [
    "What is 2+2?",
    "Name the largest planet in the solar system and explain why it is so big.",
    "Write a haiku about autumn leaves.",
    "Which gas do plants absorb from the air during photosynthesis? Answer briefly.",
    "Translate 'good morning' into French.",
    "List three prime numbers greater than ten.",
    "A train travels 60 km in 1.5 hours. What is its average speed? Show the steps of your "
    "reasoning carefully, then give the final answer in km/h.",
    "Hi!",
    "Explain what a black hole is to a ten year old.",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Give me a short motivational quote.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How many legs does a spider have?",
    "Suggest a name for a pet goldfish.",
    "What does DNA stand for?",
]


def _smollm2(from_gguf: bool):
    transformers = pytest.importorskip("transformers")
    from pmd_jax.models import hf_io

    d = smollm2_hf_dir()  # skipped with the install command when SmolLM2 is absent
    tok = transformers.AutoTokenizer.from_pretrained(d)
    if from_gguf:  # HF's own GGUF reader: independent of our importer
        gguf = smollm2_gguf()
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        sd = {k: v.numpy() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
        cfg = from_hf_config(hf_io.read_hf_config(d))
        params = hf_io.load_params_from_source(hf_io.ArraySource(sd), cfg)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        cfg, params = hf_io.load_hf_checkpoint(d)
    return tok, hf.eval(), cfg, params


@pytest.fixture(scope="module")
def smollm2():
    return _smollm2(from_gguf=False)


def _chat_prompts(tok, n):
    out = []
    for q in QUESTIONS[:n]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _check_against_hf(tok, hf, cfg, params, n_prompts, max_new, temperature_check=False):
    prompts = _chat_prompts(tok, n_prompts)
    assert len({len(p) for p in prompts}) > 4  # really different lengths -> left padding
    eos = tok.eos_token_id
    s = JaxSampler(cfg, params, max_len=512, pad_id=tok.pad_token_id)
    out = s.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new,
                                             stop_token_ids=(eos,)))
    tok.padding_side = "left"
    enc = tok.pad({"input_ids": prompts}, return_tensors="pt")
    with torch.no_grad():
        ref = hf.generate(**enc, do_sample=False, max_new_tokens=max_new,
                          pad_token_id=tok.pad_token_id, eos_token_id=eos)
    plen = enc["input_ids"].shape[1]
    for i, r in enumerate(out):
        want = ref[i, plen:].tolist()
        if eos in want:
            want = want[: want.index(eos) + 1]
        assert r.tokens.tolist() == want, f"prompt {i}: {r.tokens.tolist()} != {want}"
        assert r.finish_reason == ("stop" if want[-1] == eos else "length")
    assert any(r.finish_reason == "length" for r in out)  # some really ran max_new tokens
    # logprobs vs the trainer forward (one right-padded teacher-forced batch) and vs HF
    seqs = [np.concatenate([p, r.tokens]) for p, r in zip(prompts, out)]
    width = max(len(x) for x in seqs)
    toks = np.full((len(seqs), width), tok.pad_token_id, np.int32)
    mask = np.zeros((len(seqs), width), bool)
    for i, x in enumerate(seqs):
        toks[i, : len(x)], mask[i, : len(x)] = x, True
    logits, _ = jax.jit(lambda p, t, m: decoder.forward(
        p, t, jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape), cfg, attn_mask=m))(
        params, jnp.asarray(toks), jnp.asarray(mask))
    ours_lp = np.asarray(jax.nn.log_softmax(logits, -1))
    with torch.no_grad():
        hf_lp = torch.log_softmax(hf(input_ids=torch.tensor(toks, dtype=torch.long),
                                     attention_mask=torch.tensor(mask, dtype=torch.long)
                                     ).logits.float(), -1).numpy()
    for i, (p, r) in enumerate(zip(prompts, out)):
        pos = len(p) - 1 + np.arange(len(r.tokens))
        np.testing.assert_allclose(r.logprobs, ours_lp[i, pos, r.tokens], atol=HF_LOGPROB_ATOL)
        np.testing.assert_allclose(r.logprobs, hf_lp[i, pos, r.tokens], atol=HF_LOGPROB_ATOL)
    if temperature_check:  # sampled at T=0.7: logprobs are log_softmax(logits / 0.7)
        out = s.generate(prompts[:4], SamplingParams(n=2, temperature=0.7, top_p=0.9,
                                                     max_tokens=32, seed=1))
        for r in out:
            seq = np.concatenate([prompts[r.prompt_index], r.tokens])
            with torch.no_grad():
                lg = hf(input_ids=torch.tensor(seq[None], dtype=torch.long)).logits[0].float()
            lp = torch.log_softmax(lg / 0.7, -1).numpy()
            pos = len(prompts[r.prompt_index]) - 1 + np.arange(len(r.tokens))
            np.testing.assert_allclose(r.logprobs, lp[pos, r.tokens], atol=HF_LOGPROB_ATOL)


def test_smollm2_greedy_equals_hf_generate_8x32(smollm2):
    # 32 new tokens (64 until 2026-11-29, for CI time); the slow test below runs 16 x 128
    _check_against_hf(*smollm2, n_prompts=8, max_new=32)


@pytest.mark.slow
def test_smollm2_from_hf_gguf_reader_16x128():
    _check_against_hf(*_smollm2(from_gguf=True), n_prompts=16, max_new=128,
                      temperature_check=True)


def test_use_weights_of_uses_the_same_arrays(tiny, tiny_params):
    assert tiny.share_weights() == "in_process"
    other = JaxSampler(TINY, decoder.init_params(TINY, jax.random.PRNGKey(9)), max_len=128)
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    assert [r.tokens.tolist() for r in other.generate([[1, 2, 3]], sp)] != [
        r.tokens.tolist() for r in tiny.generate([[1, 2, 3]], sp)]
    other.use_weights_of(tiny)
    assert other.params is tiny.params and other.weights_version == tiny.weights_version
    assert [r.tokens.tolist() for r in other.generate([[1, 2, 3]], sp)] == [
        r.tokens.tolist() for r in tiny.generate([[1, 2, 3]], sp)]
    stacked = JaxSampler(TINY, tiny_params, max_len=128, unstack_layers=False)
    with pytest.raises(SamplerError, match="unstack_layers"):
        stacked.use_weights_of(tiny)
