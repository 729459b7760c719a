"""Logit parity of pmd_jax.models.decoder with HF transformers (torch, CPU, eager attention)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pmd_jax.models import decoder  # noqa: E402
from pmd_jax.models.config import ConfigError, from_hf_config  # noqa: E402
from tests.host import matmul_tol, smollm2_gguf  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Max abs logit difference, vs HF (torch float32 on CPU) and between two of our forwards. 1e-4
# is for XLA:CPU, whose matmuls are true fp32 (CI's backend; the value kept as measured). On
# gpu/tpu "highest" is fp32 too but reduces in another order, with other exp/rsqrt kernels,
# so the bound depends on the backend: tests/host.py's matmul_tol (an unmeasured 10x there).
TOL = matmul_tol(cpu=1e-4, accelerator=1e-3)


# ----------------------------------------------------------------------------- helpers
def hf_state_to_params(sd: dict, cfg) -> dict:
    """Independent converter (torch state_dict -> our layout), used as the test's reference."""

    def t(name: str) -> np.ndarray:
        return sd[name].detach().to(torch.float32).numpy()

    L, D, H, KV, hd = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    post = cfg.norm_placement == "post"
    layers: dict[str, list] = {}
    for i in range(L):
        pre = f"model.layers.{i}."
        e = {
            "q": t(pre + "self_attn.q_proj.weight").T.reshape(D, H, hd),
            "k": t(pre + "self_attn.k_proj.weight").T.reshape(D, KV, hd),
            "v": t(pre + "self_attn.v_proj.weight").T.reshape(D, KV, hd),
            "o": t(pre + "self_attn.o_proj.weight").T.reshape(H, hd, D),
            "gate": t(pre + "mlp.gate_proj.weight").T,
            "up": t(pre + "mlp.up_proj.weight").T,
            "down": t(pre + "mlp.down_proj.weight").T,
            "attn_norm": t(pre + ("post_attention_layernorm" if post else "input_layernorm")
                           + ".weight"),
            "mlp_norm": t(pre + ("post_feedforward_layernorm" if post
                                 else "post_attention_layernorm") + ".weight"),
        }
        if cfg.qk_norm != "none":
            e["q_norm"] = t(pre + "self_attn.q_norm.weight")
            e["k_norm"] = t(pre + "self_attn.k_norm.weight")
        if cfg.attention_bias or cfg.qkv_bias:
            e["q_bias"] = t(pre + "self_attn.q_proj.bias").reshape(H, hd)
            e["k_bias"] = t(pre + "self_attn.k_proj.bias").reshape(KV, hd)
            e["v_bias"] = t(pre + "self_attn.v_proj.bias").reshape(KV, hd)
        if cfg.attention_bias:
            e["o_bias"] = t(pre + "self_attn.o_proj.bias")
        for name, val in e.items():
            layers.setdefault(name, []).append(val)
    params = {
        "embed": t("model.embed_tokens.weight"),
        "layers": {k: np.stack(v) for k, v in layers.items()},
        "final_norm": t("model.norm.weight"),
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = t("lm_head.weight").T
    return jax.tree.map(jnp.asarray, params)


def randomize_(model, seed: int) -> None:
    """Weights at a scale where mistakes show up in the logits (norm weights != 1 too)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / max(p.shape[-1], 1) ** 0.5)


def hf_logits(model, tokens: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
            use_cache=False,
        )
    return out.logits.float().numpy()


def left_padded_batch(rng, vocab: int, lengths: list[int], T: int):
    B = len(lengths)
    tokens = rng.integers(0, vocab, size=(B, T))
    mask = np.zeros((B, T), np.int64)
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1
    tokens = np.where(mask == 1, tokens, 0)
    positions = np.asarray(decoder.positions_from_mask(jnp.asarray(mask)))
    return tokens, mask, positions


def make_hf(kind: str, **kw):
    common = dict(
        vocab_size=97, hidden_size=64, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        max_position_embeddings=256,
    )
    common.update(kw)
    if kind == "llama":
        hf_cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        hf_cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        hf_cfg = transformers.Qwen3Config(**common)
        cls = transformers.Qwen3ForCausalLM
    elif kind == "olmo3":
        hf_cfg = transformers.Olmo3Config(**common)
        cls = transformers.Olmo3ForCausalLM
    else:
        raise ValueError(kind)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(hf_cfg).eval()
    randomize_(model, 1)
    if getattr(hf_cfg, "tie_word_embeddings", False):
        model.tie_weights()
    cfg = from_hf_config(hf_cfg.to_dict())
    params = hf_state_to_params(model.state_dict(), cfg)
    return model, cfg, params


OLMO_KW = dict(
    num_hidden_layers=4, num_key_value_heads=4, sliding_window=5,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                           "original_max_position_embeddings": 64, "beta_fast": 32.0,
                           "beta_slow": 1.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
    },
)
CASES = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "llama3_rope_tied": ("llama", dict(
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32})),
    "qwen2_untied": ("qwen2", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    # Qwen2 with sliding layers from max_window_layers, and YaRN
    "qwen2_sliding_yarn": ("qwen2", dict(
        use_sliding_window=True, sliding_window=5, max_window_layers=2,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000.0,
                         "original_max_position_embeddings": 64})),
    "qwen3_untied": ("qwen3", dict(head_dim=24, tie_word_embeddings=False)),
    "qwen3_tied": ("qwen3", dict(head_dim=24, tie_word_embeddings=True)),
    "olmo3": ("olmo3", OLMO_KW),
    # cases implemented for issue 14 (anything else is refused at load, see
    # tests/models/test_model_config_support.py): attention biases in every family, linear
    # RoPE, YaRN with mscale / mscale_all_dim, Qwen3 sliding window from use_sliding_window +
    # max_window_layers
    "llama_bias_linear_rope": ("llama", dict(
        tie_word_embeddings=False, attention_bias=True,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0})),
    "qwen3_bias_yarn_mscale_sliding": ("qwen3", dict(
        head_dim=24, attention_bias=True, use_sliding_window=True, sliding_window=5,
        max_window_layers=1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000.0,
                         "original_max_position_embeddings": 64, "mscale": 0.8,
                         "mscale_all_dim": 1.0})),
    "olmo3_bias": ("olmo3", dict(OLMO_KW, attention_bias=True)),
}


def _fwd(params, tokens, positions, cfg, mask):
    fn = jax.jit(lambda p, t, pos, m: decoder.forward(p, t, pos, cfg, attn_mask=m)[0])
    return np.asarray(fn(params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf_with_left_padding(case):
    kind, kw = CASES[case]
    model, cfg, params = make_hf(kind, **kw)
    rng = np.random.default_rng(0)
    tokens, mask, positions = left_padded_batch(rng, cfg.vocab_size, [16, 11, 3], 16)
    ref = hf_logits(model, tokens, mask, positions)
    ours = _fwd(params, tokens, positions, cfg, mask)
    real = mask.astype(bool)
    err = np.abs(ours - ref)[real].max()
    assert err < TOL, f"{case}: max abs logit diff {err}"
    assert np.abs(ref[real]).max() > 0.5  # logits are not trivially small


def test_config_read_from_hf():
    _, cfg, _ = make_hf("olmo3", **OLMO_KW)
    assert cfg.family == "olmo3" and cfg.qk_norm == "full" and cfg.norm_placement == "post"
    assert cfg.layer_types[1] == "full_attention" and cfg.sliding_window == 5
    assert cfg.rope_for("full_attention").rope_type == "yarn"
    assert cfg.rope_for("sliding_attention").rope_type == "default"
    _, qcfg, _ = make_hf("qwen3", head_dim=24, tie_word_embeddings=True)
    assert qcfg.head_dim == 24 and qcfg.tie_embeddings and qcfg.qk_norm == "per_head"


def test_olmo3_sliding_window_matters():
    """The OLMo-3 case really exercises the window: removing it changes the logits."""
    model, cfg, params = make_hf("olmo3", **OLMO_KW)
    rng = np.random.default_rng(1)
    tokens, mask, positions = left_padded_batch(rng, cfg.vocab_size, [16], 16)
    with_window = _fwd(params, tokens, positions, cfg, mask)
    no_window = _fwd(params, tokens, positions, cfg.replace(sliding_window=10_000), mask)
    assert np.abs(with_window - no_window)[:, 6:].max() > 1e-2
    assert np.abs(with_window - no_window)[:, :5].max() < 1e-5  # inside the window: same


@pytest.mark.parametrize("per_layer", [False, True], ids=["stacked", "per_layer"])
@pytest.mark.parametrize("case", ["llama", "qwen3_tied", "olmo3"])
def test_cache_prefill_and_decode_equal_full_forward(case, per_layer):
    kind, kw = CASES[case]
    _, cfg, params = make_hf(kind, **kw)
    rng = np.random.default_rng(2)
    T, P = 14, 6
    tokens, mask, positions = left_padded_batch(rng, cfg.vocab_size, [14, 9], T)
    full = _fwd(params, tokens, positions, cfg, mask)  # stacked scan, checked against HF above
    if per_layer:
        params = decoder.unstack_layers(params)
        # the per-layer loop without a cache is the same function too
        err = np.abs(_fwd(params, tokens, positions, cfg, mask) - full)[mask.astype(bool)].max()
        assert err < TOL

    step = jax.jit(
        lambda p, t, pos, m, c: decoder.forward(p, t, pos, cfg, attn_mask=m, cache=c)
    )
    cache = decoder.init_cache(cfg, batch=2, max_len=20, dtype=jnp.float32, per_layer=per_layer)
    out, cache = step(params, tokens[:, :P], positions[:, :P], mask[:, :P], cache)
    outs = [np.asarray(out)]
    for i in range(P, T):
        out, cache = step(params, tokens[:, i:i + 1], positions[:, i:i + 1], mask[:, i:i + 1],
                          cache)
        outs.append(np.asarray(out))
    cached = np.concatenate(outs, axis=1)
    assert int(cache["index"]) == T
    real = mask.astype(bool)
    err = np.abs(cached - full)[real].max()
    assert err < TOL, f"{case}: cache path differs from full forward by {err}"


def test_layout_mismatch_and_unstack_roundtrip():
    _, cfg, params = make_hf("llama")
    split = decoder.unstack_layers(params)
    assert len(split["layers"]) == cfg.num_layers
    decoder.check_params(split, cfg)
    back = decoder.stack_layers(split)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tok = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="layouts differ"):
        decoder.forward(split, tok, tok, cfg, cache=decoder.init_cache(cfg, 1, 4))
    with pytest.raises(decoder.ParamError, match=r"layers\[1\]/q"):
        bad = dict(split, layers=tuple(
            dict(lp, q=lp["q"][:, :1]) if i == 1 else lp for i, lp in enumerate(split["layers"])))
        decoder.check_params(bad, cfg)


def test_hidden_and_logits_from_hidden_agree():
    _, cfg, params = make_hf("qwen3", head_dim=24, tie_word_embeddings=True)
    tokens = jnp.arange(10)[None] % cfg.vocab_size
    pos = jnp.arange(10)[None]
    logits, _ = decoder.forward(params, tokens, pos, cfg)
    hidden, _ = decoder.forward(params, tokens, pos, cfg, return_hidden=True)
    assert hidden.shape == (1, 10, cfg.hidden_size)
    np.testing.assert_allclose(
        decoder.logits_from_hidden(hidden, params, cfg), logits, atol=1e-5, rtol=1e-5
    )
    np.testing.assert_array_equal(decoder.unembed_matrix(params, cfg), params["embed"].T)


def test_packed_segments_equal_separate_sequences():
    _, cfg, params = make_hf("llama", tie_word_embeddings=False)
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, cfg.vocab_size, 7), rng.integers(0, cfg.vocab_size, 5)
    packed = np.concatenate([a, b])[None]
    seg = np.array([[0] * 7 + [1] * 5])
    pos = np.array([list(range(7)) + list(range(5))])
    out, _ = decoder.forward(params, jnp.asarray(packed), jnp.asarray(pos), cfg,
                             segment_ids=jnp.asarray(seg))
    ra, _ = decoder.forward(params, jnp.asarray(a[None]), jnp.arange(7)[None], cfg)
    rb, _ = decoder.forward(params, jnp.asarray(b[None]), jnp.arange(5)[None], cfg)
    np.testing.assert_allclose(out[0, :7], ra[0], atol=TOL)
    np.testing.assert_allclose(out[0, 7:], rb[0], atol=TOL)


def test_bf16_compute_close_to_fp32():
    _, cfg, params = make_hf("qwen3", head_dim=24, tie_word_embeddings=False)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 12)))
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    ref, _ = decoder.forward(params, tokens, pos, cfg)
    out, _ = decoder.forward(params, tokens, pos, cfg.replace(dtype="bfloat16"))
    assert out.dtype == jnp.float32
    scale = float(jnp.abs(ref).max())
    assert float(jnp.abs(out - ref).max()) < 0.1 * scale


def test_remat_and_grad_match():
    _, cfg, params = make_hf("olmo3", **OLMO_KW)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 12)))
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))

    def loss(p, remat):
        lg, _ = decoder.forward(p, tokens, pos, cfg, remat=remat)
        return jnp.mean(jax.nn.logsumexp(lg, -1))

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g0 = grad(params, "none")
    for pol in ("full", "dots"):
        g1 = grad(params, pol)
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_bad_inputs_name_the_problem():
    _, cfg, params = make_hf("llama", tie_word_embeddings=False)
    tokens = jnp.zeros((1, 4), jnp.int32)
    pos = jnp.arange(4)[None]
    bad = dict(params, layers=dict(params["layers"], q=params["layers"]["q"][:, :, :3]))
    with pytest.raises(decoder.ParamError, match="layers/q"):
        decoder.forward(bad, tokens, pos, cfg)
    missing = dict(params)
    missing.pop("lm_head")
    with pytest.raises(decoder.ParamError, match="lm_head"):
        decoder.forward(missing, tokens, pos, cfg)
    with pytest.raises(ValueError, match="positions"):
        decoder.forward(params, tokens, pos[:, :3], cfg)
    with pytest.raises(ConfigError, match="unknown architecture"):
        from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ConfigError, match="rope_type"):
        decoder.forward(params, tokens, pos, cfg.replace(
            rope=(("full_attention", cfg.rope_for("full_attention").__class__(
                rope_type="dynamic")),)))
    with pytest.raises(ConfigError, match="remat"):
        decoder.forward(params, tokens, pos, cfg, remat="sometimes")


# ----------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2_hf():
    pytest.importorskip("gguf")
    path = smollm2_gguf()  # skipped with the install command when absent
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.fspath(path.parent), gguf_file=path.name, torch_dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(os.fspath(path.parent), gguf_file=path.name)
    return model, tok


@pytest.mark.slow  # loading the GGUF through transformers takes ~2 minutes on 2 cores
def test_smollm2_real_weights_match_hf(smollm2_hf):
    model, tok = smollm2_hf
    cfg = from_hf_config(model.config.to_dict())
    assert cfg.family == "llama" and cfg.num_layers == 30 and cfg.tie_embeddings
    params = hf_state_to_params(model.state_dict(), cfg)
    prompts = [
        "<|im_start|>user\nWhat gas do plants absorb from the air?<|im_end|>\n"
        "<|im_start|>assistant\n",
        "The capital of France is",
        "def fibonacci(n):",
    ]
    ids = [tok(p)["input_ids"] for p in prompts]
    T = max(len(i) for i in ids)
    tokens = np.zeros((len(ids), T), np.int64)
    mask = np.zeros((len(ids), T), np.int64)
    for b, i in enumerate(ids):
        tokens[b, T - len(i):] = i
        mask[b, T - len(i):] = 1
    positions = np.asarray(decoder.positions_from_mask(jnp.asarray(mask)))
    ref = hf_logits(model, tokens, mask, positions)
    ours = _fwd(params, tokens, positions, cfg, mask)
    real = mask.astype(bool)
    err = np.abs(ours - ref)[real].max()
    assert err < TOL, f"SmolLM2 max abs logit diff {err}"
    # the model is real: it predicts " Paris" after "The capital of France is"
    assert tok.decode([int(ours[1, -1].argmax())]).strip() == "Paris"


# config.json of allenai/Olmo-3-7B-Instruct (legacy rope keys; shapes as published)
OLMO3_7B_CONFIG_JSON = {
    "architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "attention_bias": False,
    "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 11008, "max_position_embeddings": 65536, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-06,
    "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1,
                     "factor": 8.0, "original_max_position_embeddings": 8192,
                     "rope_type": "yarn"},
    "rope_theta": 500000, "sliding_window": 4096, "tie_word_embeddings": False,
    "vocab_size": 100278,
}


def test_olmo3_legacy_config_json_read_like_hf_and_equals_preset():
    from pmd_jax.models.config import olmo3_7b

    ours = from_hf_config(dict(OLMO3_7B_CONFIG_JSON))
    hf = transformers.Olmo3Config(**{k: v for k, v in OLMO3_7B_CONFIG_JSON.items()
                                     if k not in ("architectures", "model_type")})
    via_hf = from_hf_config(hf.to_dict())
    assert ours.layer_types == tuple(hf.layer_types) == via_hf.layer_types
    for lt in ("full_attention", "sliding_attention"):
        a, b = ours.rope_for(lt), via_hf.rope_for(lt)
        assert (a.rope_type, a.theta, a.factor) == (b.rope_type, b.theta, b.factor), lt
    assert ours.rope_for("sliding_attention").rope_type == "default"
    preset = olmo3_7b()
    assert ours.replace(dtype=preset.dtype, param_dtype=preset.param_dtype) == preset
    # same RoPE tables as HF's rotary module builds for each layer type
    from pmd_jax.models import rope as rope_lib

    hf_rot = transformers.models.olmo3.modeling_olmo3.Olmo3RotaryEmbedding(hf)
    for lt in ("full_attention", "sliding_attention"):
        inv, scale = rope_lib.inv_freq_and_scaling(ours.rope_for(lt), ours.head_dim,
                                                   ours.max_position_embeddings)
        np.testing.assert_allclose(inv, getattr(hf_rot, f"{lt}_inv_freq").numpy(), rtol=1e-6)
        assert scale == pytest.approx(getattr(hf_rot, f"{lt}_attention_scaling"))
