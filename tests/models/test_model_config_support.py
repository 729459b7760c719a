"""No silently wrong model: configs the decoder does not implement are refused at load (before any
weight is read), naming the field and value; what is accepted reads like transformers reads it.

Refusals use real checkpoints written by transformers' ``save_pretrained`` (tiny random weights),
edited where transformers itself would not write the config. Accepted configs are checked
against transformers' own config classes and rotary modules (RoPE tables, per-layer windows,
defaults); logit parity of the implemented cases is in tests/models/test_models_parity.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pmd_jax.models import gguf_io, hf_io  # noqa: E402
from pmd_jax.models import rope as rope_lib  # noqa: E402
from pmd_jax.models.config import (  # noqa: E402
    ConfigError,
    ModelConfig,
    RopeConfig,
    UnsupportedModelConfig,
    from_hf_config,
)

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=80, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CONFIG_CLS = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "olmo3": "Olmo3Config"}
CAUSAL = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "olmo3": "Olmo3ForCausalLM"}


def save_tiny(path: Path, kind: str, arch: str | None = None,
              edit: Callable[[dict[str, Any]], None] | None = None, **kw: Any) -> Path:
    """A tiny random checkpoint written by transformers (config.json edited by ``edit``)."""
    cfg = getattr(transformers, CONFIG_CLS[kind])(**{**TINY, **kw})
    torch.manual_seed(0)
    model = getattr(transformers, arch or CAUSAL[kind])(cfg)
    model.save_pretrained(path)
    if edit is not None:
        f = path / "config.json"
        d = json.loads(f.read_text())
        edit(d)
        f.write_text(json.dumps(d))
    return path


def _set(**kv: Any) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        for k, v in kv.items():
            if v is _DROP:
                d.pop(k, None)
            else:
                d[k] = v
    return edit


_DROP = object()
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

# name: (family, transformers kwargs, config.json edit, architecture, refused field, value)
REFUSED: dict[str, tuple] = {
    "llama_mlp_bias": ("llama", dict(mlp_bias=True), None, None, "mlp_bias", True),
    "qwen3_mlp_bias_key": ("qwen3", {}, _set(mlp_bias=True), None, "mlp_bias", True),
    "llama_gelu": ("llama", dict(hidden_act="gelu_pytorch_tanh"), None, None,
                   "hidden_act", "gelu_pytorch_tanh"),
    "qwen3_relu": ("qwen3", dict(hidden_act="relu", head_dim=16), None, None, "hidden_act", "relu"),
    "olmo3_gelu": ("olmo3", dict(hidden_act="gelu"), None, None, "hidden_act", "gelu"),
    "llama_dynamic_rope": ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
                           None, None, "rope_parameters.rope_type", "dynamic"),
    "llama_legacy_dynamic_rope_scaling": (
        "llama", {}, _set(rope_scaling={"type": "dynamic", "factor": 2.0}), None,
        "rope_scaling.rope_type", "dynamic"),
    "llama_longrope": ("llama", dict(rope_parameters={
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 64, "factor": 4.0}), None, None,
        "rope_parameters.rope_type", "longrope"),
    "qwen3_dynamic_rope": ("qwen3", dict(head_dim=16, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0}), None, None, "rope_parameters.rope_type",
        "dynamic"),
    "olmo3_dynamic_full_rope": ("olmo3", dict(rope_parameters={
        "full_attention": {"rope_type": "dynamic", "factor": 2.0},
        "sliding_attention": {"rope_type": "default"}}), None, None,
        "rope_parameters.full_attention.rope_type", "dynamic"),
    "qwen3_partial_rotary": ("qwen3", dict(head_dim=16, rope_parameters={
        "rope_type": "default", "partial_rotary_factor": 0.5}), None, None,
        "rope_parameters.partial_rotary_factor", 0.5),
    "llama_partial_rotary_top_level": ("llama", {}, _set(partial_rotary_factor=0.25), None,
                                       "partial_rotary_factor", 0.25),
    "llama_linear_without_factor": ("llama", {}, _set(rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0}), None, "rope_parameters.factor", None),
    "llama_nested_rope": ("llama", {}, _set(rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0}}), None, "rope_parameters",
        {"full_attention": {"rope_type": "linear", "factor": 2.0}}),
    "olmo3_flat_rope_parameters": ("olmo3", {}, _set(rope_parameters=dict(_YARN)), None,
                                   "rope_parameters", _YARN),
    "olmo3_legacy_theta_ambiguous": ("olmo3", {}, _set(rope_parameters=_DROP, rope_theta=5000.0),
                                     None, "rope_theta", 5000.0),
    "olmo3_nested_yarn_truncate_false": ("olmo3", dict(rope_parameters={
        "full_attention": {**_YARN, "truncate": False},
        "sliding_attention": {"rope_type": "default"}}), None, None,
        "rope_parameters.full_attention.truncate", False),
    "olmo3_legacy_yarn_truncate_false": ("olmo3", {}, _set(rope_parameters=_DROP, rope_scaling={
        **_YARN, "truncate": False}), None, "rope_parameters.full_attention.truncate", False),
    "llama_rope_scaling_theta_disagrees": ("llama", {}, _set(rope_theta=1e4, rope_scaling={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 5e4}), None,
        "rope_scaling.rope_theta", 5e4),
    "qwen3_sliding_layers_without_window": (
        "qwen3", dict(head_dim=16), _set(use_sliding_window=False, layer_types=[
            "full_attention", "sliding_attention", "full_attention", "sliding_attention"]),
        None, "sliding_window", None),
    "olmo3_sliding_window_null": ("olmo3", {}, _set(sliding_window=None), None,
                                  "sliding_window", None),
    "llama_sequence_classification": ("llama", dict(tie_word_embeddings=True), None,
                                      "LlamaForSequenceClassification", "architectures",
                                      ["LlamaForSequenceClassification"]),
    "llama_quantized": ("llama", {}, _set(quantization_config={"quant_method": "fp8"}), None,
                        "quantization_config", "fp8"),
    "llama_fp8_dtype": ("llama", {}, _set(dtype="float8_e4m3fn"), None, "dtype",
                        "float8_e4m3fn"),
    "gpt2": ("llama", {}, _set(model_type="gpt2", architectures=["GPT2LMHeadModel"]), None,
             "model_type", "gpt2"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_config_refused_at_load_before_weights(name, tmp_path, monkeypatch):
    family, kw, edit, arch, field, value = REFUSED[name]
    path = save_tiny(tmp_path, family, arch, edit, **kw)

    def no_weights(*a: Any, **k: Any) -> None:
        raise AssertionError("weights were opened before the config was refused")

    monkeypatch.setattr(hf_io, "SafetensorsSource", no_weights)
    with pytest.raises(UnsupportedModelConfig) as ei:
        hf_io.load_hf_checkpoint(path)
    err = ei.value
    assert isinstance(err, ConfigError) and isinstance(err, ValueError)
    assert (err.field, err.value) == (field, value), str(err)
    msg = str(err)
    assert f"{field}={value!r}" in msg, msg
    assert "supported" in msg or "implements" in msg or "requires" in msg or "must" in msg, msg


def test_weights_the_config_does_not_use_are_refused(tmp_path):
    # a real checkpoint with MLP biases whose config.json was edited to claim it has none
    p = save_tiny(tmp_path / "mlp", "llama", edit=_set(mlp_bias=False), mlp_bias=True)
    with pytest.raises(hf_io.CheckpointError,
                       match=r"MLP biases.*'model\.layers\.0\.mlp\.down_proj\.bias'"):
        hf_io.load_hf_checkpoint(p)
    # attention biases in a checkpoint whose config says attention_bias=false
    p = save_tiny(tmp_path / "attn", "qwen3", edit=_set(attention_bias=False), head_dim=16,
                  attention_bias=True)
    with pytest.raises(hf_io.CheckpointError,
                       match=r"attention_bias=false.*'model\.layers\.0\.self_attn\.k_proj\.bias'"):
        hf_io.load_hf_checkpoint(p)
    # QK-norm weights in a Llama checkpoint (e.g. a mislabelled Qwen3)
    p = save_tiny(tmp_path / "qk", "qwen3", edit=_set(model_type="llama",
                                                      architectures=["LlamaForCausalLM"]),
                  head_dim=16)
    with pytest.raises(hf_io.CheckpointError, match=r"norm weights.*q_norm"):
        hf_io.load_hf_checkpoint(p)


def _rewrite(path: Path, fn: Callable[[dict[str, np.ndarray]], None]) -> None:
    from safetensors.numpy import load_file, save_file

    f = path / hf_io.SAFE_SINGLE
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f), metadata={"format": "pt"})


def test_tied_head_integer_weights_and_inv_freq_buffers(tmp_path):
    p = save_tiny(tmp_path / "tied", "llama", tie_word_embeddings=True)
    embed = "model.embed_tokens.weight"
    # an lm_head equal to the embedding is harmless; an old rotary buffer is ignored like HF
    _rewrite(p, lambda t: t.update({
        "lm_head.weight": t[embed].copy(),
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    cfg, params = hf_io.load_hf_checkpoint(p)
    assert cfg.tie_embeddings and "lm_head" not in params
    # a different one: transformers 4 ties, transformers 5 unties -> refused
    _rewrite(p, lambda t: t.update({"lm_head.weight": t[embed] + 1.0}))
    with pytest.raises(hf_io.CheckpointError, match="tie_word_embeddings=true.*differs"):
        hf_io.load_hf_checkpoint(p)

    p = save_tiny(tmp_path / "int8", "llama")
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(p, lambda t: t.update({name: t[name].astype(np.int8)}))
    with pytest.raises(hf_io.CheckpointError, match=r"up_proj\.weight.*stored as I8"):
        hf_io.load_hf_checkpoint(p)


def test_model_config_refuses_unimplemented_rope_type():
    with pytest.raises(UnsupportedModelConfig, match=r"rope_type.*'dynamic'"):
        ModelConfig(family="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                    rope=(("full_attention", RopeConfig(rope_type="dynamic", factor=2.0)),))


# --------------------------------------------------------------- accepted: read like transformers
def _minimal(model_type: str, **kw: Any) -> dict[str, Any]:
    """A hand-written config.json: only the shapes, everything else omitted unless given."""
    d = {"model_type": model_type, "architectures": [CAUSAL[model_type]], "vocab_size": 97,
         "hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 4,
         "num_attention_heads": 4}
    d.update(kw)
    return {k: v for k, v in d.items() if v is not _DROP}


ACCEPTED: dict[str, dict[str, Any]] = {
    "llama_defaults": _minimal("llama"),
    "llama_linear": _minimal("llama", rope_parameters={"rope_type": "linear", "factor": 2.5,
                                                      "rope_theta": 5e4}),
    "llama_legacy_linear_type_key": _minimal("llama", rope_theta=3e4,
                                             rope_scaling={"type": "linear", "factor": 2.0}),
    "llama_rope_scaling_wins": _minimal("llama", rope_theta=3e4,
                                        rope_scaling={"rope_type": "linear", "factor": 4.0},
                                        rope_parameters={"rope_type": "default",
                                                         "rope_theta": 7.0}),
    "llama_llama3": _minimal("llama", max_position_embeddings=512, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama_yarn_mscale": _minimal("llama", rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}),
    "llama_yarn_no_truncate": _minimal("llama", rope_parameters={
        "rope_type": "yarn", "factor": 3.0, "truncate": False}),
    "llama_yarn_top_level_original_max": _minimal(
        "llama", original_max_position_embeddings=4096, max_position_embeddings=8192,
        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 64}),
    "llama_head_dim_kv_pretraining_tp": _minimal("llama", head_dim=32, num_key_value_heads=2,
                                                 pretraining_tp=2, attention_bias=True,
                                                 rms_norm_eps=1e-5, torch_dtype="bfloat16"),
    "qwen3_defaults": _minimal("qwen3", num_attention_heads=32),  # kv default 32
    "qwen3_yarn": _minimal("qwen3", head_dim=16, num_key_value_heads=2, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen3_sliding_from_max_window_layers": _minimal(
        "qwen3", head_dim=16, num_key_value_heads=2, use_sliding_window=True, sliding_window=7,
        max_window_layers=1),
    "qwen3_sliding_default_window": _minimal("qwen3", head_dim=16, num_key_value_heads=2,
                                             use_sliding_window=True),
    "qwen3_window_without_use_flag": _minimal("qwen3", head_dim=16, num_key_value_heads=2,
                                              sliding_window=7),
    "olmo3_defaults": _minimal("olmo3", num_hidden_layers=8),
    "olmo3_legacy_yarn": _minimal("olmo3", rope_theta=500000, sliding_window=5,
                                  rope_scaling={**_YARN, "attention_factor": 1.2}),
    "olmo3_nested_and_legacy": _minimal("olmo3", rope_theta=1e4, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e4},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 2e4}},
        rope_scaling=_YARN),
    "olmo3_layer_types": _minimal("olmo3", sliding_window=3, layer_types=[
        "full_attention", "sliding_attention", "full_attention", "sliding_attention"]),
}


def _hf_rope_tables(hf: Any, model_type: str) -> dict[str, tuple[np.ndarray, float]]:
    mod = getattr(transformers.models, model_type)
    rot_cls = getattr(getattr(mod, f"modeling_{model_type}"),
                      {"llama": "LlamaRotaryEmbedding", "qwen3": "Qwen3RotaryEmbedding",
                       "olmo3": "Olmo3RotaryEmbedding"}[model_type])
    rot = rot_cls(config=hf)
    if model_type == "olmo3":
        return {lt: (getattr(rot, f"{lt}_inv_freq").numpy(),
                     float(getattr(rot, f"{lt}_attention_scaling")))
                for lt in ("full_attention", "sliding_attention")}
    table = (rot.inv_freq.numpy(), float(rot.attention_scaling))
    return {"full_attention": table, "sliding_attention": table}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_configs_read_like_transformers(name):
    d = ACCEPTED[name]
    ours = from_hf_config(json.loads(json.dumps(d)))
    hf = transformers.CONFIG_MAPPING[d["model_type"]].from_dict(json.loads(json.dumps(d)))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (ours.head_dim, ours.num_kv_heads) == (head_dim, hf.num_key_value_heads)
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.attention_bias == hf.attention_bias
    assert ours.tie_embeddings == hf.tie_word_embeddings
    # per-layer attention window, as the HF attention modules set it
    hf_types = getattr(hf, "layer_types", None) or ["full_attention"] * ours.num_layers
    hf_windows = [hf.sliding_window if t == "sliding_attention" else None for t in hf_types]
    windows = [ours.sliding_window if ours.layer_type(i) == "sliding_attention" else None
               for i in range(ours.num_layers)]
    assert windows == hf_windows
    # RoPE tables of every layer type, against transformers' rotary module
    hf_tables = _hf_rope_tables(hf, d["model_type"])
    for i in range(ours.num_layers):
        lt = ours.layer_type(i)
        inv, scale = rope_lib.inv_freq_and_scaling(ours.rope_for(lt), ours.head_dim,
                                                   ours.max_position_embeddings)
        hf_inv, hf_scale = hf_tables[hf_types[i]]
        np.testing.assert_allclose(inv, hf_inv, rtol=1e-6, err_msg=f"{name} layer {i} ({lt})")
        assert scale == pytest.approx(hf_scale, rel=1e-6), (name, lt)


def test_hf_defaults_for_omitted_keys():
    """Omitted keys take transformers' class defaults, not one guess for every family."""
    q = from_hf_config(_minimal("qwen3", num_attention_heads=32))
    assert (q.head_dim, q.num_kv_heads, q.max_position_embeddings) == (128, 32, 32768)
    o = from_hf_config(_minimal("olmo3"))
    assert o.rms_norm_eps == 1e-5 and o.rope_for("full_attention").theta == 500000.0
    assert o.sliding_window == 4096 and o.layer_types == (
        "sliding_attention", "sliding_attention", "sliding_attention", "full_attention")
    ll = from_hf_config(_minimal("llama"))
    assert (ll.head_dim, ll.num_kv_heads, ll.max_position_embeddings) == (16, 4, 2048)
    assert ll.layer_types is None and ll.sliding_window is None


