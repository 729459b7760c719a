"""HF safetensors checkpoints <-> our param pytree.

Loading goes straight into sharded device arrays: for every leaf of our pytree we build its
``NamedSharding`` and call ``jax.make_array_from_callback``; the callback of each device maps
that device's index (slices of *our* layout) to the slice of the HF tensor(s) it needs and
reads only that slice from the safetensors file(s) (``safe_open(...).get_slice``). Nothing
reads a whole tensor for a device that holds a part of it.

The mapping of one of our leaves to its HF tensor is a reshape + transpose of the per-layer HF
tensor, declared with the weight (``weights.Weight.hf_layout``): e.g. ``q_proj.weight [H*hd, D]``
-> split ``[H, hd, D]`` -> transpose to ours ``[D, H, hd]``; layer-stacked leaves gather
``model.layers.{i}...`` over ``i``.

Saving writes ``config.json`` (the family's HF config, see ``families.FamilySpec``),
``generation_config.json``, safetensors (sharded with
``model.safetensors.index.json`` above ``max_shard_bytes``) and the tokenizer if given.
``iter_hf_tensors`` streams (HF name, numpy array in HF layout) for weight publishing.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from pmd_jax.models.config import ConfigError, ModelConfig, from_hf_config
from pmd_jax.models.decoder import check_params, param_axes
from pmd_jax.models.families import FAMILIES
from pmd_jax.models.weights import Weight, declare, norm_slice
from pmd_jax.run.sharding import ShardingRules, check_divisible

Params = dict[str, Any]

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"

# family -> (transformers class, model_type); registered in models/families.py
HF_ARCHITECTURES = {name: (f.hf_architecture, f.name) for name, f in FAMILIES.items()}


class CheckpointError(ValueError):
    """A checkpoint does not match what the config expects; the message names the tensor."""


# ------------------------------------------------------------------------------ mapping
def tensor_maps(cfg: ModelConfig) -> tuple[Weight, ...]:
    """The HF tensor behind every leaf of our pytree: the weights' one declaration
    (:func:`pmd_jax.models.weights.declare`), whose ``hf_name`` / ``hf_layout`` give it."""
    if cfg.family not in FAMILIES:
        raise ConfigError(f"unknown model family {cfg.family!r}; known {sorted(FAMILIES)}")
    return declare(cfg)


def _get(tree: Params, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: Params, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


# ------------------------------------------------------------------------------ sources
class TensorSource:
    """Something that reads slices of named HF tensors (safetensors files or host arrays)."""

    def shape(self, name: str) -> tuple[int, ...] | None:  # None: absent
        raise NotImplementedError

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        raise NotImplementedError

    def names(self) -> list[str]:
        raise NotImplementedError

    def dtype(self, name: str) -> str | None:
        """The stored dtype's name (safetensors' "F32", "BF16", ... or numpy's); None: unknown."""
        return None

    def close(self) -> None:
        pass


class SafetensorsSource(TensorSource):
    """A HF checkpoint folder: ``model.safetensors`` or shards listed in the index json."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        idx = self.path / SAFE_INDEX
        if idx.exists():
            try:
                weight_map = dict(json.loads(idx.read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{idx}: not a valid safetensors index: {e!r}") from e
        elif (self.path / SAFE_SINGLE).exists():
            weight_map = None
        else:
            raise CheckpointError(
                f"{self.path}: no {SAFE_SINGLE} and no {SAFE_INDEX} (not a HF safetensors folder)"
            )
        self._handles: dict[str, Any] = {}
        files = sorted(set(weight_map.values())) if weight_map else [SAFE_SINGLE]
        for f in files:
            fp = self.path / f
            if not fp.exists():
                raise CheckpointError(f"{self.path}: shard file {f} listed in the index is missing")
            try:
                self._handles[f] = safe_open(str(fp), framework="numpy")
            except Exception as e:  # noqa: BLE001 - corrupt header etc.
                raise CheckpointError(f"{fp}: cannot open as safetensors: {e}") from e
        if weight_map is None:
            weight_map = {n: SAFE_SINGLE for n in self._handles[SAFE_SINGLE].keys()}
        self.weight_map: dict[str, str] = dict(weight_map)

    def names(self) -> list[str]:
        return list(self.weight_map)

    def _slice(self, name: str) -> Any:
        return self._handles[self.weight_map[name]].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name not in self.weight_map:
            return None
        try:
            return tuple(self._slice(name).get_shape())
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"tensor {name!r} listed in {self.path} cannot be read: {e}"
            ) from e

    def dtype(self, name: str) -> str | None:
        return str(self._slice(name).get_dtype()) if name in self.weight_map else None

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return np.asarray(self._slice(name)[index])

    def close(self) -> None:
        for h in self._handles.values():
            close = getattr(h, "__exit__", None)
            if close is not None:
                close(None, None, None)
        self._handles.clear()


class ArraySource(TensorSource):
    """HF-named host arrays (e.g. dequantized GGUF tensors)."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self.tensors = dict(tensors)

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...] | None:
        t = self.tensors.get(name)
        return None if t is None else tuple(t.shape)

    def dtype(self, name: str) -> str | None:
        t = self.tensors.get(name)
        return None if t is None else str(np.asarray(t).dtype)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return np.asarray(self.tensors[name][index])


