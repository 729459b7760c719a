"""Import a ``llama`` or ``qwen2`` architecture GGUF (the embedded SmolLM2-135M-Instruct and
Qwen2.5-Coder-0.5B-Instruct) into our pytree.

Steps: read tensors and metadata with ``gguf.GGUFReader``; dequantize every tensor
(``gguf.quants.dequantize``: Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, F32, ...) to float32; rename to HF
names; undo llama.cpp's Q/K row permutation where the architecture has one (``llama``; its
``qwen2`` converter keeps HF's rotate-half order); build a ``ModelConfig`` from the
``<arch>.*`` metadata; rebuild the byte-level BPE tokenizer (its pre-tokenizer named by
``tokenizer.ggml.pre``) and the chat template from the ``tokenizer.*`` metadata.

``embedded_hf_dir(name)`` exports an embedded model once to a HF folder (float32
safetensors, config, tokenizer, generation config) in our cache, so later loads are fast and
vLLM can serve it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pmd_jax.models import assets, hf_io, weights
from pmd_jax.models.config import ConfigError, ModelConfig, RopeConfig
from pmd_jax.models.families import FAMILIES
from pmd_jax.models.tokenizer import Tokenizer

EXPORT_VERSION = 1  # bump when the export format changes (invalidates caches)

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_CONTROL, _USER_DEFINED = 3, 4


class GGUFError(ValueError):
    """A GGUF file cannot be imported; the message names the key or tensor."""


# ------------------------------------------------------------------------------ reading
def open_gguf(path: str | os.PathLike) -> Any:
    # lazy: gguf only when a GGUF file is read or written
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


@dataclasses.dataclass(frozen=True)
class SkippedArray:
    """An array value of a GGUF header read by :func:`read_gguf_header`: its length only
    (the vocabulary and merges are not parsed)."""

    length: int

    def __len__(self) -> int:
        return self.length


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's key/values (arrays as :class:`SkippedArray`) and its tensors' shapes
    (GGUF order: fastest-varying dimension first), read without touching the tensor data."""

    meta: dict[str, Any]
    tensor_shapes: dict[str, tuple[int, ...]]

    def n_elements(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) for s in self.tensor_shapes.values())


_GGUF_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                11: "q", 12: "d"}


