"""HF safetensors <-> pytree: round trip through transformers, sharded loading, bad input."""

import json

import jax
import numpy as np
import pytest

from pmd_jax.models import hf_io
from pmd_jax.models.config import ConfigError, ModelConfig, RopeConfig, from_hf_config
from pmd_jax.models.decoder import param_shapes
from pmd_jax.run.sharding import ShardingRules, make_mesh
from tests.host import need_devices

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def tiny(family: str, **kw) -> ModelConfig:
    base = dict(
        family=family, vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=128,
    )
    if family == "qwen3":
        base.update(qk_norm="per_head", rope=(("full_attention", RopeConfig(theta=1e6)),))
    if family == "qwen2":
        base.update(qkv_bias=True, rope=(("full_attention", RopeConfig(theta=1e6)),))
    if family == "olmo3":
        base.update(
            qk_norm="full", norm_placement="post", sliding_window=8,
            layer_types=("sliding_attention", "sliding_attention", "sliding_attention",
                         "full_attention"),
            rope=(
                ("full_attention", RopeConfig(theta=5e5, rope_type="yarn", factor=4.0,
                                              original_max_position_embeddings=32,
                                              attention_factor=1.1)),
                ("sliding_attention", RopeConfig(theta=5e5)),
            ),
        )
    base.update(kw)
    return ModelConfig(**base)


def random_params(cfg: ModelConfig, seed: int = 0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: rng.standard_normal(s.shape).astype(np.float32), param_shapes(cfg)
    )


CASES = {
    "llama_tied": tiny("llama", tie_embeddings=True),
    "llama_bias": tiny("llama", attention_bias=True),
    "qwen2_untied": tiny("qwen2"),
    "qwen2_tied": tiny("qwen2", tie_embeddings=True),
    "qwen3_untied": tiny("qwen3"),
    "qwen3_tied": tiny("qwen3", tie_embeddings=True),
    "olmo3": tiny("olmo3"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_roundtrip_through_transformers(case, tmp_path):
    cfg = CASES[case]
    params = random_params(cfg)
    hf_io.save_hf_checkpoint(params, cfg, tmp_path, dtype="float32", max_shard_bytes=200_000)
    assert (tmp_path / hf_io.SAFE_INDEX).exists()  # small shard size forces a sharded save

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(model).__name__ == hf_io.HF_ARCHITECTURES[cfg.family][0]
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    ours = dict(hf_io.iter_hf_tensors(params, cfg))
    expect_keys = set(sd) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    assert set(ours) == expect_keys
    for k, v in ours.items():
        np.testing.assert_array_equal(sd[k], v, err_msg=k)
    if cfg.tie_embeddings:
        np.testing.assert_array_equal(sd["lm_head.weight"], params["embed"])

    # The HF config transformers parsed describes the same model as ours.
    back_cfg = from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert back_cfg == cfg
    hc = model.config
    assert hc.tie_word_embeddings == cfg.tie_embeddings
    if cfg.family == "olmo3":
        assert list(hc.layer_types) == list(cfg.layer_types)
        assert hc.sliding_window == cfg.sliding_window
        assert hc.rope_parameters["full_attention"]["rope_type"] == "yarn"
        assert hc.rope_parameters["full_attention"]["factor"] == 4.0
        assert hc.rope_parameters["sliding_attention"]["rope_type"] == "default"

    # And our loader gives back exactly what we saved.
    cfg2, loaded = hf_io.load_hf_checkpoint(tmp_path)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, loaded), params)


