"""Model configuration for the one decoder that covers Llama, Qwen2, Qwen3 and OLMo-3.

A ``ModelConfig`` is a frozen dataclass (hashable, so it can be a static jit argument).
``from_hf_config`` reads a HF ``config.json`` dict; presets give the full-size models used in
dry runs without any file on disk.

No silently wrong model: ``from_hf_config`` reads a config.json the way transformers' own
config classes (``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config``, ``Olmo3Config``) do, with
their defaults for omitted keys, and raises ``UnsupportedModelConfig`` (a ``ConfigError``, so a
``ValueError``) naming the field, its value and what is supported for anything the decoder
does not compute exactly as transformers would. This happens before any weight is read.
Audit of the fields of the four families that change the math:

* implemented: ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
  ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps``,
  ``vocab_size``, ``tie_word_embeddings``, ``attention_bias`` (q/k/v/o biases, as in Llama, Qwen3
  and OLMo-3; Qwen2 has q/k/v biases by architecture and no such key),
  ``max_position_embeddings``, ``rope_theta``, RoPE types ``default``,
  ``linear``, ``llama3`` and ``yarn`` (with ``attention_factor``, ``beta_fast``/``beta_slow``,
  ``mscale``/``mscale_all_dim``, ``truncate``), legacy ``rope_scaling`` (which wins over
  ``rope_parameters``, as in transformers), OLMo-3's per-layer-type RoPE, ``layer_types`` /
  ``sliding_window`` (OLMo-3; Qwen2/Qwen3 with ``use_sliding_window`` and ``max_window_layers``).
* accepted because they do not change the result: ``pretraining_tp`` (transformers 4 only
  split the same matmuls into slices; transformers 5 ignores it), ``attention_dropout`` (only
  active in HF's training mode; our forward never drops out, and a value > 0 is logged),
  ``use_cache``, ``initializer_range``, token ids, ``torch_dtype``/``dtype`` when it is a
  float type (weights are cast to ``param_dtype``).
* refused: other ``model_type`` values and ``architectures`` that are not the family's
  ``*ForCausalLM`` (a classification head is not a language model), ``hidden_act`` other than
  SiLU (``silu``/``swish``), ``mlp_bias=True``, RoPE types ``dynamic``, ``longrope``,
  ``proportional`` and any other, ``partial_rotary_factor`` != 1, per-layer-type
  ``rope_parameters`` for Llama/Qwen3 (transformers runs one RoPE there), a flat
  ``rope_parameters`` for OLMo-3 (transformers ignores it), sliding layers without a window,
  ``quantization_config``/``compression_config`` (quantized weights), non-float dtypes, and
  configs that transformers versions read differently (OLMo-3 legacy ``rope_theta`` other than
  500000, ``truncate`` inside per-layer-type rope parameters). ``hf_io.check_source`` also
  refuses checkpoint tensors the config does not use (e.g. ``*.bias`` without
  ``attention_bias``), so no weight is ever silently dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Literal

from pmd_jax.models import families as families_lib
from pmd_jax.models.rope_config import RopeConfig

Family = str  # a name registered in pmd_jax.models.families.FAMILIES
LayerType = Literal["full_attention", "sliding_attention"]
FAMILIES: tuple[str, ...] = tuple(families_lib.FAMILIES)
# models.attention_select documents each and the rules of "auto"
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "dense", "chunked", "cudnn", "cudnn_xla", "splash")


class ConfigError(ValueError):
    """A model or run configuration is invalid; the message names the setting."""


class UnsupportedModelConfig(ConfigError):
    """A model config asks for something the decoder does not implement (or cannot implement
    unambiguously). ``field`` and ``value`` name the offending setting; the message also says
    what is supported."""

    def __init__(self, field: str, value: Any, supported: str) -> None:
        self.field = field
        self.value = value
        self.supported = supported
        super().__init__(f"unsupported model config: {field}={value!r}; {supported}")


# RoPE types pmd_jax.models.rope implements exactly like transformers' modeling_rope_utils.
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")


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
    # Biases on the q/k/v projections only, none on o (Qwen2: fixed by the architecture, not
    # a config.json key). ``attention_bias`` implies them too.
    qkv_bias: bool = False
    # Activations / params dtype for compute ("float32" | "bfloat16").
    dtype: str = "float32"
    param_dtype: str = "float32"
    # Operand dtype of the weight matmuls (q/k/v/o, MLP, and the LM head in the distillation
    # loss): None = the activations' dtype; "bfloat16" / "float16" = operands rounded to it,
    # float32 accumulation and result, backward matmuls in it too (see pmd_jax.models.matmul).
    matmul_dtype: str | None = None
    # Attention implementation: "dense" (materialised scores and mask), "chunked" (flash-style
    # in pure JAX, pmd_jax.models.attention), "cudnn" / "cudnn_xla" (jax.nn.dot_product_attention
    # on cuDNN / on XLA), "splash" (Pallas TPU kernel) or "auto" (per backend and call:
    # pmd_jax.models.attention_select; on CPU chunked when T * S > 1024^2, else dense).
    # ``attention_chunk`` is the query and key chunk size of the chunked version.
    attention_impl: str = "auto"
    attention_chunk: int = 512

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ helpers
    def layer_type(self, i: int) -> LayerType:
        return "full_attention" if self.layer_types is None else self.layer_types[i]

    def windows_shorter_than(self, seq_len: int) -> list[int]:
        """The sliding-attention layers whose window is shorter than ``seq_len`` slots."""
        return [i for i in range(self.num_layers) if self.layer_type(i) == "sliding_attention"
                and self.sliding_window and self.sliding_window < seq_len]

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
        if self.qkv_bias:  # (Qwen2: q, k and v projections have biases)
            attn += self.q_size + 2 * self.kv_size
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
        if self.family not in families_lib.FAMILIES:
            raise ConfigError(f"model.family={self.family!r} is not one of "
                              f"{tuple(families_lib.FAMILIES)}")
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
        for lt, r in self.rope:
            if lt not in LAYER_TYPES:
                raise ConfigError(f"model.rope has unknown layer type {lt!r}; known {LAYER_TYPES}")
            if r.rope_type not in ROPE_TYPES:
                raise UnsupportedModelConfig(
                    f"model.rope[{lt}].rope_type", r.rope_type,
                    f"the decoder implements rope_type in {ROPE_TYPES}")
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


# ------------------------------------------------------------------ reading a HF config.json
log = logging.getLogger(__name__)

# The family's HF model_type, transformers class and config defaults: models/families.py.
_SILU_ACTS = ("silu", "swish")  # both are SiLU in transformers' ACT2FN
_FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
_ROPE_WHY = {
    "dynamic": " (dynamic NTK scaling recomputes the frequencies from each batch's length)",
    "longrope": " (LongRoPE switches per-dimension factors with the sequence length)",
}
# keys transformers requires per rope_type (modeling_rope_utils' _validate_*_rope_parameters;
# original_max_position_embeddings defaults to max_position_embeddings there)
_ROPE_REQUIRED = {"linear": ("factor",), "yarn": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def _unsupported(field: str, value: Any, supported: str) -> UnsupportedModelConfig:
    return UnsupportedModelConfig(field, value, supported)


def _num(d: dict[str, Any], key: str, where: str, default: float | None = None) -> float | None:
    v = d.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _unsupported(f"{where}.{key}" if where else key, v, "must be a finite number")
    return float(v)


def _rope_from_hf(d: Any, where: str, max_pos: int, nested: bool) -> RopeConfig:
    """One RoPE parameter dict (transformers 5 ``rope_parameters`` semantics, ``rope_theta``
    already filled in) -> RopeConfig; refuses what ``pmd_jax.models.rope`` does not compute."""
    if not isinstance(d, dict):
        raise _unsupported(where, d, "must be a dict of RoPE parameters")
    rope_type = d["rope_type"] if "rope_type" in d else d.get("type", "default")
    if rope_type not in ROPE_TYPES:
        raise _unsupported(f"{where}.rope_type", rope_type,
                           f"the decoder implements rope_type in {ROPE_TYPES}"
                           f"{_ROPE_WHY.get(str(rope_type), '')}")
    prf = d.get("partial_rotary_factor")
    if prf is not None and prf != 1:
        raise _unsupported(f"{where}.partial_rotary_factor", prf,
                           "the decoder rotates the whole head (partial_rotary_factor=1 only)")
    for key in _ROPE_REQUIRED.get(rope_type, ()):
        if key not in d:
            raise _unsupported(f"{where}.{key}", None,
                               f"rope_type={rope_type!r} requires it (transformers refuses it too)")
    theta = _num(d, "rope_theta", where)
    if theta is None or theta <= 0:
        raise _unsupported(f"{where}.rope_theta", d.get("rope_theta"), "must be a number > 0")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = _num(d, "factor", where)
    orig = d.get("original_max_position_embeddings")
    if orig is not None and (isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0):
        raise _unsupported(f"{where}.original_max_position_embeddings", orig,
                           "must be an integer > 0")
    if rope_type == "linear":
        if factor is None or factor <= 0:
            raise _unsupported(f"{where}.factor", factor, "linear RoPE needs a factor > 0")
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    if rope_type == "llama3":
        low = _num(d, "low_freq_factor", where)
        high = _num(d, "high_freq_factor", where)
        if factor is None or low is None or high is None or high == low:
            raise _unsupported(f"{where}", {k: d.get(k) for k in _ROPE_REQUIRED["llama3"]},
                               "llama3 RoPE needs numbers factor, low_freq_factor and "
                               "high_freq_factor != low_freq_factor")
        return RopeConfig(theta=theta, rope_type="llama3", factor=factor,
                          original_max_position_embeddings=orig,
                          low_freq_factor=low, high_freq_factor=high)
    # yarn, exactly as transformers' _compute_yarn_parameters
    if factor is None:
        factor = max_pos / (orig or max_pos)
    attention_factor = _num(d, "attention_factor", where)
    mscale = _num(d, "mscale", where)
    mscale_all_dim = _num(d, "mscale_all_dim", where)
    if attention_factor is None and mscale and mscale_all_dim:

        def get_mscale(scale: float, m: float) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    truncate = d.get("truncate", True)
    if nested and not truncate:
        # transformers 5 reads `truncate` from the top-level rope_parameters only, so for a
        # per-layer-type RoPE (OLMo-3) it always truncates, while transformers 4 honoured it
        raise _unsupported(f"{where}.truncate", truncate,
                           "transformers 5 ignores truncate in per-layer-type RoPE parameters "
                           "(it always truncates there); remove it or set it to true")
    return RopeConfig(
        theta=theta, rope_type="yarn", factor=factor, original_max_position_embeddings=orig,
        beta_fast=_num(d, "beta_fast", where) or 32.0,
        beta_slow=_num(d, "beta_slow", where) or 1.0,
        attention_factor=attention_factor, truncate=bool(truncate),
    )


def _hf_rope(hf: dict[str, Any], spec: families_lib.FamilySpec,
             max_pos: int) -> dict[str, RopeConfig]:
    """RoPE per layer type, read as transformers 5's config classes read it (rope_scaling wins
    over rope_parameters; the top-level rope_theta fills in a missing one; OLMo-3 nests one dict
    per layer type and applies a legacy rope_scaling to full-attention layers only)."""
    default_theta = spec.hf_defaults["rope_theta"]
    top_theta = hf.get("rope_theta")
    theta = default_theta if top_theta is None else top_theta
    scaling = hf.get("rope_scaling")
    params = hf.get("rope_parameters")
    for key, val in (("rope_scaling", scaling), ("rope_parameters", params)):
        if val is not None and not isinstance(val, dict):
            raise _unsupported(key, val, "must be a dict (or null)")
    if scaling and top_theta is not None and scaling.get("rope_theta", top_theta) != top_theta:
        raise _unsupported("rope_scaling.rope_theta", scaling["rope_theta"],
                           f"it differs from rope_theta={top_theta!r}, and transformers 4 uses "
                           "rope_theta while transformers 5 uses rope_scaling's; make them equal")
    if not spec.rope_per_layer_type:
        rp = dict(scaling or params or {})
        where = "rope_scaling" if scaling else "rope_parameters"
        if rp and any(k in LAYER_TYPES for k in rp):
            raise _unsupported(where, rp, f"{spec.hf_architecture} runs one RoPE for every "
                               "layer: give a flat dict, not one per layer type")
        rp.setdefault("rope_theta", theta)
        rtype = rp.get("rope_type", rp.get("type", "default"))
        if rtype in ("llama3", "yarn") and hf.get("original_max_position_embeddings") is not None:
            # transformers lets a top-level original_max_position_embeddings override the
            # rope dict's (Phi-3 convention) when it builds the model
            rp["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        return {"full_attention": _rope_from_hf(rp, where, max_pos, nested=False)}
    # one RoPE per layer type: OLMo-3 (transformers' Olmo3Config.convert_rope_params_to_dict)
    rp = dict(params or {})
    flat = {k: v for k, v in rp.items() if k not in LAYER_TYPES}
    if flat:
        raise _unsupported("rope_parameters", flat,
                           f"{spec.hf_architecture} takes rope_parameters per layer type "
                           "({'full_attention': {...}, 'sliding_attention': {...}}) or a legacy "
                           "rope_scaling; transformers ignores a flat rope_parameters for OLMo-3")
    out: dict[str, RopeConfig] = {}
    for lt in LAYER_TYPES:
        sub = rp.get(lt)
        if sub is not None and not isinstance(sub, dict):
            raise _unsupported(f"rope_parameters.{lt}", sub, "must be a dict (or null)")
        sub = dict(sub or {"rope_type": "default"})
        if lt == "full_attention" and scaling:
            sub.update(scaling)
        if "rope_theta" not in sub:
            if lt == "sliding_attention" and top_theta is not None and top_theta != default_theta:
                raise _unsupported(
                    "rope_theta", top_theta,
                    "OLMo-3 without rope_parameters['sliding_attention']['rope_theta'] is read "
                    "differently by transformers 4 (rope_theta on all layers) and 5 "
                    f"({default_theta} on sliding layers); give rope_parameters per layer type "
                    "with rope_theta")
            sub["rope_theta"] = theta
        out[lt] = _rope_from_hf(sub, f"rope_parameters.{lt}", max_pos, nested=True)
    return out


def _int_field(hf: dict[str, Any], key: str, default: Any = None) -> int:
    v = hf.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        if v is None:
            raise ConfigError(f"HF config is missing required key {key!r}")
        raise _unsupported(key, v, "must be an integer > 0")
    return v


def _check_hf_fields(hf: dict[str, Any], spec: families_lib.FamilySpec) -> None:
    """Refuse the config.json fields whose value the decoder does not compute (see the module
    docstring for the audit)."""
    causal, model_type = spec.hf_architecture, spec.name
    archs = hf.get("architectures")
    if archs and list(archs) != [causal]:
        raise _unsupported("architectures", archs,
                           f"a model_type={model_type!r} checkpoint is loaded as [{causal!r}]; "
                           "other heads (classification, reward, ...) are not a causal LM")
    for key in ("quantization_config", "compression_config"):
        q = hf.get(key)
        if q:
            method = q.get("quant_method", q) if isinstance(q, dict) else q
            if str(getattr(method, "value", method)).lower() == "gguf":
                # transformers' GGUF loader de-quantizes to float on load and notes the origin
                # here; our GGUF reader does the same, and check_source refuses stored ints
                continue
            raise _unsupported(key, method, "quantized checkpoints are not supported; use "
                               f"unquantized weights in one of {_FLOAT_DTYPES}")
    for key in ("dtype", "torch_dtype"):
        dt = hf.get(key)
        if dt is not None and str(dt).removeprefix("torch.") not in _FLOAT_DTYPES + ("auto",):
            raise _unsupported(key, dt, f"weights must be one of {_FLOAT_DTYPES}")
    act = hf.get("hidden_act", "silu")
    if act not in _SILU_ACTS:
        raise _unsupported("hidden_act", act,
                           f"the decoder's MLP is SwiGLU: hidden_act in {_SILU_ACTS}")
    if hf.get("mlp_bias"):
        raise _unsupported("mlp_bias", hf.get("mlp_bias"),
                           "the decoder's MLP has no biases (mlp_bias=false)")
    ab = hf.get("attention_bias", False)
    if not isinstance(ab, bool):
        raise _unsupported("attention_bias", ab, "must be true or false")
    prf = hf.get("partial_rotary_factor")
    if prf is not None and prf != 1:
        raise _unsupported("partial_rotary_factor", prf,
                           "the decoder rotates the whole head (partial_rotary_factor=1 only)")
    drop = hf.get("attention_dropout", 0.0)
    if isinstance(drop, (int, float)) and drop > 0:
        log.warning("HF config attention_dropout=%s is ignored: the decoder never applies "
                    "dropout (transformers applies it only in training mode)", drop)


def _hf_layer_types(hf: dict[str, Any], spec: families_lib.FamilySpec,
                    n_layers: int) -> tuple[list[str] | None, int | None]:
    """(layer_types, sliding_window) as the family's HF config class reads them."""
    if spec.read_layer_types is None:
        return None, None
    layer_types, sliding = spec.read_layer_types(hf, n_layers, spec.hf_defaults)
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != n_layers:
        raise _unsupported("layer_types", layer_types,
                           f"must list one of {LAYER_TYPES} per layer ({n_layers})")
    bad = sorted({str(t) for t in layer_types} - set(LAYER_TYPES))
    if bad:
        raise _unsupported("layer_types", bad, f"the decoder implements {LAYER_TYPES}")
    if "sliding_attention" in layer_types:
        if sliding is None:
            raise _unsupported(
                "sliding_window", None,
                "layer_types has sliding_attention layers, which need a sliding_window"
                + spec.sliding_hint)
    elif spec.drop_unused_window:
        return None, None
    if sliding is not None:
        sliding = _int_field({"sliding_window": sliding}, "sliding_window")
    return list(layer_types), sliding