def read_gguf_header(path: str | os.PathLike, stop_at: str | None = None) -> GGUFHeader:
    """The header of a little-endian GGUF v2/v3 file, read as a stream: the key/values with
    arrays skipped (``gguf.GGUFReader`` parses the whole vocabulary first: ~10 s for a
    151,936-token one) and the tensor infos. ``stop_at``: stop after that key (no tensor
    infos). Raises GGUFError on a file that is not one or ends early."""

    def read(f: Any, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        b = f.read(size)
        if len(b) != size:
            raise EOFError
        return struct.unpack("<" + fmt, b)[0]

    def read_str(f: Any) -> str:
        n = read(f, "Q")
        b = f.read(n)
        if len(b) != n:
            raise EOFError
        return b.decode("utf-8", "replace")

    def value(f: Any, vtype: int) -> Any:
        if vtype in _GGUF_SCALAR:
            return read(f, _GGUF_SCALAR[vtype])
        if vtype == 8:
            return read_str(f)
        if vtype == 9:
            etype, count = read(f, "I"), read(f, "Q")
            if etype in _GGUF_SCALAR:
                f.seek(count * struct.calcsize("<" + _GGUF_SCALAR[etype]), os.SEEK_CUR)
            else:
                for _ in range(count):
                    value(f, etype)
            return SkippedArray(int(count))
        raise ValueError(f"unknown GGUF value type {vtype}")

    meta: dict[str, Any] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise GGUFError(f"{path}: not a GGUF file (no GGUF magic)")
            version = read(f, "I")
            if version not in (2, 3):
                raise GGUFError(f"{path}: GGUF version {version} (2 and 3 are read)")
            n_tensors, n_kv = read(f, "Q"), read(f, "Q")
            for _ in range(n_kv):
                key, vtype = read_str(f), read(f, "I")
                meta[key] = value(f, vtype)
                if key == stop_at:
                    return GGUFHeader(meta, shapes)
            for _ in range(n_tensors):
                name = read_str(f)
                dims = tuple(int(read(f, "Q")) for _ in range(read(f, "I")))
                read(f, "I"), read(f, "Q")  # tensor type, data offset
                shapes[name] = dims
    except (EOFError, struct.error, ValueError) as e:
        raise GGUFError(f"{path}: GGUF header ends early or is malformed ({e or 'EOF'})") \
            from None
    except OSError as e:
        raise GGUFError(f"{path}: cannot read: {e}") from None
    return GGUFHeader(meta, shapes)


def _need(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise GGUFError(f"GGUF metadata is missing key {key!r}")
    return meta[key]


@dataclasses.dataclass(frozen=True)
class GGUFArch:
    """A llama.cpp architecture we import: our model family, and whether llama.cpp's converter
    permuted the Q/K rows (``convert_hf_to_gguf``: LlamaModel does, Qwen2Model does not)."""

    family: str
    permutes_qk: bool


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", permutes_qk=True),
    "qwen2": GGUFArch("qwen2", permutes_qk=False),
}


def gguf_arch(meta: dict[str, Any]) -> tuple[str, GGUFArch]:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise GGUFError(
            f"unsupported GGUF architecture {arch!r} (general.architecture); supported: "
            f"{sorted(GGUF_ARCHS)}"
        )
    return str(arch), GGUF_ARCHS[str(arch)]


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch, spec = gguf_arch(meta)
    a = arch + "."
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
            family=spec.family,
            qkv_bias=FAMILIES[spec.family].qkv_bias,
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
    # lazy: gguf only when a GGUF file is read or written
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
    try:
        arr = dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError as e:
        raise GGUFError(f"tensor {t.name!r}: type {t.tensor_type.name} cannot be dequantized: {e}")
    return np.asarray(arr, dtype=np.float32).reshape(shape)


def hf_tensors_from_gguf(reader: Any, cfg: ModelConfig,
                         permutes_qk: bool = True) -> dict[str, np.ndarray]:
    """Dequantized float32 tensors under HF names and layout (GGUF names and which rows
    llama.cpp permutes are declared with the weights, ``weights.declare``; ``permutes_qk``:
    whether this GGUF's architecture permuted them, ``GGUF_ARCHS``)."""
    names = weights.gguf_names(cfg)
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = t.name
        if name not in names:  # e.g. blk.0.attn_q.bias for a model without q/k/v biases
            if name == "rope_freqs.weight":
                raise GGUFError("GGUF tensor 'rope_freqs.weight' (rope scaling) not supported")
            raise GGUFError(f"unexpected GGUF tensor {name!r} for a {cfg.family} model")
        hf, decl = names[name]
        w = dequantize_tensor(t)
        if permutes_qk and decl.gguf_permute is not None:
            w = undo_llama_cpp_permute(w, getattr(cfg, decl.gguf_permute))
        out[hf] = w
    return out


# ------------------------------------------------------------------------------ tokenizer
# Split regexes of llama.cpp's pre-tokenizer names, as the models' own tokenizer.json files
# give them (Llama-3: digits in runs of up to 3; Qwen2: each digit alone). Qwen2's own
# tokenizer.json also NFC-normalizes; transformers' GGUF loader does not, and neither do we
# (a GGUF names no normalizer; text that is not NFC is encoded as that loader encodes it).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {**{k: _LLAMA3_SPLIT for k in ("llama3", "llama-v3", "llama-bpe", "dbrx",
                                        "smaug-bpe")},
           **{k: _QWEN2_SPLIT for k in ("qwen2", "deepseek-r1-qwen")}}


def _pre_tokenizer(pre: str | None) -> Any:
    # lazy: tokenizers only to build a GGUF file's tokenizer
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
    regex = _SPLITS.get(pre or "")
    if regex is not None:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise GGUFError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre)")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map of byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_BYTE_MAP = _byte_alphabet()
_BYTE_ALPHABET = frozenset(_BYTE_MAP.values())


