"""Import a llama-architecture GGUF (the embedded SmolLM2-135M-Instruct) into our pytree.

Steps: read tensors and metadata with ``gguf.GGUFReader``; dequantize every tensor
(``gguf.quants.dequantize``: Q4_1, Q8_0, F32, ...) to float32; rename to HF names; undo
llama.cpp's Q/K row permutation; build a ``ModelConfig`` from the ``llama.*`` metadata; rebuild
the byte-level BPE tokenizer and the chat template from the ``tokenizer.*`` metadata.

``smollm2_hf_dir()`` exports the result once to a HF folder (float32 safetensors, config,
tokenizer, generation config) in our cache, so later loads are fast and vLLM can serve it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pmd_jax.models import assets, hf_io, weights
from pmd_jax.models.config import ConfigError, ModelConfig, RopeConfig
from pmd_jax.models.tokenizer import Tokenizer

EXPORT_VERSION = 1  # bump when the export format changes (invalidates caches)

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4


class GGUFError(ValueError):
    """A GGUF file cannot be imported; the message names the key or tensor."""


# ------------------------------------------------------------------------------ reading
def open_gguf(path: str | os.PathLike) -> Any:
    import gguf

    p = Path(path)
    if not p.exists():
        raise GGUFError(f"{p}: no such GGUF file")
    try:
        return gguf.GGUFReader(str(p))
    except Exception as e:  # noqa: BLE001 - bad magic, truncated file ...
        raise GGUFError(f"{p}: cannot read as GGUF: {e}") from e


def metadata(reader: Any) -> dict[str, Any]:
    """All key/values (arrays of tokens/merges included) as Python values."""
    out: dict[str, Any] = {}
    for k, f in reader.fields.items():
        try:
            out[k] = f.contents()
        except Exception:  # noqa: BLE001 - exotic field types are not needed
            continue
    return out


def _need(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise GGUFError(f"GGUF metadata is missing key {key!r}")
    return meta[key]


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(
            f"unsupported GGUF architecture {arch!r} (general.architecture); only 'llama' is "
            "supported"
        )
    a = "llama."
    heads = int(_need(meta, a + "attention.head_count"))
    hidden = int(_need(meta, a + "embedding_length"))
    head_dim = int(meta.get(a + "attention.key_length") or hidden // heads)
    # metadata that changes the math of a llama-architecture GGUF: refuse what we do not run
    checks = {
        "rope.dimension_count": (head_dim, "RoPE over the whole head (partial rotary is not "
                                           "implemented)"),
        "attention.value_length": (head_dim, "value heads as wide as key heads"),
        "expert_count": (0, "a dense MLP (mixture-of-experts is not implemented)"),
    }
    for key, (ok, what) in checks.items():
        v = meta.get(a + key)
        if v is not None and int(v) != ok:
            raise GGUFError(f"unsupported GGUF metadata {a}{key}={v!r}: the decoder needs {what}")
    scaling = meta.get(a + "rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"GGUF rope scaling {scaling!r} ({a}rope.scaling.type) is not supported")
    vocab = meta.get(a + "vocab_size") or len(_need(meta, "tokenizer.ggml.tokens"))
    try:
        return ModelConfig(
            family="llama",
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(_need(meta, a + "feed_forward_length")),
            num_layers=int(_need(meta, a + "block_count")),
            num_heads=heads,
            num_kv_heads=int(meta.get(a + "attention.head_count_kv") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(_need(meta, a + "attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(meta.get(a + "context_length") or 4096),
            tie_embeddings="output.weight" not in tensor_names,
            rope=(("full_attention", RopeConfig(theta=float(meta.get(a + "rope.freq_base",
                                                                            10000.0)))),),
        )
    except ConfigError as e:
        raise GGUFError(f"GGUF metadata gives an invalid model config: {e}") from e


# ------------------------------------------------------------------------------ permutation
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf Q/K row permutation (HF rotate-half -> interleaved)."""
    rows = w.shape[0]
    return (
        w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def undo_llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``llama_cpp_permute``: GGUF row order back to HF's."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"cannot un-permute {rows} rows over {n_head} heads")
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


# ------------------------------------------------------------------------------ tensors
def dequantize_tensor(t: Any) -> np.ndarray:
    """One GGUF tensor as float32 in numpy (row-major, HF) order."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
    try:
        arr = dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError as e:
        raise GGUFError(f"tensor {t.name!r}: type {t.tensor_type.name} cannot be dequantized: {e}")
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def hf_tensors_from_gguf(reader: Any, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Dequantized float32 tensors under HF names and layout (GGUF names and llama.cpp's Q/K
    row permutation are declared with the weights, ``weights.declare``)."""
    names = weights.gguf_names(cfg)
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = t.name
        if name not in names:  # e.g. blk.0.attn_q.bias: biases are refused
            if name == "rope_freqs.weight":
                raise GGUFError("GGUF tensor 'rope_freqs.weight' (rope scaling) not supported")
            raise GGUFError(f"unexpected GGUF tensor {name!r} for a {cfg.family} model")
        hf, decl = names[name]
        w = dequantize_tensor(t)
        if decl.gguf_permute is not None:
            w = undo_llama_cpp_permute(w, getattr(cfg, decl.gguf_permute))
        out[hf] = w
    return out


# ------------------------------------------------------------------------------ tokenizer
def _pre_tokenizer(pre: str | None) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # llama.cpp splits each digit first (\p{N}), then the GPT-2 regex; this is also the
        # Digits(individual) + ByteLevel pre-tokenizer of SmolLM2's own tokenizer.json.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if pre in (None, "default", "gpt2", "gpt-2", "olmo", "mpt", "jais"):
        return byte_level
    if pre in ("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe"):
        regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise GGUFError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre)")


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE fast tokenizer + chat template from ``tokenizer.*`` metadata."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model)")
    tokens: list[str] = list(_need(meta, "tokenizer.ggml.tokens"))
    merges_raw: list[str] = list(_need(meta, "tokenizer.ggml.merges"))
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        if not sep:
            raise GGUFError(f"malformed merge {m!r} in tokenizer.ggml.merges")
        merges.append((a, b))
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    raw.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if user:
        raw.add_tokens(user)

    def tok(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    kw = {"bos_token": tok("bos_token_id"), "eos_token": tok("eos_token_id"),
          "pad_token": tok("padding_token_id"), "unk_token": tok("unknown_token_id")}
    kw = {k: v for k, v in kw.items() if v is not None}
    template = meta.get("tokenizer.chat_template")
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, chat_template=template,
                                 clean_up_tokenization_spaces=False, **kw)
    return Tokenizer(hf)