def read_slice(src: TensorSource, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """The one place that reads tensor data (tests patch it to audit what each device read)."""
    return src.read(name, index)


# ------------------------------------------------------------------------------ loading
def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path) / "config.json"
    if not p.exists():
        raise CheckpointError(f"{path}: no config.json")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{p}: invalid JSON: {e}") from e


# Stored dtypes we read (safetensors' names and numpy's); integer / fp8 tensors are quantized.
_FLOAT_TENSOR_DTYPES = frozenset({"F64", "F32", "F16", "BF16",
                                  "float64", "float32", "float16", "bfloat16"})
# Non-persistent buffers some older checkpoints carry; transformers recomputes and ignores them.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _unused_hint(names: Sequence[str], cfg: ModelConfig) -> str:
    hints = []
    if any(".self_attn." in n and n.endswith(".bias") for n in names):
        hints.append("attention biases, but config.json has attention_bias=false"
                     if not cfg.attention_bias else "attention biases the family does not have")
    if any(".mlp." in n and n.endswith(".bias") for n in names):
        hints.append("MLP biases (mlp_bias=true is not implemented)")
    if any("_norm." in n for n in names):
        hints.append(f"norm weights a {cfg.family} decoder does not have")
    return "; ".join(hints) or "tensors a " + cfg.family + " decoder does not have"


def check_source(src: TensorSource, cfg: ModelConfig) -> None:
    """The checkpoint's tensors are exactly the ones the config needs: every needed HF tensor is
    present with the expected shape and a float dtype, and no other tensor is there (a weight the
    decoder would ignore, such as a bias, means the checkpoint is a model it does not compute).
    Reads headers only, except to compare a tied config's stray ``lm_head.weight``."""
    expected: set[str] = set()
    for m in tensor_maps(cfg):
        for name in m.hf_names():
            expected.add(name)
            found = src.shape(name)
            if found is None:
                raise CheckpointError(
                    f"checkpoint is missing tensor {name!r} (expected shape {m.hf_shape}) needed "
                    f"for params/{'/'.join(m.path)} of this {cfg.family} config"
                )
            if tuple(found) != m.hf_shape:
                raise CheckpointError(
                    f"tensor {name!r} has shape {tuple(found)}, expected {m.hf_shape} "
                    f"for params/{'/'.join(m.path)} of this {cfg.family} config"
                )
            dt = src.dtype(name)
            if dt is not None and dt not in _FLOAT_TENSOR_DTYPES:
                raise CheckpointError(
                    f"tensor {name!r} is stored as {dt}: quantized or integer weights are not "
                    f"supported (float32, bfloat16, float16)"
                )
    unused = sorted(n for n in src.names()
                    if n not in expected and not n.endswith(_IGNORED_SUFFIXES))
    if cfg.tie_embeddings and "lm_head.weight" in unused:
        unused.remove("lm_head.weight")
        _check_tied_head(src, cfg)
    if unused:
        shown = ", ".join(repr(n) for n in unused[:4]) + (" ..." if len(unused) > 4 else "")
        raise CheckpointError(
            f"checkpoint has {len(unused)} tensor(s) this {cfg.family} config does not use "
            f"({_unused_hint(unused, cfg)}): {shown}; refusing to drop weights silently"
        )


def _check_tied_head(src: TensorSource, cfg: ModelConfig, rows: int = 4096) -> None:
    """A tied config with a stored ``lm_head.weight``: transformers 5 unties them when the two
    differ (and uses lm_head), transformers 4 ties them; only equal values are unambiguous."""
    name, embed = "lm_head.weight", "model.embed_tokens.weight"
    shape = src.shape(name)
    if shape != src.shape(embed):
        raise CheckpointError(
            f"tie_word_embeddings=true but the checkpoint's {name!r} has shape {shape}, not the "
            f"embedding's {src.shape(embed)}")
    assert shape is not None
    for start in range(0, shape[0], rows):
        idx = (slice(start, min(start + rows, shape[0])), slice(0, shape[1]))
        if not np.array_equal(read_slice(src, name, idx), read_slice(src, embed, idx)):
            raise CheckpointError(
                f"tie_word_embeddings=true but the checkpoint's {name!r} differs from {embed!r} "
                "(transformers 4 ties them, 5 uses lm_head.weight); set tie_word_embeddings to "
                "false to use lm_head.weight, or drop it")