@pytest.mark.parametrize("case", ["qwen3_untied", "olmo3"])
def test_layout_matches_hf_projections(case, tmp_path):
    """Our leaves mean what HF's modules compute: x @ ours == HF Linear(x) (reference: torch)."""
    cfg = CASES[case]
    params = random_params(cfg, seed=1)
    hf_io.save_hf_checkpoint(params, cfg, tmp_path, dtype="float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, cfg.hidden_size)).astype(np.float32)
    h = rng.standard_normal((3, cfg.num_heads, cfg.head_dim)).astype(np.float32)
    f = rng.standard_normal((3, cfg.intermediate_size)).astype(np.float32)
    L = params["layers"]
    for i in (0, cfg.num_layers - 1):
        att = model.model.layers[i].self_attn
        mlp = model.model.layers[i].mlp
        with torch.no_grad():
            t = torch.from_numpy
            q = att.q_proj(t(x)).numpy().reshape(3, cfg.num_heads, cfg.head_dim)
            k = att.k_proj(t(x)).numpy().reshape(3, cfg.num_kv_heads, cfg.head_dim)
            o = att.o_proj(t(h.reshape(3, -1))).numpy()
            g, u = mlp.gate_proj(t(x)).numpy(), mlp.up_proj(t(x)).numpy()
            d = mlp.down_proj(t(f)).numpy()
            lm = model.lm_head(t(x)).numpy()
        np.testing.assert_allclose(np.einsum("bd,dhk->bhk", x, L["q"][i]), q, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.einsum("bd,dhk->bhk", x, L["k"][i]), k, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(np.einsum("bhk,hkd->bd", h, L["o"][i]), o, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(x @ L["gate"][i], g, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(x @ L["up"][i], u, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(f @ L["down"][i], d, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(x @ params["lm_head"], lm, rtol=1e-5, atol=1e-4)
        layer = model.model.layers[i]
        if cfg.family == "olmo3":
            np.testing.assert_array_equal(
                layer.post_attention_layernorm.weight.detach().numpy(), L["attn_norm"][i])
            np.testing.assert_array_equal(
                layer.post_feedforward_layernorm.weight.detach().numpy(), L["mlp_norm"][i])
        else:
            np.testing.assert_array_equal(
                layer.input_layernorm.weight.detach().numpy(), L["attn_norm"][i])
            np.testing.assert_array_equal(
                layer.post_attention_layernorm.weight.detach().numpy(), L["mlp_norm"][i])
        np.testing.assert_array_equal(att.q_norm.weight.detach().numpy(), L["q_norm"][i])


@pytest.mark.parametrize("save_dtype", ["bfloat16", "float16", "float32"])
def test_sharded_load_reads_only_each_devices_slice(save_dtype, tmp_path, monkeypatch):
    devices = need_devices(8)
    cfg = tiny("qwen3", num_heads=4, num_kv_heads=2, vocab_size=256)
    params = random_params(cfg, seed=3)
    hf_io.save_hf_checkpoint(params, cfg, tmp_path, dtype=save_dtype, max_shard_bytes=100_000)
    _, full = hf_io.load_hf_checkpoint(tmp_path, dtype="float32")  # plain full load
    want = jax.tree.map(lambda p: np.asarray(p.astype(save_dtype).astype(np.float32)), params)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, full), want)

    reads: list[tuple[str, tuple[slice, ...], tuple[int, ...]]] = []
    real = hf_io.read_slice

    def spy(src, name, index):
        out = real(src, name, index)
        reads.append((name, index, out.shape))
        return out

    monkeypatch.setattr(hf_io, "read_slice", spy)
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2}, devices=devices)
    rules = ShardingRules.from_mapping(None)
    _, sharded = hf_io.load_hf_checkpoint(tmp_path, mesh=mesh, rules=rules, dtype="float32")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 sharded, full)

    axes = hf_io.param_axes(cfg)
    for m in hf_io.tensor_maps(cfg):
        arr = hf_io._get(sharded, m.path)
        spec = rules.spec(hf_io._get(axes, m.path))
        assert arr.sharding.spec == spec, m.path
        shard_shape = arr.sharding.shard_shape(arr.shape)
        per_layer = int(np.prod(shard_shape[1:] if m.stacked else shard_shape))
        mine = [r for r in reads if r[0] in set(m.hf_names())]
        # Each device reads its shard, one layer at a time: every read is exactly one
        # per-layer shard, and all reads together are one shard per device.
        assert mine, m.path
        for name, _, shape in mine:
            assert int(np.prod(shape)) == per_layer, (name, shape, shard_shape)
        # JAX may call the callback once per distinct shard (replicas share a read).
        per_dev = shard_shape[0] if m.stacked else 1
        idx_map = arr.sharding.devices_indices_map(arr.shape)
        distinct = {tuple((s.start, s.stop) for s in ix) for ix in idx_map.values()}
        assert len(distinct) * per_dev <= len(mine) <= 8 * per_dev, (m.path, len(mine))
        if any(s is not None for s in spec):  # sharded leaf: nobody read a whole tensor
            assert per_layer < int(np.prod(m.hf_shape))


def _rewrite_without(path, drop: str | None = None, reshape: str | None = None):
    from safetensors.numpy import load_file, save_file

    f = path / hf_io.SAFE_SINGLE
    t = load_file(str(f))
    if drop:
        del t[drop]
    if reshape:
        t[reshape] = t[reshape][:-1]
    save_file(t, str(f), metadata={"format": "pt"})


def test_bad_checkpoints_name_the_tensor(tmp_path):
    cfg = tiny("llama")
    params = random_params(cfg)
    hf_io.save_hf_checkpoint(params, cfg, tmp_path / "a", dtype="float32")
    _rewrite_without(tmp_path / "a", drop="model.layers.2.mlp.up_proj.weight")
    with pytest.raises(hf_io.CheckpointError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        hf_io.load_hf_checkpoint(tmp_path / "a")

    hf_io.save_hf_checkpoint(params, cfg, tmp_path / "b", dtype="float32")
    _rewrite_without(tmp_path / "b", reshape="model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(hf_io.CheckpointError, match=r"k_proj\.weight.*\(31, 64\).*\(32, 64\)"):
        hf_io.load_hf_checkpoint(tmp_path / "b")

    hf_io.save_hf_checkpoint(params, cfg, tmp_path / "c", dtype="float32")
    hc = json.loads((tmp_path / "c" / "config.json").read_text())
    hc["model_type"], hc["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (tmp_path / "c" / "config.json").write_text(json.dumps(hc))
    with pytest.raises(ConfigError, match="unknown architecture.*gpt2"):
        hf_io.load_hf_checkpoint(tmp_path / "c")

    hf_io.save_hf_checkpoint(params, cfg, tmp_path / "d", dtype="float32")
    (tmp_path / "d" / hf_io.SAFE_SINGLE).write_bytes(b"\xff" * 64)
    with pytest.raises(hf_io.CheckpointError, match="cannot open as safetensors"):
        hf_io.load_hf_checkpoint(tmp_path / "d")

    hf_io.save_hf_checkpoint(params, cfg, tmp_path / "e", dtype="float32", max_shard_bytes=50_000)
    (tmp_path / "e" / hf_io.SAFE_INDEX).write_text("{not json")
    with pytest.raises(hf_io.CheckpointError, match="not a valid safetensors index"):
        hf_io.load_hf_checkpoint(tmp_path / "e")
    hf_io.save_hf_checkpoint(params, cfg, tmp_path / "f", dtype="float32", max_shard_bytes=50_000)
    next((tmp_path / "f").glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(hf_io.CheckpointError, match="shard file model-00002.*missing"):
        hf_io.load_hf_checkpoint(tmp_path / "f")

    with pytest.raises(hf_io.CheckpointError, match="no config.json"):
        hf_io.load_hf_checkpoint(tmp_path / "missing")


def test_unshardable_mesh_names_the_tensor(tmp_path):
    cfg = tiny("llama", num_kv_heads=1, num_heads=3, head_dim=16, hidden_size=48)
    params = random_params(cfg)
    hf_io.save_hf_checkpoint(params, cfg, tmp_path, dtype="float32")
    mesh = make_mesh({"data": 1, "fsdp": 4, "tensor": 2}, devices=need_devices(8))
    with pytest.raises(ValueError, match="layers.*q|heads"):
        hf_io.load_hf_checkpoint(tmp_path, mesh=mesh)


def _hf_model(cfg: ModelConfig):
    """A randomly initialised transformers model for our config (HF's own init and config)."""
    hc = transformers.AutoConfig.for_model(**hf_io.to_hf_config(cfg, dtype="float32"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hc)
    with torch.no_grad():  # make norms distinguishable from their init value 1
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p))
    return model


@pytest.mark.parametrize("case", ["qwen2_untied", "qwen3_untied", "olmo3", "llama_tied"])
@pytest.mark.parametrize("torch_dtype", ["float32", "bfloat16"])
def test_loads_checkpoints_written_by_transformers(case, torch_dtype, tmp_path):
    cfg = CASES[case]
    model = _hf_model(cfg).to(getattr(torch, torch_dtype))
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / hf_io.SAFE_INDEX).exists()
    cfg2, params = hf_io.load_hf_checkpoint(tmp_path, dtype="float32")
    assert cfg2 == cfg
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    ours = dict(hf_io.iter_hf_tensors(params, cfg))
    for k, v in ours.items():
        np.testing.assert_array_equal(v, sd[k], err_msg=k)
    assert set(sd) - set(ours) <= {"lm_head.weight"}


def test_sharded_load_olmo3_full_qk_norm(tmp_path):
    cfg = CASES["olmo3"]
    params = random_params(cfg, seed=5)
    hf_io.save_hf_checkpoint(params, cfg, tmp_path, dtype="bfloat16")
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, devices=need_devices(8))
    _, sharded = hf_io.load_hf_checkpoint(tmp_path, mesh=mesh, dtype="bfloat16")
    want = jax.tree.map(lambda p: np.asarray(p.astype(jax.numpy.bfloat16)), params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), sharded, want)
    qn = sharded["layers"]["q_norm"]
    assert qn.sharding.spec[1] == "tensor" and qn.sharding.shard_shape(qn.shape)[1] == 32


def _configs_for_roundtrip():
    from pmd_jax.models import config as C

    llama3 = ModelConfig(
        family="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8,
        rope=(("full_attention", RopeConfig(theta=5e5, rope_type="llama3", factor=8.0,
                                            original_max_position_embeddings=64)),),
    )
    qwen_sliding = tiny("qwen3", sliding_window=16, layer_types=(
        "full_attention", "full_attention", "sliding_attention", "sliding_attention"))
    qwen2_sliding = tiny("qwen2", sliding_window=16, layer_types=(
        "full_attention", "sliding_attention", "sliding_attention", "sliding_attention"))
    return {"llama3_rope": llama3, "qwen3_sliding": qwen_sliding, "qwen2_sliding": qwen2_sliding,
            **{name: fn() for name, fn in C.PRESETS.items()}}


@pytest.mark.parametrize("name", sorted(_configs_for_roundtrip()))
def test_hf_config_roundtrip_through_transformers(name):
    cfg = _configs_for_roundtrip()[name].replace(dtype="float32", param_dtype="float32")
    d = hf_io.to_hf_config(cfg)
    hc = transformers.AutoConfig.for_model(**d)
    assert from_hf_config(hc.to_dict()) == cfg
    assert from_hf_config(d) == cfg


def test_slice_reads_match_full_transform_for_any_index():
    """Reading a slice of our layout == transforming the full HF tensor, then slicing (numpy),
    including slices inside merged dims (head_dim) and empty ranges."""
    cfg = tiny("olmo3", attention_bias=True)
    rng = np.random.default_rng(7)
    tensors = {}
    for m in hf_io.tensor_maps(cfg):
        for n in m.hf_names():
            tensors[n] = rng.standard_normal(m.hf_shape).astype(np.float32)
    src = hf_io.ArraySource(tensors)
    for m in hf_io.tensor_maps(cfg):
        full = np.stack([m.from_hf(tensors[n]) for n in m.hf_names()]) if m.stacked else \
            m.from_hf(tensors[m.hf_name])
        for _ in range(6):
            idx = []
            for n in m.shape:
                a = int(rng.integers(0, n))
                b = int(rng.integers(a, n + 1))
                idx.append(slice(a, b))
            got = hf_io._read_leaf(src, m, tuple(idx), np.dtype(np.float32))
            np.testing.assert_array_equal(got, full[tuple(idx)], err_msg=str((m.path, idx)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_declaration_per_weight(name):
    """weights.declare is the one list: the param tree, axes, init and HF map all come from it,
    each HF layout round-trips, and the GGUF names cover every llama tensor once."""
    from pmd_jax.models import decoder, families, weights

    cfg = CASES[name]
    decl = weights.declare(cfg)
    assert tuple(hf_io.tensor_maps(cfg)) == decl
    paths = [w.path for w in decl]
    assert len(set(paths)) == len(paths)
    shapes = jax.tree.map(lambda s: s.shape, param_shapes(cfg))
    axes = decoder.param_axes(cfg)
    for w in decl:
        assert hf_io._get(shapes, w.path) == w.shape
        assert hf_io._get(axes, w.path) == w.axes
        ours = np.arange(int(np.prod(w.layer_shape)), dtype=np.float32).reshape(w.layer_shape)
        hf = w.to_hf(ours)
        assert hf.shape == w.hf_shape
        np.testing.assert_array_equal(w.from_hf(hf), ours)
    params = decoder.init_params(cfg, jax.random.PRNGKey(0))
    for w in decl:
        leaf = np.asarray(hf_io._get(params, w.path))
        if w.init == "ones":
            assert (leaf == 1).all(), w.path
        elif w.init == "zeros":
            assert (leaf == 0).all(), w.path
        else:
            assert 0.01 < leaf.std() < 0.03, w.path
    assert families.FAMILIES[cfg.family].hf_architecture == hf_io.HF_ARCHITECTURES[cfg.family][0]
    if cfg.family in ("llama", "qwen2") and not cfg.attention_bias:
        g = weights.gguf_names(cfg)
        hf_names = {n for w in decl for n in w.hf_names()}
        assert {hf for hf, _ in g.values()} == hf_names
        assert g["blk.1.attn_q.weight"][0] == "model.layers.1.self_attn.q_proj.weight"
        assert g["blk.0.attn_k.weight"][1].gguf_permute == "num_kv_heads"