def from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """Build a ModelConfig from a HF ``config.json`` dict (transformers 4.x or 5.x keys).

    Reads it as transformers' config class for its model_type would (same defaults), and
    raises ``UnsupportedModelConfig`` naming the field for anything the decoder does not
    implement, so that no checkpoint is ever run with math other than transformers'.
    """
    model_type = hf.get("model_type")
    if model_type not in families_lib.FAMILIES:
        raise _unsupported("model_type", model_type,
                           f"unknown architecture {model_type!r} "
                           f"(architectures={hf.get('architectures')!r}); "
                           f"supported model_type values: {sorted(families_lib.FAMILIES)}")
    spec = families_lib.FAMILIES[model_type]
    family = spec.name
    defaults = spec.hf_defaults
    _check_hf_fields(hf, spec)
    hidden = _int_field(hf, "hidden_size")
    heads = _int_field(hf, "num_attention_heads")
    n_layers = _int_field(hf, "num_hidden_layers")
    vocab = _int_field(hf, "vocab_size")
    inter = _int_field(hf, "intermediate_size")
    hd = hf.get("head_dim", defaults["head_dim"])  # omitted: transformers' default
    if hd is None:
        if spec.needs_head_dim:
            raise _unsupported("head_dim", None,
                               f"{spec.hf_architecture} needs an integer head_dim")
        if hidden % heads:
            raise _unsupported("hidden_size", hidden, "without head_dim it must be a multiple "
                               f"of num_attention_heads={heads}")
        head_dim = hidden // heads
    else:
        head_dim = _int_field({"head_dim": hd}, "head_dim")
    kv = hf.get("num_key_value_heads", defaults["num_key_value_heads"])
    kv_heads = heads if kv is None else _int_field({"num_key_value_heads": kv},
                                                   "num_key_value_heads")
    max_pos = _int_field(hf, "max_position_embeddings", defaults["max_position_embeddings"])
    eps = _num(hf, "rms_norm_eps", "", defaults["rms_norm_eps"])
    rope = _hf_rope(hf, spec, max_pos)
    layer_types, sliding = _hf_layer_types(hf, spec, n_layers)
    kw: dict[str, Any] = {
        "family": family,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_layers": n_layers,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(eps if eps is not None else defaults["rms_norm_eps"]),
        "max_position_embeddings": max_pos,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qk_norm": spec.qk_norm,
        "norm_placement": spec.norm_placement,
        "sliding_window": sliding,
        "layer_types": tuple(layer_types) if layer_types else None,
        "rope": tuple(sorted(rope.items())),
        # Qwen2Config has no attention_bias key (its q/k/v biases are the architecture's)
        "attention_bias": bool(hf.get("attention_bias", False)) and not spec.qkv_bias,
        "qkv_bias": spec.qkv_bias,
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