def _read_index(src: TensorSource, m: Weight, np_dtype: np.dtype,
                index: tuple[slice, ...] | None) -> np.ndarray:
    """:func:`_read_leaf` of the slice jax asks a shard for (None: the whole tensor)."""
    return _read_leaf(src, m, () if index is None else index, np_dtype)


def _read_leaf(
    src: TensorSource, m: Weight, index: Sequence[slice], dtype: np.dtype
) -> np.ndarray:
    """Our leaf's ``index`` (slices over our full leaf shape), reading only that part."""
    index = tuple(index) + (slice(None),) * (len(m.shape) - len(index))
    if m.stacked:
        layers = norm_slice(index[0], m.num_layers)
        hf_idx, post = m.hf_index(index[1:])
        parts = []
        for i in range(layers.start, layers.stop):
            raw = read_slice(src, m.hf_name.format(i=i), hf_idx)
            parts.append(np.asarray(m.from_hf_slice(raw, post), dtype=dtype))
        if not parts:
            sizes = [len(range(*norm_slice(s, n).indices(n))) for s, n in
                     zip(index[1:], m.layer_shape)]
            return np.zeros((0, *sizes), dtype)
        return np.stack(parts)
    hf_idx, post = m.hf_index(index)
    raw = read_slice(src, m.hf_name, hf_idx)
    return np.ascontiguousarray(np.asarray(m.from_hf_slice(raw, post), dtype=dtype))


def load_params_from_source(
    src: TensorSource,
    cfg: ModelConfig,
    mesh: Mesh | None = None,
    rules: ShardingRules | None = None,
    dtype: Any = None,
) -> Params:
    """Our param pytree from HF-named tensors; sharded per ``rules`` on ``mesh`` if given."""
    check_source(src, cfg)
    np_dtype = np.dtype(jax.numpy.dtype(dtype or cfg.param_dtype))
    axes = param_axes(cfg)
    params: Params = {}
    maps = tensor_maps(cfg)
    if mesh is not None:
        rules = rules or ShardingRules.from_mapping(None)
        shapes: Params = {}
        for m in maps:
            _set(shapes, m.path, jax.ShapeDtypeStruct(m.shape, np_dtype))
        check_divisible(mesh, rules, shapes, axes)
    for m in maps:
        if mesh is None:
            arr = jax.numpy.asarray(_read_leaf(src, m, (), np_dtype))
        else:
            assert rules is not None  # (set above whenever there is a mesh)
            sharding = NamedSharding(mesh, rules.spec(_get(axes, m.path)))
            arr = jax.make_array_from_callback(
                m.shape, sharding, functools.partial(_read_index, src, m, np_dtype))
        _set(params, m.path, arr)
    check_params(params, cfg)
    return params


def load_hf_checkpoint(
    path: str | os.PathLike,
    cfg: ModelConfig | None = None,
    mesh: Mesh | None = None,
    rules: ShardingRules | None = None,
    dtype: Any = None,
) -> tuple[ModelConfig, Params]:
    """Load a HF checkpoint folder (config.json + safetensors) into our pytree.

    With ``mesh``, every leaf is a sharded ``jax.Array`` laid out per ``rules`` and each device
    reads only its own slice from disk. ``dtype`` defaults to ``cfg.param_dtype``.

    A config.json the decoder does not implement raises ``UnsupportedModelConfig`` (see
    ``from_hf_config``) before any safetensors file is opened; then the stored tensors must be
    exactly the ones the config uses (``check_source``), or ``CheckpointError`` names them.
    """
    if cfg is None:
        cfg = from_hf_config(read_hf_config(path))
    src = SafetensorsSource(path)
    try:
        params = load_params_from_source(src, cfg, mesh, rules, dtype)
        jax.block_until_ready(params)
    finally:
        src.close()
    return cfg, params


