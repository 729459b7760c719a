"""Every weight of the decoder, declared once.

:func:`declare` lists the weights a :class:`ModelConfig` has, one :class:`Weight` each, with

* where it sits in the param tree (``path``) and its shape as a function of the config;
* the logical name of each axis (``axes``; :mod:`pmd_jax.run.sharding` maps them to mesh axes);
* its initializer (``init``: HF's normal(0, 0.02), zeros or ones);
* its HF tensor name and layout: ``hf_layout`` writes the HF tensor's dims with the same axis
  names, a parenthesised group being one HF dim that splits into those axes, e.g. q's
  ``"(heads head_dim) embed"`` is HF ``q_proj.weight [H*hd, D]``, ours ``[D, H, hd]``;
* its llama.cpp (GGUF) name and whether llama.cpp permuted its rows (Q and K, in GGUF
  architectures that permute: ``llama``, not ``qwen2``; see ``gguf_io.GGUF_ARCHS``).

Everything else is derived from that list: the param tree of shapes (:func:`shape_tree`), of
logical axes (:func:`axes_tree`, hence shardings), the random init (:func:`init_tree`), the HF
import/export maps (``hf_io.tensor_maps`` *is* this list) and the GGUF names
(:func:`gguf_names`). Layer weights are stacked on a leading ``layers`` axis (``stacked``); their
HF and GGUF names hold ``{i}`` for the layer index.

To add a weight: one entry in :func:`declare` (under the config condition that has it) and its
use in ``decoder.decoder_layer``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pmd_jax.models.config import ModelConfig

INIT_STD = 0.02  # HF initializer_range default for all three families
INITS: tuple[str, ...] = ("normal", "zeros", "ones")
LAYER = "model.layers.{i}."  # HF name prefix of a layer's tensors
BLOCK = "blk.{i}."  # GGUF name prefix of a layer's tensors


class ParamError(ValueError):
    """A param pytree does not match the config; the message names the tensor."""


def _parse_layout(layout: str) -> tuple[tuple[str, ...], ...]:
    """``"(heads head_dim) embed"`` -> ``(("heads", "head_dim"), ("embed",))``."""
    return tuple(tuple(g.strip("()").split())
                 for g in re.findall(r"\([^()]*\)|[^\s()]+", layout))


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight: its place, shape, logical axes, init, HF tensor and GGUF name.

    ``shape`` and ``axes`` are per layer for stacked weights (the tree adds the leading
    ``layers`` axis of size ``num_layers``). ``ours = hf.reshape(flat_split).transpose(perm)``
    maps one (per-layer) HF tensor to ours; both are derived from ``hf_layout``.
    """

    path: tuple[str, ...]
    layer_shape: tuple[int, ...]
    layer_axes: tuple[str, ...]
    init: str
    hf_name: str
    hf_layout: str
    gguf_name: str | None = None
    gguf_permute: str | None = None  # "num_heads" | "num_kv_heads": llama.cpp permuted rows
    num_layers: int = 0  # > 0: stacked over layers (names hold "{i}")

    def __post_init__(self) -> None:
        if len(self.layer_shape) != len(self.layer_axes):
            raise ValueError(f"weight {self.path}: shape {self.layer_shape} vs axes "
                             f"{self.layer_axes}")
        if self.init not in INITS:
            raise ValueError(f"weight {self.path}: init {self.init!r} is not one of {INITS}")
        names = [a for g in _parse_layout(self.hf_layout) for a in g]
        if sorted(names) != sorted(self.layer_axes) or len(set(names)) != len(names):
            raise ValueError(f"weight {self.path}: hf_layout {self.hf_layout!r} must name each "
                             f"of {self.layer_axes} once")

    # ------------------------------------------------------------------ our layout
    @property
    def stacked(self) -> bool:
        return self.num_layers > 0

    @property
    def shape(self) -> tuple[int, ...]:
        return ((self.num_layers,) if self.stacked else ()) + self.layer_shape

    @property
    def axes(self) -> tuple[str, ...]:
        return (("layers",) if self.stacked else ()) + self.layer_axes

    # ------------------------------------------------------------------ HF layout
    @property
    def split(self) -> tuple[tuple[int, ...], ...]:
        """The sizes each HF dim splits into."""
        size = dict(zip(self.layer_axes, self.layer_shape))
        return tuple(tuple(size[a] for a in g) for g in _parse_layout(self.hf_layout))

    @property
    def perm(self) -> tuple[int, ...]:
        """Ours (per layer) = the split HF tensor transposed by this."""
        flat = [a for g in _parse_layout(self.hf_layout) for a in g]
        return tuple(flat.index(a) for a in self.layer_axes)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.split)

    @property
    def flat_split(self) -> tuple[int, ...]:
        return tuple(d for s in self.split for d in s)

    def hf_names(self) -> list[str]:
        if self.stacked:
            return [self.hf_name.format(i=i) for i in range(self.num_layers)]
        return [self.hf_name]

    def to_hf(self, ours_layer: np.ndarray) -> np.ndarray:
        """Ours (one layer) -> the HF tensor."""
        inv = tuple(int(i) for i in np.argsort(self.perm))
        return np.ascontiguousarray(ours_layer.transpose(inv)).reshape(self.hf_shape)

    def from_hf(self, hf: np.ndarray) -> np.ndarray:
        """The HF tensor (one layer, whole) -> ours."""
        return hf.reshape(self.flat_split).transpose(self.perm)

    def hf_index(self, ours_index: Sequence[slice]) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
        """Map a per-layer index of ours to (the HF slice to read, the index into it after split).

        For each HF dim grouping flat dims (g0, g1, ...), we read the rows of g0's slice times the
        product of the inner sizes: exact when the inner dims are not sliced (the usual case).
        """
        fs = self.flat_split
        flat_slices: list[slice] = [slice(0, n) for n in fs]
        for k, p in enumerate(self.perm):
            flat_slices[p] = norm_slice(ours_index[k], fs[p])
        hf_sl: list[slice] = []
        post: list[slice] = []
        j = 0
        for group in self.split:
            inner = math.prod(group[1:])
            outer = flat_slices[j]
            hf_sl.append(slice(outer.start * inner, outer.stop * inner))
            post.append(slice(0, outer.stop - outer.start))
            post.extend(flat_slices[j + 1 : j + len(group)])
            j += len(group)
        return tuple(hf_sl), tuple(post)

    def from_hf_slice(self, hf_part: np.ndarray, post: tuple[slice, ...]) -> np.ndarray:
        """Ours (per layer) from a slice read with ``hf_index``."""
        shape: list[int] = []
        for gi, group in enumerate(self.split):
            shape.append(hf_part.shape[gi] // math.prod(group[1:]))
            shape.extend(group[1:])
        return hf_part.reshape(shape)[post].transpose(self.perm)


def norm_slice(s: slice, n: int) -> slice:
    start, stop, step = s.indices(n)
    if step != 1:
        raise ValueError(f"strided index {s} is not supported")
    return slice(start, stop)


# --------------------------------------------------------------------------- the declaration
def declare(cfg: ModelConfig) -> tuple[Weight, ...]:
    """The weights of this config, in HF checkpoint order."""
    L, D, H, KV, hd = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    F, V = cfg.intermediate_size, cfg.vocab_size

    def layer(name: str, shape: tuple[int, ...], axes: tuple[str, ...], init: str, hf: str,
              layout: str, gguf: str | None = None, permute: str | None = None) -> Weight:
        return Weight(("layers", name), shape, axes, init, LAYER + hf, layout,
                      None if gguf is None else BLOCK + gguf, permute, L)

    out = [Weight(("embed",), (V, D), ("vocab", "embed"), "normal",
                  "model.embed_tokens.weight", "vocab embed", "token_embd.weight")]
    out += [
        layer("q", (D, H, hd), ("embed", "heads", "head_dim"), "normal",
              "self_attn.q_proj.weight", "(heads head_dim) embed", "attn_q.weight", "num_heads"),
        layer("k", (D, KV, hd), ("embed", "kv_heads", "head_dim"), "normal",
              "self_attn.k_proj.weight", "(kv_heads head_dim) embed", "attn_k.weight",
              "num_kv_heads"),
        layer("v", (D, KV, hd), ("embed", "kv_heads", "head_dim"), "normal",
              "self_attn.v_proj.weight", "(kv_heads head_dim) embed", "attn_v.weight"),
        layer("o", (H, hd, D), ("heads", "head_dim", "embed"), "normal",
              "self_attn.o_proj.weight", "embed (heads head_dim)", "attn_output.weight"),
        layer("gate", (D, F), ("embed", "mlp"), "normal",
              "mlp.gate_proj.weight", "mlp embed", "ffn_gate.weight"),
        layer("up", (D, F), ("embed", "mlp"), "normal",
              "mlp.up_proj.weight", "mlp embed", "ffn_up.weight"),
        layer("down", (F, D), ("mlp", "embed"), "normal",
              "mlp.down_proj.weight", "embed mlp", "ffn_down.weight"),
    ]
    if cfg.attention_bias or cfg.qkv_bias:
        out += [
            layer("q_bias", (H, hd), ("heads", "head_dim"), "zeros",
                  "self_attn.q_proj.bias", "(heads head_dim)", "attn_q.bias", "num_heads"),
            layer("k_bias", (KV, hd), ("kv_heads", "head_dim"), "zeros",
                  "self_attn.k_proj.bias", "(kv_heads head_dim)", "attn_k.bias", "num_kv_heads"),
            layer("v_bias", (KV, hd), ("kv_heads", "head_dim"), "zeros",
                  "self_attn.v_proj.bias", "(kv_heads head_dim)", "attn_v.bias"),
        ]
    if cfg.attention_bias:
        out.append(layer("o_bias", (D,), ("norm",), "zeros", "self_attn.o_proj.bias", "norm",
                         "attn_output.bias"))
    if cfg.qk_norm == "per_head":  # Qwen3: RMSNorm over head_dim
        out += [
            layer("q_norm", (hd,), ("head_dim",), "ones", "self_attn.q_norm.weight", "head_dim",
                  "attn_q_norm.weight"),
            layer("k_norm", (hd,), ("head_dim",), "ones", "self_attn.k_norm.weight", "head_dim",
                  "attn_k_norm.weight"),
        ]
    elif cfg.qk_norm == "full":  # OLMo-3: RMSNorm over the whole projection
        out += [
            layer("q_norm", (H * hd,), ("q_proj",), "ones", "self_attn.q_norm.weight", "q_proj",
                  "attn_q_norm.weight"),
            layer("k_norm", (KV * hd,), ("kv_proj",), "ones", "self_attn.k_norm.weight",
                  "kv_proj", "attn_k_norm.weight"),
        ]
    if cfg.norm_placement == "pre":  # Llama, Qwen3: norms on the sublayer inputs
        out += [
            layer("attn_norm", (D,), ("norm",), "ones", "input_layernorm.weight", "norm",
                  "attn_norm.weight"),
            layer("mlp_norm", (D,), ("norm",), "ones", "post_attention_layernorm.weight", "norm",
                  "ffn_norm.weight"),
        ]
    else:  # OLMo-3: norms on the sublayer outputs, before the residual add
        out += [
            layer("attn_norm", (D,), ("norm",), "ones", "post_attention_layernorm.weight",
                  "norm", "post_attention_norm.weight"),
            layer("mlp_norm", (D,), ("norm",), "ones", "post_feedforward_layernorm.weight",
                  "norm", "post_ffw_norm.weight"),
        ]
    out.append(Weight(("final_norm",), (D,), ("norm",), "ones", "model.norm.weight", "norm",
                      "output_norm.weight"))
    if not cfg.tie_embeddings:
        out.append(Weight(("lm_head",), (D, V), ("embed", "vocab"), "normal", "lm_head.weight",
                          "vocab embed", "output.weight"))
    return tuple(out)


# --------------------------------------------------------------------------- derived views
def _tree(cfg: ModelConfig, leaf: Any) -> dict[str, Any]:
    """The param tree of ``leaf(weight)``; layer weights under "layers"."""
    layers: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for w in declare(cfg):
        if w.path[0] == "layers":
            if "layers" not in out:
                out["layers"] = layers
            layers[w.path[1]] = leaf(w)
        else:
            out[w.path[0]] = leaf(w)
    return out


def shape_tree(cfg: ModelConfig) -> dict[str, Any]:
    """Param tree of shapes (tuples of ints; layer weights with the leading layers axis)."""
    return _tree(cfg, lambda w: w.shape)


def axes_tree(cfg: ModelConfig) -> dict[str, Any]:
    """Param tree of logical axis names (tuples of str), for :mod:`pmd_jax.run.sharding`."""
    return _tree(cfg, lambda w: w.axes)


def init_tree(cfg: ModelConfig) -> dict[str, Any]:
    """Param tree of initializer names ("normal", "zeros", "ones")."""
    return _tree(cfg, lambda w: w.init)


def gguf_names(cfg: ModelConfig) -> dict[str, tuple[str, Weight]]:
    """llama.cpp tensor name -> (HF tensor name, its weight), every layer spelled out."""
    out: dict[str, tuple[str, Weight]] = {}
    for w in declare(cfg):
        if w.gguf_name is None:
            continue
        for i in range(w.num_layers) if w.stacked else [None]:
            g = w.gguf_name if i is None else w.gguf_name.format(i=i)
            out[g] = (w.hf_name if i is None else w.hf_name.format(i=i), w)
    return out


# --------------------------------------------------------------------------- checks
def check_base(params: Any, cfg: ModelConfig) -> None:
    """Raise :class:`ParamError` naming the first base tensor of ``params`` (layer-stacked,
    or with ``layers`` per layer) that is missing, extra or mis-shaped for ``cfg``."""
    want = shape_tree(cfg)
    layers = params.get("layers") if isinstance(params, dict) else None
    if isinstance(layers, (list, tuple)):
        if len(layers) != cfg.num_layers:
            raise ParamError(
                f"params/layers has {len(layers)} per-layer entries, expected {cfg.num_layers}")
        one = {k: s[1:] for k, s in want["layers"].items()}
        want = {**want, "layers": {}}
        rest = {**params, "layers": {}}
        for i, lp in enumerate(layers):
            walk_shapes(lp, one, f"/layers[{i}]")
        walk_shapes(rest, want, "")
        return
    walk_shapes(params, want, "")


def walk_shapes(params: Any, want: Any, where: str, root: str = "params") -> None:
    """Raise :class:`ParamError` at the first difference between the tree ``params`` and the
    tree of shapes ``want`` (named ``<root><where>/<key>...``)."""
    def walk(p: Any, w: Any, path: str) -> None:
        if isinstance(w, dict):
            if not isinstance(p, dict):
                raise ParamError(f"{root}{path} should be a dict, got {type(p).__name__}")
            missing = sorted(set(w) - set(p))
            extra = sorted(set(p) - set(w))
            if missing:
                raise ParamError(f"{root}{path} is missing tensor(s) {missing} for this config")
            if extra:
                raise ParamError(f"{root}{path} has unexpected tensor(s) {extra} for this config")
            for k in w:
                walk(p[k], w[k], f"{path}/{k}")
            return
        shape = tuple(getattr(p, "shape", ()))
        if shape != w:
            raise ParamError(f"{root}{path} has shape {shape}, expected {w}")

    walk(params, want, where)