def test_attention_dropout_is_accepted_and_logged(caplog):
    with caplog.at_level("WARNING", logger="pmd_jax.models.config"):
        cfg = from_hf_config(_minimal("llama", attention_dropout=0.1))
    assert cfg == from_hf_config(_minimal("llama"))
    assert "attention_dropout=0.1 is ignored" in caplog.text


# ----------------------------------------------------------------------------------- GGUF
def test_gguf_metadata_and_tensors_we_do_not_run_are_refused():
    meta = {"general.architecture": "llama", "llama.attention.head_count": 4,
            "llama.embedding_length": 64, "llama.feed_forward_length": 80,
            "llama.block_count": 2, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "llama.vocab_size": 97, "llama.rope.dimension_count": 16}
    assert gguf_io.config_from_gguf(meta, set()).head_dim == 16
    for key, val, match in (("rope.dimension_count", 8, "partial rotary"),
                            ("expert_count", 8, "mixture-of-experts"),
                            ("attention.value_length", 32, "value heads")):
        with pytest.raises(gguf_io.GGUFError, match=rf"llama\.{key}=8|llama\.{key}=32"):
            gguf_io.config_from_gguf({**meta, f"llama.{key}": val}, set())
        with pytest.raises(gguf_io.GGUFError, match=match):
            gguf_io.config_from_gguf({**meta, f"llama.{key}": val}, set())

    class FakeTensor:
        name = "blk.0.attn_q.bias"

    class FakeReader:
        tensors = [FakeTensor()]

    cfg = gguf_io.config_from_gguf(meta, set())
    with pytest.raises(gguf_io.GGUFError, match=r"blk\.0\.attn_q\.bias"):
        gguf_io.hf_tensors_from_gguf(FakeReader(), cfg)