# ------------------------------------------------------------------------------ saving
def _host(x: Any) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def iter_hf_tensors(
    params: Params, cfg: ModelConfig, dtype: Any = None
) -> Iterator[tuple[str, np.ndarray]]:
    """Stream (HF name, host array in HF layout), one layer of one leaf at a time.

    Arrays must be fully addressable from this process (single host); ``dtype`` casts.
    """
    check_params(params, cfg)
    np_dtype = None if dtype is None else np.dtype(jax.numpy.dtype(dtype))
    for m in tensor_maps(cfg):
        leaf = _get(params, m.path)
        layers = range(m.num_layers) if m.stacked else [None]
        for i in layers:
            part = _host(leaf[i] if i is not None else leaf)
            hf = m.to_hf(part)
            if np_dtype is not None:
                hf = hf.astype(np_dtype)
            yield (m.hf_name.format(i=i) if i is not None else m.hf_name), hf


def to_hf_config(
    cfg: ModelConfig,
    dtype: str = "bfloat16",
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
) -> dict[str, Any]:
    """A HF ``config.json`` dict for this config (transformers 5 keys plus 4.x fallbacks)."""
    arch, model_type = HF_ARCHITECTURES[cfg.family]
    full = cfg.rope_for("full_attention")
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
        "rope_theta": full.theta,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
    out.update(FAMILIES[cfg.family].hf_extras(cfg))  # RoPE and the family's own keys
    return out


def _token_ids(tokenizer: Any) -> tuple[int | None, int | list[int] | None, int | None]:
    if tokenizer is None:
        return None, None, None
    bos = getattr(tokenizer, "bos_id", None)
    eos = getattr(tokenizer, "eos_id", None)
    pad = getattr(tokenizer, "pad_id", None)
    return bos, eos, pad


def save_hf_checkpoint(
    params: Params,
    cfg: ModelConfig,
    path: str | os.PathLike,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 5 * 2**30,
    tokenizer: Any = None,
    generation_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write a HF checkpoint folder that ``transformers`` (and vLLM) load as is.

    ``tokenizer``: a ``pmd_jax.models.tokenizer.Tokenizer`` (its files and chat template are
    saved, and its bos/eos/pad ids go into the configs).
    """

    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"save dtype {dtype!r} is not one of bfloat16, float32, float16")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    maps = tensor_maps(cfg)
    check_params(params, cfg)
    spread = [jax.tree_util.keystr(k) for k, v in jax.tree_util.tree_leaves_with_path(params)
              if isinstance(v, jax.Array) and not v.is_fully_addressable]
    if spread:
        raise ValueError(
            f"save_hf_checkpoint: params{spread[0]} (and {len(spread) - 1} more) span several "
            "processes; gather them on every process first (pmd_jax.run.multihost.gather_tree) "
            "and write on process 0 (the run's HF export does both)")
    # Plan shards from shapes (no data touched), then stream one shard at a time.
    sizes: list[tuple[str, int]] = []
    for m in maps:
        nbytes = math.prod(m.hf_shape) * np_dtype.itemsize
        sizes += [(n, nbytes) for n in m.hf_names()]
    total = sum(s for _, s in sizes)
    shards: list[list[str]] = [[]]
    acc = 0
    for name, nb in sizes:
        if shards[-1] and acc + nb > max_shard_bytes:
            shards.append([])
            acc = 0
        shards[-1].append(name)
        acc += nb
    n = len(shards)
    file_of: dict[str, str] = {}
    for k, names in enumerate(shards):
        fname = SAFE_SINGLE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        for name in names:
            file_of[name] = fname
    for stale in list(out.glob("model*.safetensors")) + [out / SAFE_INDEX]:
        if stale.exists():
            stale.unlink()
    buf: dict[str, np.ndarray] = {}
    current = None
    for name, arr in iter_hf_tensors(params, cfg, dtype=np_dtype):
        f = file_of[name]
        if current is not None and f != current:
            save_file(buf, str(out / current), metadata={"format": "pt"})
            buf = {}
        current = f
        buf[name] = np.ascontiguousarray(arr)
    if current is not None:
        save_file(buf, str(out / current), metadata={"format": "pt"})
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": file_of}
        (out / SAFE_INDEX).write_text(json.dumps(index, indent=2))
    bos, eos, pad = _token_ids(tokenizer)
    hf_cfg = to_hf_config(cfg, dtype, bos, eos, pad)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    gen: dict[str, Any] = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    if tokenizer is not None:
        stops = list(getattr(tokenizer, "stop_ids", []) or [])
        if stops:
            gen["eos_token_id"] = stops if len(stops) > 1 else stops[0]
    gen.update(dict(generation_config or {}))
    gen = {k: v for k, v in gen.items() if v is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if tokenizer is not None:
        tokenizer.save(out)
    return out
