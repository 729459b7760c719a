"""Model configuration for the one decoder that covers Llama, Qwen3 and OLMo-3.

A ``ModelConfig`` is a frozen dataclass (hashable, so it can be a static jit argument).
``from_hf_config`` reads a HF ``config.json`` dict; presets give the full-size models used in
dry runs without any file on disk.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

Family = Literal["llama", "qwen3", "olmo3"]
LayerType = Literal["full_attention", "sliding_attention"]
FAMILIES: tuple[str, ...] = ("llama", "qwen3", "olmo3")
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "dense", "chunked")  # = models.attention's

# HF architecture / model_type names we accept, mapped to our family.
_HF_MODEL_TYPES = {
    "llama": "llama",
    "qwen3": "qwen3",
    "olmo3": "olmo3",
}


class ConfigError(ValueError):
    """A model or run configuration is invalid; the message names the setting."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters for one layer type (HF ``rope_parameters`` semantics)."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "llama3" | "yarn" | "linear"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn (None -> HF default formula)
    truncate: bool = True  # yarn


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_embeddings: bool = False
    # QK-norm: "none" (Llama), "per_head" (Qwen3: RMSNorm over head_dim),
    # "full" (OLMo-3: RMSNorm over the whole projection, num_heads * head_dim).
    qk_norm: Literal["none", "per_head", "full"] = "none"
    # Norm placement: "pre" (Llama, Qwen3) or "post" (OLMo-3: norm applied to the sublayer
    # output before the residual add; no input norms).
    norm_placement: Literal["pre", "post"] = "pre"
    sliding_window: int | None = None
    # One entry per layer; None means every layer is full attention.
    layer_types: tuple[LayerType, ...] | None = None
    # RoPE per layer type; "full_attention" is always present.
    rope: tuple[tuple[str, RopeConfig], ...] = (("full_attention", RopeConfig()),)
    attention_bias: bool = False
    # Activations / params dtype for compute ("float32" | "bfloat16").
    dtype: str = "float32"
    param_dtype: str = "float32"
    # Operand dtype of the weight matmuls (q/k/v/o, MLP, and the LM head in the distillation
    # loss): None = the activations' dtype; "bfloat16" / "float16" = operands rounded to it,
    # float32 accumulation and result, backward matmuls in it too (see pmd_jax.models.matmul).
    matmul_dtype: str | None = None
    # Attention implementation: "dense" (materialised [B, KV, G, T, S] scores and [B, T, S]
    # mask), "chunked" (flash-style, O(chunk^2) scores, masks from slot indices; see
    # pmd_jax.models.attention) or "auto" (chunked when T * S > 1024^2). ``attention_chunk`` is
    # the query and key chunk size of the chunked version.
    attention_impl: str = "auto"
    attention_chunk: int = 512

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ helpers
    def layer_type(self, i: int) -> LayerType:
        return "full_attention" if self.layer_types is None else self.layer_types[i]

    def rope_for(self, layer_type: str) -> RopeConfig:
        table = dict(self.rope)
        return table.get(layer_type, table["full_attention"])

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        d, f, v, n = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        attn = d * (self.q_size + 2 * self.kv_size) + self.q_size * d
        mlp = 3 * d * f
        norms = 2 * d
        if self.qk_norm == "per_head":
            norms += 2 * self.head_dim
        elif self.qk_norm == "full":
            norms += self.q_size + self.kv_size
        total = n * (attn + mlp + norms) + v * d + d
        if not self.tie_embeddings:
            total += v * d
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token (2 * matmul params + attention scores), training = 3x."""
        d, f, n = self.hidden_size, self.intermediate_size, self.num_layers
        matmul = n * (d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 3 * d * f)
        matmul += self.vocab_size * d
        attn = 0.0
        for i in range(n):
            span = seq_len
            if self.layer_type(i) == "sliding_attention" and self.sliding_window:
                span = min(seq_len, self.sliding_window)
            attn += 2 * 2 * self.q_size * span / 2  # QK^T and PV, causal average
        return 2.0 * matmul + attn

    def validate(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"model.family={self.family!r} is not one of {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} is not a multiple of "
                f"model.num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim={self.head_dim} must be even for RoPE")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(
                    f"model.layer_types has {len(self.layer_types)} entries but "
                    f"num_layers={self.num_layers}"
                )
            bad = set(self.layer_types) - {"full_attention", "sliding_attention"}
            if bad:
                raise ConfigError(f"model.layer_types has unknown entries {sorted(bad)}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ConfigError(
                    "model.layer_types uses sliding_attention but sliding_window is unset"
                )
        if "full_attention" not in dict(self.rope):
            raise ConfigError("model.rope must define 'full_attention'")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(
                f"model.attention_impl={self.attention_impl!r} is not one of {ATTENTION_IMPLS}")
        if self.attention_chunk < 1:
            raise ConfigError(f"model.attention_chunk must be >= 1, got {self.attention_chunk}")
        for dt in (self.dtype, self.param_dtype):
            if dt not in ("float32", "bfloat16", "float16"):
                raise ConfigError(f"unsupported dtype {dt!r} (float32, bfloat16, float16)")
        if self.matmul_dtype not in (None, "bfloat16", "float16"):
            raise ConfigError(f"model.matmul_dtype={self.matmul_dtype!r} is not one of "
                              "None, 'bfloat16', 'float16'")

    def replace(self, **kw: Any) -> ModelConfig:
        return dataclasses.replace(self, **kw)


def _rope_from_hf(d: dict[str, Any], default_theta: float) -> RopeConfig:
    d = dict(d or {})
    rope_type = d.get("rope_type", d.get("type", "default"))
    return RopeConfig(
        theta=float(d.get("rope_theta", default_theta)),
        rope_type=rope_type,
        factor=float(d.get("factor", 1.0)),
        original_max_position_embeddings=d.get("original_max_position_embeddings"),
        low_freq_factor=float(d.get("low_freq_factor", 1.0)),
        high_freq_factor=float(d.get("high_freq_factor", 4.0)),
        beta_fast=float(d.get("beta_fast", 32.0)),
        beta_slow=float(d.get("beta_slow", 1.0)),
        attention_factor=d.get("attention_factor"),
        truncate=bool(d.get("truncate", True)),
    )


def from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """Build a ModelConfig from a HF ``config.json`` dict (transformers 4.x or 5.x keys)."""
    model_type = hf.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        archs = hf.get("architectures")
        raise ConfigError(
            f"unknown architecture: model_type={model_type!r} architectures={archs!r}; "
            f"supported model types: {sorted(_HF_MODEL_TYPES)}"
        )
    family = _HF_MODEL_TYPES[model_type]
    try:
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        n_layers = int(hf["num_hidden_layers"])
        vocab = int(hf["vocab_size"])
        inter = int(hf["intermediate_size"])
    except KeyError as e:
        raise ConfigError(f"HF config is missing required key {e.args[0]!r}") from None
    head_dim = int(hf.get("head_dim") or hidden // heads)
    theta = float(hf.get("rope_theta", 10000.0))
    rp = hf.get("rope_parameters")
    rope: dict[str, RopeConfig] = {}
    if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):
        for lt, sub in rp.items():  # per-layer-type (OLMo-3 in transformers 5)
            rope[lt] = _rope_from_hf(sub, theta)
    elif isinstance(rp, dict) and rp:
        rope["full_attention"] = _rope_from_hf(rp, theta)
    else:
        scaling = hf.get("rope_scaling") or {}
        rope["full_attention"] = _rope_from_hf({"rope_theta": theta, **scaling}, theta)
        if family == "olmo3":  # HF OLMo-3 applies rope_scaling only to full-attention layers
            rope["sliding_attention"] = RopeConfig(theta=theta)
    if "full_attention" not in rope:
        rope["full_attention"] = RopeConfig(theta=theta)
    if family == "olmo3" and "sliding_attention" not in rope:
        # a flat rope dict (yarn) applies to full-attention layers only, as in HF / vLLM
        rope["sliding_attention"] = RopeConfig(theta=rope["full_attention"].theta)
    layer_types = hf.get("layer_types")
    sliding = hf.get("sliding_window")
    if family == "olmo3" and layer_types is None and sliding:
        # transformers' default: every 4th layer is full attention
        layer_types = [
            "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n_layers)
        ]
    if layer_types is not None and "sliding_attention" not in layer_types:
        sliding = None if family != "olmo3" else sliding
    if family == "qwen3" and not hf.get("use_sliding_window", False):
        layer_types, sliding = None, None
    if family == "llama":
        layer_types, sliding = None, None
    kw: dict[str, Any] = {
        "family": family,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_layers": n_layers,
        "num_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(hf.get("max_position_embeddings", 4096)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qk_norm": {"llama": "none", "qwen3": "per_head", "olmo3": "full"}[family],
        "norm_placement": "post" if family == "olmo3" else "pre",
        "sliding_window": int(sliding) if sliding else None,
        "layer_types": tuple(layer_types) if layer_types else None,
        "rope": tuple(sorted(rope.items())),
        "attention_bias": bool(hf.get("attention_bias", False)),
    }
    kw.update(overrides)
    return ModelConfig(**kw)


# ---------------------------------------------------------------------- presets
def smollm2_135m() -> ModelConfig:
    return ModelConfig(
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_embeddings=True,
        rope=(("full_attention", RopeConfig(theta=100000.0)),),
    )


def qwen3_8b() -> ModelConfig:
    return ModelConfig(
        family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=40960, tie_embeddings=False, qk_norm="per_head",
        rope=(("full_attention", RopeConfig(theta=1000000.0)),),
        dtype="bfloat16", param_dtype="bfloat16",
    )


def olmo3_7b() -> ModelConfig:
    n = 32
    return ModelConfig(
        family="olmo3", vocab_size=100278, hidden_size=4096, intermediate_size=11008,
        num_layers=n, num_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=65536, tie_embeddings=False, qk_norm="full",
        norm_placement="post", sliding_window=4096,
        layer_types=tuple(
            "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)
        ),
        rope=(
            ("full_attention", RopeConfig(
                theta=500000.0, rope_type="yarn", factor=8.0,
                original_max_position_embeddings=8192, beta_fast=32.0, beta_slow=1.0,
                attention_factor=1.2079441541679836)),
            ("sliding_attention", RopeConfig(theta=500000.0)),
        ),
        dtype="bfloat16", param_dtype="bfloat16",
    )


def tiny_llama() -> ModelConfig:
    """A 2-layer Llama with SmolLM2's vocabulary, for fast end-to-end tests of the loop."""
    return ModelConfig(
        family="llama", vocab_size=49152, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
        max_position_embeddings=4096, tie_embeddings=True,
        rope=(("full_attention", RopeConfig(theta=100000.0)),),
    )


PRESETS = {
    "smollm2-135m": smollm2_135m, "qwen3-8b": qwen3_8b, "olmo3-7b": olmo3_7b,
    "tiny-llama": tiny_llama,
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]()