def _byte_spelled(token: str) -> str:
    """A vocabulary entry in the byte alphabet: entries a converter stored as raw text (e.g.
    a run of spaces) are spelled through their UTF-8 bytes, as the merges expect."""
    if set(token) <= _BYTE_ALPHABET:
        return token
    return "".join(_BYTE_MAP[b] for b in token.encode("utf-8"))


def tokenizer_from_gguf(meta: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE fast tokenizer + chat template from ``tokenizer.*`` metadata.

    Control tokens (llama.cpp type 3) become special tokens and user-defined ones (type 4,
    e.g. ``<tool_call>``) plain added tokens, matched whole; a control token spelled outside
    the byte alphabet is a converter's mislabel and is not added (transformers' GGUF loader
    skips it too)."""
    # lazy: tokenizers and transformers (heavy) only to build a GGUF file's tokenizer
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model)")
    tokens: list[str] = [_byte_spelled(t) for t in _need(meta, "tokenizer.ggml.tokens")]
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
                            for t, ty in zip(tokens, types)
                            if ty == _CONTROL and set(t) <= _BYTE_ALPHABET])
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
    """(config, params, tokenizer) from a llama / qwen2 GGUF, params sharded on ``mesh``."""
    reader = open_gguf(path)
    meta = metadata(reader)
    cfg = config_from_gguf(meta, {t.name for t in reader.tensors})
    tensors = hf_tensors_from_gguf(reader, cfg, gguf_arch(meta)[1].permutes_qk)
    params = hf_io.load_params_from_source(hf_io.ArraySource(tensors), cfg, mesh, rules, dtype)
    return cfg, params, tokenizer_from_gguf(meta)


def export_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the GGUF as a HF folder: float32 safetensors, config, tokenizer, generation config."""
    cfg, params, tok = load_gguf(gguf_path)
    out = hf_io.save_hf_checkpoint(params, cfg, out_dir, dtype="float32", tokenizer=tok)
    return out


def embedded_hf_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """An embedded model (``assets.EMBEDDED_MODELS``) as a HF folder, exported once into the
    cache.

    Cache root: ``cache_dir``, else $PMD_JAX_CACHE, else ~/.cache/pmd_jax. The folder name has
    the GGUF's digest (a chunked model's pinned sha256, checked when its GGUF is assembled;
    else the installed file's); the export is written to a temp folder and renamed into place,
    so a crashed export never looks complete.
    """
    model = assets.embedded_model(name)
    root = assets.cache_dir(cache_dir)
    src = None
    if model.sha256 is not None:
        digest = model.sha256[:16]
    else:
        src = assets.embedded_gguf_path(name, root)
        digest = assets.sha256_file(src)[:16]
    dest = root / f"{model.export_name}-{digest}-v{EXPORT_VERSION}"
    marker = dest / "pmd_jax_export.json"
    if marker.exists():
        return dest
    src = src or assets.embedded_gguf_path(name, root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model.export_name}-export-", dir=root))
    try:
        export_gguf_to_hf(src, tmp)
        (tmp / "pmd_jax_export.json").write_text(json.dumps(
            {"source": src.name, "model": name, "sha256_16": digest, "version": EXPORT_VERSION}))
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


def smollm2_hf_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The embedded SmolLM2-135M-Instruct as a HF folder (:func:`embedded_hf_dir`)."""
    return embedded_hf_dir(assets.SMOLLM2.name, cache_dir)


def load_embedded(
    name: str,
    mesh: Any = None,
    rules: Any = None,
    dtype: Any = None,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[ModelConfig, dict[str, Any], Tokenizer]:
    """(config, params, tokenizer) of an embedded model, via the cached HF export."""
    d = embedded_hf_dir(name, cache_dir)
    cfg, params = hf_io.load_hf_checkpoint(d, mesh=mesh, rules=rules, dtype=dtype)
    return cfg, params, Tokenizer.from_pretrained(
        d, chat_format=assets.embedded_model(name).chat_format)


def load_smollm2(
    mesh: Any = None,
    rules: Any = None,
    dtype: Any = None,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[ModelConfig, dict[str, Any], Tokenizer]:
    """(config, params, tokenizer) of the embedded default model, via the cached HF export."""
    return load_embedded(assets.SMOLLM2.name, mesh, rules, dtype, cache_dir)
