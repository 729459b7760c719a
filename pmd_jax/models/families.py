"""Model families: what differs between Llama, Qwen2, Qwen3 and OLMo-3 outside the weights and math.

One :class:`FamilySpec` per family, registered in :data:`FAMILIES` (the one place to register
a family). It holds how a HF ``config.json`` of that ``model_type`` is read
(``config.from_hf_config``: transformers' defaults, qk-norm and norm placement, which layers
slide) and written (``hf_io.to_hf_config``: the family's own keys). The weights a config has are
declared in :mod:`pmd_jax.models.weights`, the math in :mod:`pmd_jax.models.decoder`; both
branch on config fields (``qk_norm``, ``norm_placement``, ``attention_bias``,
``qkv_bias``, ``tie_embeddings``), never on the family's name.

Adding a family whose weights and math the decoder already has (e.g. another Llama-like
model): one ``FamilySpec`` here. One with a new weight or op: also an entry in
``weights.declare`` and its use in ``decoder.decoder_layer``, under a new config field.

This module imports nothing from the rest of ``pmd_jax.models`` but :mod:`.rope_config`
(``config`` imports it); a writer reads a ``ModelConfig`` through :class:`ConfigFields`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from pmd_jax.models.rope_config import RopeConfig

LayerTypesReader = Callable[[Mapping[str, Any], int, Mapping[str, Any]],
                            tuple[Any, Any]]


class ConfigFields(Protocol):
    """What a family's HF writer (``FamilySpec.hf_extras``) reads of a
    :class:`pmd_jax.models.config.ModelConfig`."""

    @property
    def num_layers(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def sliding_window(self) -> int | None: ...

    @property
    def layer_types(self) -> tuple[str, ...] | None: ...

    @property
    def rope(self) -> tuple[tuple[str, RopeConfig], ...]: ...

    def rope_for(self, layer_type: str) -> RopeConfig: ...


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """One model family. ``name`` is both ``ModelConfig.family`` and the HF ``model_type``."""

    name: str
    hf_architecture: str  # the *ForCausalLM class transformers builds for this model_type
    # transformers' config-class defaults for keys a config.json may omit ("head_dim" /
    # "num_key_value_heads" None = derived as transformers does)
    hf_defaults: Mapping[str, Any]
    qk_norm: str = "none"  # ModelConfig.qk_norm of every model of the family
    norm_placement: str = "pre"  # ModelConfig.norm_placement
    qkv_bias: bool = False  # ModelConfig.qkv_bias: q/k/v biases by architecture (Qwen2)
    needs_head_dim: bool = False  # config.json must give an integer head_dim
    rope_per_layer_type: bool = False  # rope_parameters = {layer_type: {...}} (OLMo-3)
    # (hf, num_layers, hf_defaults) -> (layer_types list or None, sliding_window or None),
    # read as the family's HF config class does; None: every layer is full attention
    read_layer_types: LayerTypesReader | None = None
    sliding_hint: str = ""  # appended to the "sliding layers need a window" error
    drop_unused_window: bool = True  # no sliding layer: forget layer_types and the window
    # to_hf_config's keys after the common ones (RoPE included), in config.json order
    hf_extras: Callable[[ConfigFields], dict[str, Any]] = lambda cfg: {}


def rope_to_hf(r: RopeConfig) -> dict[str, Any]:
    """One RoPE config as a HF ``rope_parameters`` dict."""
    d: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type in ("linear", "llama3", "yarn"):
        d["factor"] = r.factor
    if r.rope_type in ("llama3", "yarn") and r.original_max_position_embeddings:
        d["original_max_position_embeddings"] = r.original_max_position_embeddings
    if r.rope_type == "llama3":
        d["low_freq_factor"] = r.low_freq_factor
        d["high_freq_factor"] = r.high_freq_factor
    if r.rope_type == "yarn":
        d["beta_fast"] = r.beta_fast
        d["beta_slow"] = r.beta_slow
        if r.attention_factor is not None:
            d["attention_factor"] = r.attention_factor
        if not r.truncate:
            d["truncate"] = False
    return d


def _flat_rope(cfg: ConfigFields) -> dict[str, Any]:
    full = cfg.rope_for("full_attention")
    out: dict[str, Any] = {"rope_parameters": rope_to_hf(full)}
    if full.rope_type != "default":
        out["rope_scaling"] = rope_to_hf(full)
    return out


# ------------------------------------------------------------------------------ Llama
def _llama_hf(cfg: ConfigFields) -> dict[str, Any]:
    return {"mlp_bias": False, "pretraining_tp": 1, **_flat_rope(cfg)}


LLAMA = FamilySpec(
    name="llama", hf_architecture="LlamaForCausalLM",
    hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0,
                 "head_dim": None, "num_key_value_heads": None},
    hf_extras=_llama_hf,
)


# ------------------------------------------------------------------------------ Qwen2 / Qwen3
def _qwen_layer_types(hf: Mapping[str, Any], n_layers: int,
                       defaults: Mapping[str, Any]) -> tuple[Any, Any]:
    """Qwen2Config / Qwen3Config.__post_init__: layers from max_window_layers on slide, if
    use_sliding_window."""
    use_sw = bool(hf.get("use_sliding_window", False))
    sliding = hf.get("sliding_window", defaults["sliding_window"]) if use_sw else None
    layer_types = hf.get("layer_types")
    if layer_types is None:
        mwl = hf.get("max_window_layers", defaults["max_window_layers"])
        layer_types = [
            "sliding_attention" if sliding is not None and i >= mwl else "full_attention"
            for i in range(n_layers)
        ]
    return layer_types, sliding


def _qwen_hf(cfg: ConfigFields) -> dict[str, Any]:
    out = _flat_rope(cfg)
    if cfg.layer_types and "sliding_attention" in cfg.layer_types:
        out["use_sliding_window"] = True
        out["sliding_window"] = cfg.sliding_window
        out["layer_types"] = list(cfg.layer_types)
        out["max_window_layers"] = cfg.layer_types.index("sliding_attention")
    else:
        out["use_sliding_window"] = False
        out["sliding_window"] = None
        out["max_window_layers"] = cfg.num_layers
        out["layer_types"] = ["full_attention"] * cfg.num_layers
    return out


QWEN3 = FamilySpec(
    name="qwen3", hf_architecture="Qwen3ForCausalLM",
    hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0,
                 "head_dim": 128, "num_key_value_heads": 32, "sliding_window": 4096,
                 "max_window_layers": 28},
    qk_norm="per_head", needs_head_dim=True,
    read_layer_types=_qwen_layer_types, sliding_hint=" and use_sliding_window=true",
    hf_extras=_qwen_hf,
)

# Qwen2 / Qwen2.5 (Qwen2.5-Coder): Qwen3's config keys without qk-norm; q/k/v carry biases
# (Qwen2Attention builds them unconditionally), o does not; head_dim derived when omitted.
QWEN2 = FamilySpec(
    name="qwen2", hf_architecture="Qwen2ForCausalLM",
    hf_defaults={"rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 10000.0,
                 "head_dim": None, "num_key_value_heads": 32, "sliding_window": 4096,
                 "max_window_layers": 28},
    qkv_bias=True,
    read_layer_types=_qwen_layer_types, sliding_hint=" and use_sliding_window=true",
    hf_extras=_qwen_hf,
)


# ------------------------------------------------------------------------------ OLMo-3
def _olmo3_layer_types(hf: Mapping[str, Any], n_layers: int,
                       defaults: Mapping[str, Any]) -> tuple[Any, Any]:
    """Olmo3Config.__post_init__: every 4th layer is full attention."""
    sliding = hf.get("sliding_window", defaults["sliding_window"])
    layer_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n_layers)
    ]
    return layer_types, sliding


def _olmo3_hf(cfg: ConfigFields) -> dict[str, Any]:
    full = cfg.rope_for("full_attention")
    rope_types = dict(cfg.rope)
    out: dict[str, Any] = {
        "rope_parameters": {lt: rope_to_hf(rope_types.get(lt, full))
                            for lt in ("full_attention", "sliding_attention")},
        "layer_types": list(cfg.layer_types or ["full_attention"] * cfg.num_layers),
        "sliding_window": cfg.sliding_window or cfg.max_position_embeddings,
    }
    if full.rope_type != "default":
        out["rope_scaling"] = rope_to_hf(full)
    return out


OLMO3 = FamilySpec(
    name="olmo3", hf_architecture="Olmo3ForCausalLM",
    hf_defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 500000.0,
                 "head_dim": None, "num_key_value_heads": None, "sliding_window": 4096},
    qk_norm="full", norm_placement="post", rope_per_layer_type=True,
    read_layer_types=_olmo3_layer_types, drop_unused_window=False,
    hf_extras=_olmo3_hf,
)


# ------------------------------------------------------------------------------ registry
FAMILIES: dict[str, FamilySpec] = {f.name: f for f in (LLAMA, QWEN2, QWEN3, OLMO3)}