# ------------------------------------------------------------------------------ top level
def load_gguf(
    path: str | os.PathLike,
    mesh: Any = None,
    rules: Any = None,
    dtype: Any = "float32",
) -> tuple[ModelConfig, dict[str, Any], Tokenizer]:
    """(config, params, tokenizer) from a llama GGUF, params sharded on ``mesh`` if given."""
    reader = open_gguf(path)
    meta = metadata(reader)
    cfg = config_from_gguf(meta, {t.name for t in reader.tensors})
    tensors = hf_tensors_from_gguf(reader, cfg)
    params = hf_io.load_params_from_source(hf_io.ArraySource(tensors), cfg, mesh, rules, dtype)
    return cfg, params, tokenizer_from_gguf(meta)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def export_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the GGUF as a HF folder: float32 safetensors, config, tokenizer, generation config."""
    cfg, params, tok = load_gguf(gguf_path)
    out = hf_io.save_hf_checkpoint(params, cfg, out_dir, dtype="float32", tokenizer=tok)
    return out


def smollm2_hf_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The embedded SmolLM2-135M-Instruct as a HF folder, exported once into the cache.

    Cache root: ``cache_dir``, else $PMD_JAX_CACHE, else ~/.cache/pmd_jax. The folder name has
    the GGUF's digest; the export is written to a temp folder and renamed into place, so a
    crashed export never looks complete.
    """
    src = assets.smollm2_gguf_path()
    root = assets.cache_dir(cache_dir)
    digest = _file_digest(src)
    dest = root / f"smollm2-135m-instruct-{digest}-v{EXPORT_VERSION}"
    marker = dest / "pmd_jax_export.json"
    if marker.exists():
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-export-", dir=root))
    try:
        export_gguf_to_hf(src, tmp)
        (tmp / "pmd_jax_export.json").write_text(json.dumps(
            {"source": src.name, "sha256_16": digest, "version": EXPORT_VERSION}))
        try:
            os.rename(tmp, dest)
        except OSError:
            if not marker.exists():  # someone else won the race only if they finished
                shutil.rmtree(dest, ignore_errors=True)
                os.rename(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def load_smollm2(
    mesh: Any = None,
    rules: Any = None,
    dtype: Any = None,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[ModelConfig, dict[str, Any], Tokenizer]:
    """(config, params, tokenizer) of the embedded default model, via the cached HF export."""
    d = smollm2_hf_dir(cache_dir)
    cfg, params = hf_io.load_hf_checkpoint(d, mesh=mesh, rules=rules, dtype=dtype)
    return cfg, params, Tokenizer.from_pretrained(d, chat_format="chatml")
