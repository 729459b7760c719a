"""LoRA adapters for the decoder (issue 51): declaration, init, merge and PEFT's file format.

What is frozen and what trains: the base params (``decoder.init_params`` / the HF or GGUF
loaders) stay as they are; a LoRA run trains a second, much smaller tree, the *adapters*. For
each target projection ``W`` (``q``, ``k``, ``v``, ``o``, ``gate``, ``up``, ``down``) it holds a
down-projection ``A`` and an up-projection ``B`` per layer, and the layer computes

    x W  +  scaling * ((x A) B),      scaling = alpha / rank   (alpha / sqrt(rank): rsLoRA)

(PEFT's ``LoraConfig.lora_alpha``, ``r``, ``use_rslora``). The adapter path goes through
``matmul.weight_einsum`` like the base matmul, so ``cfg.matmul_dtype`` applies to it too.

Where the adapters sit: a tree of their own, ``{"layers": {"q_lora_a": [L, D, r],
"q_lora_b": [L, r, H, hd], ...}}``, stacked on the leading ``layers`` axis like the base layer
weights and passed beside the params: ``decoder.forward(params, ..., adapters=, lora=)``. The
forward puts the adapter keys into each layer's weight dict (next to ``q``, ``k``, ...), so the
scan over layers carries them with the layer's weights and ``decoder.decoder_layer`` adds the
adapter path to a projection exactly when its ``<name>_lora_a`` is present. Without adapters
nothing changes (same ops, bitwise the same logits). Keeping the adapters a separate argument
makes "train only the adapters" ``jax.grad`` with respect to that argument, a teacher with
other adapters (or none: the base model) the same function with another argument, and a
checkpoint of the trainable state the adapter tree alone.

Shapes and logical axes: derived from the base weight's declaration
(:func:`pmd_jax.models.weights.declare`). ``A`` has the base weight's input axes (the HF
layout's second group) followed by ``lora_rank``; ``B`` has ``lora_rank`` followed by the output
axes: q A ``[D, r]`` B ``[r, H, hd]``; k/v A ``[D, r]`` B ``[r, KV, hd]``; o A ``[H, hd, r]``
B ``[r, D]``; gate/up A ``[D, r]`` B ``[r, F]``; down A ``[F, r]`` B ``[r, D]``. The new axis
``lora_rank`` is replicated by the default sharding rules (:mod:`pmd_jax.run.sharding`), the
others shard like the base weight's.

Init (PEFT's default, ``init_lora_weights=True``): ``A`` kaiming-uniform with ``a = sqrt(5)``,
i.e. uniform on ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]`` with fan_in the projection's input size
(D; H*hd for o; F for down); ``B`` zeros. So at step 0 the adapted model *is* the base model.
Dropout on the adapter input (PEFT's ``lora_dropout``) is not implemented: ``LoraConfig``
refuses ``dropout != 0``.

Export: :func:`merge` folds ``W + scaling * A B`` into plain params (for
``hf_io.save_hf_checkpoint`` and for any sampler that takes plain weights);
:func:`save_peft_adapter` writes a folder ``peft.PeftModel.from_pretrained`` loads:
``adapter_config.json`` (``peft_type`` "LORA", ``task_type`` "CAUSAL_LM", ``r``, ``lora_alpha``,
``lora_dropout``, ``target_modules`` by HF module name (``q_proj`` ... ``down_proj``),
``use_rslora``, ``bias`` "none", ``base_model_name_or_path``) and ``adapter_model.safetensors``
with one tensor per layer and target, named
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]`` (torch ``nn.Linear`` layouts; ``in``/``out`` flatten the head
axes head-major, as the base weight's ``hf_layout`` says). Each adapter tensor is declared as a
:class:`pmd_jax.models.weights.Weight` whose ``hf_layout`` is derived from the base weight's, so
the conversion is ``Weight.to_hf`` / ``Weight.from_hf`` and no permutation is written here.
:func:`load_peft_adapter` reads such a folder (ours or one PEFT saved) back, refusing the PEFT
features the forward does not compute (DoRA, bias training, per-layer rank patterns, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from pmd_jax.models import weights
from pmd_jax.models.config import ConfigError
from pmd_jax.models.weights import Weight

if TYPE_CHECKING:
    from pmd_jax.models.config import ModelConfig

Params = dict[str, Any]

TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
RANK_AXIS = "lora_rank"  # the logical axis of the rank (replicated by default)
PEFT_PREFIX = "base_model.model."  # PEFT's prefix before the base model's module names
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# The adapter path of each target in decoder_layer, with its letters: x -> x A -> (x A) B.
SPECS: dict[str, tuple[str, str]] = {
    "q": ("btd,dr->btr", "btr,rhk->bthk"),
    "k": ("btd,dr->btr", "btr,rhk->bthk"),
    "v": ("btd,dr->btr", "btr,rhk->bthk"),
    "o": ("bthk,hkr->btr", "btr,rd->btd"),
    "gate": ("btd,dr->btr", "btr,rf->btf"),
    "up": ("btd,dr->btr", "btr,rf->btf"),
    "down": ("btf,fr->btr", "btr,rd->btd"),
}
# einsum letter of each logical axis (heads and kv_heads never meet in one product)
_LETTER = {"layers": "l", "embed": "d", "heads": "h", "kv_heads": "h", "head_dim": "k",
           "mlp": "f", RANK_AXIS: "r"}


class LoraError(ConfigError):
    """A LoRA config, adapter tree or adapter folder is invalid; the message names the field,
    tensor or key."""


# --------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA hyper-parameters (PEFT's names: ``r``, ``lora_alpha``, ``target_modules``,
    ``lora_dropout``, ``use_rslora``). Frozen and hashable: a static jit argument. ``targets``
    is kept in ``TARGETS`` order (so equal sets give equal configs)."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = TARGETS
    dropout: float = 0.0
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, np.integer)) \
                or self.rank < 1:
            raise LoraError(f"LoraConfig.rank={self.rank!r}: must be an integer >= 1")
        object.__setattr__(self, "rank", int(self.rank))
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float, np.number)) \
                or not math.isfinite(float(self.alpha)) or float(self.alpha) <= 0:
            raise LoraError(f"LoraConfig.alpha={self.alpha!r}: must be a finite number > 0")
        object.__setattr__(self, "alpha", float(self.alpha))
        if isinstance(self.targets, str) or not isinstance(self.targets, (tuple, list)):
            raise LoraError(f"LoraConfig.targets={self.targets!r}: must be a tuple of names "
                            f"from {TARGETS}")
        targets = tuple(self.targets)
        unknown = [t for t in targets if t not in TARGETS]
        if unknown or not targets or len(set(targets)) != len(targets):
            why = f"; unknown {unknown}" if unknown else ""
            raise LoraError(f"LoraConfig.targets={targets!r}: must be distinct names from "
                            f"{TARGETS}, at least one{why}")
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in targets))
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float, np.number)):
            raise LoraError(f"LoraConfig.dropout={self.dropout!r}: must be a number")
        if self.dropout != 0:
            raise LoraError(f"LoraConfig.dropout={self.dropout!r}: LoRA dropout is not "
                            "implemented; use 0.0")
        object.__setattr__(self, "dropout", 0.0)
        if not isinstance(self.use_rslora, (bool, np.bool_)):
            raise LoraError(f"LoraConfig.use_rslora={self.use_rslora!r}: must be a bool")
        object.__setattr__(self, "use_rslora", bool(self.use_rslora))

    @property
    def scaling(self) -> float:
        """The factor on the adapter path: alpha / rank, or alpha / sqrt(rank) (rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


# --------------------------------------------------------------------------- declaration
@dataclasses.dataclass(frozen=True)
class Adapter:
    """One adapter tensor (``A`` or ``B`` of one target): ``weight`` gives its place in the
    adapter tree (``("layers", "q_lora_a")``), per-layer shape and logical axes, and its PEFT
    tensor name and layout (``weight.init`` is unused: ``init`` is the LoRA init)."""

    target: str  # "q", ..., "down"
    part: str  # "a" (down-projection to the rank) | "b" (up-projection from it)
    weight: Weight
    fan_in: int  # the projection's input size (A's init bound is 1/sqrt(fan_in))

    @property
    def key(self) -> str:
        return self.weight.path[-1]

    @property
    def init(self) -> str:
        return "kaiming_uniform" if self.part == "a" else "zeros"

    @property
    def module(self) -> str:
        """The HF module name PEFT's ``target_modules`` uses (``q_proj``, ...)."""
        return self.weight.hf_name.split(".")[-3]


def adapter_key(target: str, part: str) -> str:
    return f"{target}_lora_{part}"


def _layout(group: tuple[str, ...]) -> str:
    return group[0] if len(group) == 1 else "(" + " ".join(group) + ")"


def declare_adapters(cfg: ModelConfig, lora: LoraConfig) -> tuple[Adapter, ...]:
    """The adapter tensors of this model and LoRA config, A then B of each target, in
    ``TARGETS`` order."""
    base = {w.path[1]: w for w in weights.declare(cfg) if w.path[0] == "layers"}
    r = lora.rank
    out: list[Adapter] = []
    for t in TARGETS:
        if t not in lora.targets:
            continue
        w = base[t]
        groups = weights._parse_layout(w.hf_layout)  # HF nn.Linear: [out, in]
        if len(groups) != 2:
            raise LoraError(f"weight {w.path}: hf_layout {w.hf_layout!r} is not [out, in]")
        out_g, in_g = groups
        size = dict(zip(w.layer_axes, w.layer_shape))
        in_axes = tuple(a for a in w.layer_axes if a in in_g)
        out_axes = tuple(a for a in w.layer_axes if a in out_g)
        module = PEFT_PREFIX + w.hf_name.removesuffix(".weight")
        a = Weight(("layers", adapter_key(t, "a")), tuple(size[x] for x in in_axes) + (r,),
                   in_axes + (RANK_AXIS,), "zeros", module + ".lora_A.weight",
                   f"{RANK_AXIS} {_layout(in_g)}", num_layers=w.num_layers)
        b = Weight(("layers", adapter_key(t, "b")), (r,) + tuple(size[x] for x in out_axes),
                   (RANK_AXIS,) + out_axes, "zeros", module + ".lora_B.weight",
                   f"{_layout(out_g)} {RANK_AXIS}", num_layers=w.num_layers)
        fan_in = math.prod(size[x] for x in in_axes)
        out += [Adapter(t, "a", a, fan_in), Adapter(t, "b", b, fan_in)]
    return tuple(out)


def adapter_shapes(cfg: ModelConfig, lora: LoraConfig) -> Params:
    """Adapter tree of shapes (with the leading layers axis)."""
    return {"layers": {ad.key: ad.weight.shape for ad in declare_adapters(cfg, lora)}}


def adapter_axes(cfg: ModelConfig, lora: LoraConfig) -> Params:
    """Adapter tree of logical axis names (for :mod:`pmd_jax.run.sharding`)."""
    return {"layers": {ad.key: ad.weight.axes for ad in declare_adapters(cfg, lora)}}


def init_adapters(cfg: ModelConfig, lora: LoraConfig, key: jax.Array) -> Params:
    """PEFT's default init in ``cfg.param_dtype``: A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (one
    key per A, split in declaration order), B = 0."""
    return _init_jit(cfg, lora, key)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_jit(cfg: ModelConfig, lora: LoraConfig, key: jax.Array) -> Params:
    dt = jnp.dtype(cfg.param_dtype)
    decl = declare_adapters(cfg, lora)
    keys = jax.random.split(key, len(decl))
    layers: dict[str, jax.Array] = {}
    for ad, k in zip(decl, keys):
        if ad.part == "b":
            layers[ad.key] = jnp.zeros(ad.weight.shape, dt)
        else:
            bound = 1.0 / math.sqrt(ad.fan_in)
            layers[ad.key] = jax.random.uniform(k, ad.weight.shape, jnp.float32, -bound,
                                                bound).astype(dt)
    return {"layers": layers}


def check_adapters(adapters: Params, cfg: ModelConfig, lora: LoraConfig) -> None:
    """Raise ``weights.ParamError`` naming the first adapter tensor that is missing, extra or
    mis-shaped (adapters are always stacked on the layers axis)."""
    if not isinstance(adapters, dict) or isinstance(adapters.get("layers"), (list, tuple)):
        raise weights.ParamError("adapters must be {'layers': {name: stacked array}} (stacked "
                                 "on the layers axis; forward unstacks them for per-layer "
                                 "params)")
    weights.walk_shapes(adapters, adapter_shapes(cfg, lora), "", root="adapters")


# --------------------------------------------------------------------------- merge
def delta(adapters: Params, cfg: ModelConfig, lora: LoraConfig, target: str) -> jax.Array:
    """``scaling * A B`` of one target, float32, in the base weight's stacked layout."""
    a_ad, b_ad = (ad for ad in declare_adapters(cfg, lora) if ad.target == target)
    (w,) = (w for w in weights.declare(cfg) if w.path == ("layers", target))
    la = "".join(_LETTER[x] for x in a_ad.weight.axes)
    lb = "".join(_LETTER[x] for x in b_ad.weight.axes)
    lw = "".join(_LETTER[x] for x in w.axes)
    a = adapters["layers"][a_ad.key].astype(jnp.float32)
    b = adapters["layers"][b_ad.key].astype(jnp.float32)
    ab = jnp.einsum(f"{la},{lb}->{lw}", a, b, precision=jax.lax.Precision.HIGHEST)
    return lora.scaling * ab


def merge(params: Params, adapters: Params, cfg: ModelConfig, lora: LoraConfig) -> Params:
    """Plain params with each target's ``W + scaling * A B`` folded in (summed in float32,
    cast back to W's dtype): what the adapted model computes, as ordinary weights, for
    ``hf_io.save_hf_checkpoint`` or a sampler. Params must be layer-stacked."""
    if isinstance(params.get("layers"), (list, tuple)):
        raise LoraError("merge: params/layers is per-layer (unstack_layers); pass the stacked "
                        "params (decoder.stack_layers)")
    weights.check_base(params, cfg)
    check_adapters(adapters, cfg, lora)
    layers = dict(params["layers"])
    for t in lora.targets:
        w = layers[t]
        layers[t] = (w.astype(jnp.float32) + delta(adapters, cfg, lora, t)).astype(w.dtype)
    return {**params, "layers": layers}


# --------------------------------------------------------------------------- PEFT files
def peft_config(cfg: ModelConfig, lora: LoraConfig,
                base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` dict PEFT writes for this LoRA config."""
    modules = [ad.module for ad in declare_adapters(cfg, lora) if ad.part == "a"]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "use_rslora": lora.use_rslora,
        "bias": "none",
        "base_model_name_or_path": base_model_name_or_path,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_peft_adapter(
    adapters: Params,
    cfg: ModelConfig,
    lora: LoraConfig,
    out_dir: str | os.PathLike,
    base_model_name_or_path: str | None = None,
    dtype: str = "float32",
) -> Path:
    """Write a PEFT LoRA adapter folder (``adapter_config.json`` and
    ``adapter_model.safetensors``, tensors cast to ``dtype``) that
    ``peft.PeftModel.from_pretrained(base_model, out_dir)`` loads. Single host: the adapter
    arrays must be fully addressable."""

    if dtype not in ("float32", "bfloat16", "float16"):
        raise LoraError(f"save dtype {dtype!r} is not one of float32, bfloat16, float16")
    check_adapters(adapters, cfg, lora)
    np_dtype = np.dtype(jnp.dtype(dtype))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for ad in declare_adapters(cfg, lora):
        leaf = np.asarray(jax.device_get(adapters["layers"][ad.key]))
        for i in range(ad.weight.num_layers):
            tensors[ad.weight.hf_name.format(i=i)] = np.ascontiguousarray(
                ad.weight.to_hf(leaf[i]).astype(np_dtype))
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    conf = peft_config(cfg, lora, base_model_name_or_path)
    (out / ADAPTER_CONFIG).write_text(json.dumps(conf, indent=2))
    return out


# adapter_config.json keys (PEFT 0.21's LoraConfig) whose other values change what PEFT
# computes, or may, and that the forward does not implement: key -> the values we accept.
# Init-only options (init_lora_weights, loftq/eva/corda/lora_ga configs) need nothing: their
# effect is in the saved weights.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "bias": ("none",),
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "layers_to_transform": (None,),
    "layers_pattern": (None, [], ""),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "lora_bias": (False, None),
    "use_qalora": (False, None),
    "trainable_token_indices": (None,),
    "target_parameters": (None, []),
    "exclude_modules": (None, [], ""),
    "layer_replication": (None,),
    "alora_invocation_tokens": (None,),
    "use_bdlora": (None, False),
    "arrow_config": (None,),
    "kasa_config": (None,),
    "monteclora_config": (None,),
    "velora_config": (None,),
}


def _read_config(path: Path, cfg: ModelConfig, ignore_dropout: bool) -> LoraConfig:
    p = path / ADAPTER_CONFIG
    if not p.exists():
        raise LoraError(f"{path}: no {ADAPTER_CONFIG} (not a PEFT adapter folder)")
    try:
        conf = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise LoraError(f"{p}: invalid JSON: {e}") from e
    if not isinstance(conf, dict):
        raise LoraError(f"{p}: not a JSON object")
    if conf.get("peft_type") != "LORA":
        raise LoraError(f"{p}: peft_type={conf.get('peft_type')!r}, only 'LORA' is supported")
    for k, ok in _UNSUPPORTED.items():
        if k in conf and conf[k] not in ok:
            raise LoraError(f"{p}: {k}={conf[k]!r} is not supported (only {ok[0]!r})")
    by_module = {ad.module: ad.target for ad in declare_adapters(cfg, LoraConfig(rank=1))}
    mods = conf.get("target_modules")
    if not isinstance(mods, list) or not all(isinstance(m, str) for m in mods):
        raise LoraError(f"{p}: target_modules={mods!r}: need a list of module names from "
                        f"{sorted(by_module)} (a pattern such as 'all-linear' is not supported)")
    unknown = sorted(set(mods) - set(by_module))
    if unknown:
        raise LoraError(f"{p}: target_modules {unknown} are not projections of this model "
                        f"({sorted(by_module)})")
    dropout = conf.get("lora_dropout", 0.0) or 0.0
    if dropout and not ignore_dropout:
        raise LoraError(f"{p}: lora_dropout={dropout!r}: LoRA dropout is not implemented; pass "
                        "ignore_dropout=True to load it for inference (dropout only acts in "
                        "training)")
    chosen = {by_module[m] for m in mods}
    try:  # PEFT's defaults for omitted keys: r=8, lora_alpha=8
        return LoraConfig(rank=conf.get("r", 8), alpha=conf.get("lora_alpha", 8),
                          targets=tuple(t for t in TARGETS if t in chosen), dropout=0.0,
                          use_rslora=conf.get("use_rslora", False))
    except LoraError as e:
        raise LoraError(f"{p}: {e}") from e


def load_peft_adapter(
    path: str | os.PathLike, cfg: ModelConfig, *, dtype: str | None = None,
    ignore_dropout: bool = False,
) -> tuple[Params, LoraConfig]:
    """Read a PEFT LoRA adapter folder (:func:`save_peft_adapter`'s or PEFT's
    ``save_pretrained``) into ``(adapters, LoraConfig)``, arrays in ``dtype`` (default
    ``cfg.param_dtype``). The stored tensors must be exactly the ones the config names, with
    their shapes, or ``LoraError`` names them."""

    path = Path(path)
    lora = _read_config(path, cfg, ignore_dropout)
    f = path / ADAPTER_WEIGHTS
    if not f.exists():
        raise LoraError(f"{path}: no {ADAPTER_WEIGHTS} (only safetensors adapters are read)")
    try:
        tensors = load_file(str(f))
    except Exception as e:  # noqa: BLE001 - corrupt header etc.
        raise LoraError(f"{f}: cannot read as safetensors: {e}") from e
    decl = declare_adapters(cfg, lora)
    want = {ad.weight.hf_name.format(i=i): ad for ad in decl
            for i in range(ad.weight.num_layers)}
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing:
        raise LoraError(f"{f}: missing tensor(s) {missing[:4]} ({len(missing)} in all)")
    if extra:
        raise LoraError(f"{f}: unexpected tensor(s) {extra[:4]} ({len(extra)} in all) for "
                        f"targets {lora.targets}")
    dt = jnp.dtype(cfg.param_dtype if dtype is None else dtype)
    layers: dict[str, jax.Array] = {}
    for ad in decl:
        per_layer = []
        for i in range(ad.weight.num_layers):
            name = ad.weight.hf_name.format(i=i)
            t = tensors[name]
            if tuple(t.shape) != ad.weight.hf_shape:
                raise LoraError(f"{f}: tensor {name} has shape {tuple(t.shape)}, expected "
                                f"{ad.weight.hf_shape} (r={lora.rank})")
            per_layer.append(ad.weight.from_hf(np.asarray(t, np.float32)))
        layers[ad.key] = jnp.asarray(np.stack(per_layer), dt)
    return {"layers": layers}, lora
