"""LoRA adapters (pmd_jax.models.lora) against transformers + PEFT (torch, CPU, float32).

The reference is PEFT's ``LoraModel`` on the same random small Llama / Qwen2 the parity tests
build (tests/models/test_models_parity.py), with our adapter weights copied into its
``lora_A`` / ``lora_B`` by a converter written here independently of lora.py (ours
``A [in..., r]`` -> ``lora_A.weight [r, in]``, ``B [r, out...]`` -> ``lora_B.weight [out, r]``).
Checked: logits, gradients w.r.t. the adapters, PEFT loading our adapter folder and we loading
PEFT's, zero-B adapters bitwise the base model, merge() and its HF export, the init against
PEFT's, and the refusals.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from pmd_jax.models import decoder, hf_io, lora  # noqa: E402
from pmd_jax.models.lora import LoraConfig, LoraError  # noqa: E402
from pmd_jax.run import sharding as sh  # noqa: E402
from pmd_jax.run.sharding import ShardingRules  # noqa: E402
from tests.host import matmul_tol, need_devices  # noqa: E402
from tests.models.test_models_parity import (  # noqa: E402
    TOL,
    hf_logits,
    left_padded_batch,
    make_hf,
)

jax.config.update("jax_default_matmul_precision", "highest")
# peft 0.21 calls a transformers 5 method that warns about its own deprecation
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

# Logits: TOL is the parity tests' bound vs HF (1e-4 on XLA:CPU). Gradients of a summed
# log-likelihood w.r.t. the adapters: max abs difference relative to the largest gradient
# entry of that tensor (float32 both sides, different summation orders).
GRAD_RTOL = matmul_tol(cpu=1e-4, accelerator=1e-3)

HF_MODULE = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
             "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj"}
CASES = {
    "llama": ("llama", dict(tie_word_embeddings=False), LoraConfig(rank=4, alpha=8.0)),
    # q/k/v biases, tied head, rsLoRA and a subset of targets
    "qwen2_rslora_subset": ("qwen2", dict(tie_word_embeddings=True),
                            LoraConfig(rank=3, alpha=5.0, targets=("q", "v", "o", "down"),
                                       use_rslora=True)),
}


# ----------------------------------------------------------------------------- helpers
def random_adapters(cfg, lc: LoraConfig, seed: int) -> dict:
    """PEFT's init for A, and a non-zero B at a scale where the adapters move the logits."""
    ad = lora.init_adapters(cfg, lc, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    layers = {k: v if k.endswith("_a") else
              jnp.asarray(0.5 * rng.standard_normal(v.shape) / np.sqrt(lc.rank), jnp.float32)
              for k, v in ad["layers"].items()}
    return {"layers": layers}


def to_peft(tree: dict, lc: LoraConfig) -> dict[str, np.ndarray]:
    """Our adapter tree -> PEFT module path -> torch layout: A [L, in..., r] -> [r, in],
    B [L, r, out...] -> [out, r] (head axes flattened head-major)."""
    out = {}
    r = lc.rank
    for t in lc.targets:
        a = np.asarray(tree["layers"][f"{t}_lora_a"], np.float32)
        b = np.asarray(tree["layers"][f"{t}_lora_b"], np.float32)
        for i in range(a.shape[0]):
            pre = f"base_model.model.model.layers.{i}.{HF_MODULE[t]}"
            out[pre + ".lora_A"] = a[i].reshape(-1, r).T
            out[pre + ".lora_B"] = b[i].reshape(r, -1).T
    return out


def peft_lora_config(lc: LoraConfig):
    return peft.LoraConfig(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=0.0,
                           target_modules=[HF_MODULE[t].split(".")[1] for t in lc.targets],
                           use_rslora=lc.use_rslora)


def peft_model_with(kind: str, kw: dict, lc: LoraConfig, adapters: dict):
    """transformers model + PEFT LoRA (get_peft_model), lora weights set from ours."""
    model, _, _ = make_hf(kind, **kw)
    pm = peft.get_peft_model(model, peft_lora_config(lc)).eval()
    with torch.no_grad():
        for name, w in to_peft(adapters, lc).items():
            part = name.rsplit(".", 1)[1]  # lora_A | lora_B
            mod = pm.get_submodule(name.rsplit(".", 1)[0])
            assert mod.scaling["default"] == pytest.approx(lc.scaling)
            getattr(mod, part)["default"].weight.copy_(torch.tensor(w))
    return pm


def our_logits(params, cfg, batch, adapters=None, lc=None) -> np.ndarray:
    tokens, mask, positions = (jnp.asarray(x) for x in batch)
    fn = jax.jit(lambda p, a, t, pos, m: decoder.forward(p, t, pos, cfg, attn_mask=m,
                                                         adapters=a, lora=lc)[0])
    return np.asarray(fn(params, adapters, tokens, positions, mask))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    """The model, random adapters, a left-padded batch, our logits with and without the
    adapters and PEFT's (the model it ran kept for gradients)."""
    kind, kw, lc = CASES[request.param]
    _, cfg, params = make_hf(kind, **kw)
    adapters = random_adapters(cfg, lc, 7)
    batch = left_padded_batch(np.random.default_rng(0), cfg.vocab_size, [12, 9, 4], 12)
    pm = peft_model_with(kind, kw, lc, adapters)
    return dict(name=request.param, kind=kind, kw=kw, lc=lc, cfg=cfg, params=params,
                adapters=adapters, batch=batch, pm=pm, ref=hf_logits(pm, *batch),
                ours=our_logits(params, cfg, batch, adapters, lc),
                base=our_logits(params, cfg, batch), real=batch[1].astype(bool))


# ----------------------------------------------------------------------------- tests
def test_logits_match_peft(case):
    err = np.abs(case["ours"] - case["ref"])[case["real"]].max()
    moved = np.abs(case["ours"] - case["base"])[case["real"]].max()
    assert err < TOL, f"{case['name']}: max abs logit diff vs PEFT {err}"
    assert moved > 0.5, f"the adapters barely change the logits ({moved}): a weak test"


def test_adapter_folders_both_ways(case, tmp_path):
    """Ours -> PeftModel.from_pretrained gives our logits; PEFT's save_pretrained -> ours
    reads back the weights PEFT held; our own save/load round trip is exact."""
    cfg, lc, adapters = case["cfg"], case["lc"], case["adapters"]
    lora.save_peft_adapter(adapters, cfg, lc, tmp_path / "ours", base_model_name_or_path="tiny")
    conf = json.loads((tmp_path / "ours" / lora.ADAPTER_CONFIG).read_text())
    assert conf["peft_type"] == "LORA" and conf["task_type"] == "CAUSAL_LM"
    assert (conf["r"], conf["lora_alpha"], conf["use_rslora"]) == (lc.rank, lc.alpha,
                                                                    lc.use_rslora)
    assert conf["bias"] == "none" and conf["base_model_name_or_path"] == "tiny"
    assert conf["target_modules"] == [HF_MODULE[t].split(".")[1] for t in lc.targets]

    model, _, _ = make_hf(case["kind"], **case["kw"])
    loaded = peft.PeftModel.from_pretrained(model, tmp_path / "ours").eval()
    got = hf_logits(loaded, *case["batch"])
    err = np.abs(got - case["ours"])[case["real"]].max()
    assert err < TOL, f"PEFT loading our folder: max abs logit diff {err}"

    back, lc_back = lora.load_peft_adapter(tmp_path / "ours", cfg)
    assert lc_back == lc
    for k, v in adapters["layers"].items():
        np.testing.assert_array_equal(np.asarray(back["layers"][k]), np.asarray(v), err_msg=k)

    case["pm"].save_pretrained(tmp_path / "peft")
    theirs, lc_theirs = lora.load_peft_adapter(tmp_path / "peft", cfg)
    assert lc_theirs == lc
    for k, v in adapters["layers"].items():
        np.testing.assert_array_equal(np.asarray(theirs["layers"][k]), np.asarray(v), err_msg=k)


def test_adapter_gradients_match_peft(case):
    """d/d(adapters) of the summed next-token log-likelihood on real tokens, vs torch autograd
    through PEFT (base weights frozen on both sides)."""
    cfg, lc, params = case["cfg"], case["lc"], case["params"]
    tokens, mask, positions = case["batch"]
    w = (mask[:, :-1] * mask[:, 1:]).astype(np.float32)  # real context, real target

    def loss(ad):
        lg, _ = decoder.forward(params, jnp.asarray(tokens), jnp.asarray(positions), cfg,
                                attn_mask=jnp.asarray(mask), adapters=ad, lora=lc)
        lp = jax.nn.log_softmax(lg[:, :-1], axis=-1)
        tgt = jnp.take_along_axis(lp, jnp.asarray(tokens[:, 1:])[..., None], -1)[..., 0]
        return jnp.sum(tgt * w)

    ours = to_peft(jax.jit(jax.grad(loss))(case["adapters"]), lc)

    pm = case["pm"]
    pm.zero_grad(set_to_none=True)
    out = pm(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
             position_ids=torch.tensor(positions), use_cache=False)
    lp = torch.log_softmax(out.logits[:, :-1].float(), -1)
    tgt = lp.gather(-1, torch.tensor(tokens[:, 1:])[..., None])[..., 0]
    (tgt * torch.tensor(w)).sum().backward()
    worst = 0.0
    for name, g in ours.items():
        part = name.rsplit(".", 1)[1]
        ref = getattr(pm.get_submodule(name.rsplit(".", 1)[0]), part)["default"].weight.grad
        ref = ref.numpy()
        scale = np.abs(ref).max()
        assert scale > 1e-3, f"{name}: vanishing reference gradient ({scale})"
        rel = np.abs(g - ref).max() / scale
        worst = max(worst, rel)
        assert rel < GRAD_RTOL, f"{name}: gradient differs by {rel:.2e} of its max"
    pm.zero_grad(set_to_none=True)
    print(f"{case['name']}: worst relative gradient difference {worst:.2e}")


def test_zero_b_adapters_are_the_base_model_bitwise():
    """PEFT's init (B = 0): the adapted forward is bitwise the base forward, scanned and
    per-layer, float32 and with bfloat16 matmuls."""
    kind, kw, lc = CASES["llama"]
    _, cfg, params = make_hf(kind, **kw)
    adapters = lora.init_adapters(cfg, lc, jax.random.key(0))
    batch = left_padded_batch(np.random.default_rng(1), cfg.vocab_size, [10, 6], 10)
    for c, p in ((cfg, params), (cfg, decoder.unstack_layers(params)),
                 (cfg.replace(matmul_dtype="bfloat16"), params)):
        np.testing.assert_array_equal(our_logits(p, c, batch, adapters, lc),
                                      our_logits(p, c, batch))


def test_init_matches_peft_default():
    """Shapes, axes and PEFT's default init: A uniform on +-1/sqrt(fan_in) (same spread as
    PEFT's kaiming-uniform lora_A of the same module), B zeros."""
    kind, kw, _ = CASES["llama"]
    lc = LoraConfig(rank=8, alpha=16.0)
    model, cfg, _ = make_hf(kind, **kw)
    L, D, H, KV, hd, F = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                          cfg.head_dim, cfg.intermediate_size)
    r = lc.rank
    assert lora.adapter_shapes(cfg, lc) == {"layers": {
        "q_lora_a": (L, D, r), "q_lora_b": (L, r, H, hd), "k_lora_a": (L, D, r),
        "k_lora_b": (L, r, KV, hd), "v_lora_a": (L, D, r), "v_lora_b": (L, r, KV, hd),
        "o_lora_a": (L, H, hd, r), "o_lora_b": (L, r, D), "gate_lora_a": (L, D, r),
        "gate_lora_b": (L, r, F), "up_lora_a": (L, D, r), "up_lora_b": (L, r, F),
        "down_lora_a": (L, F, r), "down_lora_b": (L, r, D)}}
    axes = lora.adapter_axes(cfg, lc)["layers"]
    assert axes["o_lora_a"] == ("layers", "heads", "head_dim", "lora_rank")
    assert axes["k_lora_b"] == ("layers", "lora_rank", "kv_heads", "head_dim")
    rules = ShardingRules.from_mapping(None)  # lora_rank is known and replicated by default
    assert tuple(rules.spec(axes["q_lora_a"])) == (None, "fsdp", None)

    ad = lora.init_adapters(cfg, lc, jax.random.key(3))
    pm = peft.get_peft_model(model, peft_lora_config(lc))
    for t, fan_in in (("q", D), ("o", H * hd), ("down", F)):
        a = np.asarray(ad["layers"][f"{t}_lora_a"])
        assert not np.asarray(ad["layers"][f"{t}_lora_b"]).any()
        theirs = np.stack([pm.get_submodule(f"base_model.model.model.layers.{i}."
                                            f"{HF_MODULE[t]}").lora_A["default"].weight
                           .detach().numpy() for i in range(L)])
        bound = 1 / np.sqrt(fan_in)
        for x in (a, theirs):
            assert np.abs(x).max() <= bound and np.abs(x).max() > 0.95 * bound, t
        assert a.std() == pytest.approx(theirs.std(), rel=0.1), t
        assert a.std() == pytest.approx(bound / np.sqrt(3), rel=0.1), t


def test_merge_equals_adapters_and_exports_to_transformers(case, tmp_path):
    """merge(): the merged weights' forward is the adapters' forward; saved as a plain HF
    checkpoint, transformers gives PEFT's logits. The per-layer (unstacked) params path with
    stacked adapters is the same function."""
    cfg, lc, params, adapters = case["cfg"], case["lc"], case["params"], case["adapters"]
    merged = lora.merge(params, adapters, cfg, lc)
    for k in params["layers"]:
        changed = not np.array_equal(merged["layers"][k], params["layers"][k])
        assert changed == (k in lc.targets), k
    real = case["real"]
    err = np.abs(our_logits(merged, cfg, case["batch"]) - case["ours"])[real].max()
    assert err < TOL, f"merged forward vs adapters: {err}"
    per_layer = our_logits(decoder.unstack_layers(params), cfg, case["batch"], adapters, lc)
    err = np.abs(per_layer - case["ours"])[real].max()
    assert err < TOL, f"per-layer params with adapters vs stacked: {err}"

    hf_io.save_hf_checkpoint(merged, cfg, tmp_path, dtype="float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    err = np.abs(hf_logits(model, *case["batch"]) - case["ref"])[real].max()
    assert err < TOL, f"merged HF export vs PEFT: {err}"


def test_sharded_adapters_forward_and_grad_match_unsharded():
    """Params and adapters placed on a data x fsdp x tensor mesh by the default rules (the
    rank replicated): the same logits and adapter gradients as on one device."""
    kind, kw, lc = CASES["llama"]
    _, cfg, params = make_hf(kind, **kw, vocab_size=96)  # the vocab splits over tensor
    adapters = random_adapters(cfg, lc, 5)
    tokens, mask, positions = (jnp.asarray(x) for x in left_padded_batch(
        np.random.default_rng(2), cfg.vocab_size, [8, 5, 8, 3], 8))

    def loss(ad, p, ctx=None):
        lg, _ = decoder.forward(p, tokens, positions, cfg, attn_mask=mask, adapters=ad,
                                lora=lc, remat="full", shard_ctx=ctx)
        return jnp.sum(jax.nn.logsumexp(lg, -1) * mask), lg

    ref_grad, ref_lg = jax.jit(jax.grad(loss, has_aux=True))(adapters, params)
    mesh = sh.make_mesh({"data": 1, "fsdp": 2, "tensor": 2}, devices=need_devices(4))
    rules = ShardingRules.from_mapping(None)
    ax = lora.adapter_axes(cfg, lc)
    sp = sh.shard_tree(params, mesh, rules, decoder.param_axes(cfg))
    sa = sh.shard_tree(adapters, mesh, rules, ax)
    assert sa["layers"]["o_lora_a"].sharding.spec == rules.spec(ax["layers"]["o_lora_a"])
    grad, lg = jax.jit(jax.grad(lambda a, p: loss(a, p, (mesh, rules)), has_aux=True),
                       out_shardings=(sh.tree_shardings(mesh, rules, ax), None))(sa, sp)
    real = np.asarray(mask).astype(bool)
    assert np.abs(np.asarray(lg) - np.asarray(ref_lg))[real].max() < TOL
    for k, g in ref_grad["layers"].items():
        scale = np.abs(np.asarray(g)).max()
        assert np.abs(np.asarray(grad["layers"][k]) - np.asarray(g)).max() < GRAD_RTOL * scale, k


def test_lora_config_scaling_and_target_order():
    assert LoraConfig(rank=4, alpha=8).scaling == 2.0  # PEFT: lora_alpha / r
    assert LoraConfig(rank=4, alpha=8, use_rslora=True).scaling == 4.0  # lora_alpha / sqrt(r)
    assert LoraConfig(targets=("v", "q")) == LoraConfig(targets=["q", "v"])
    assert LoraConfig(targets=("v", "q")).targets == ("q", "v")


@pytest.mark.parametrize("kw, field", [
    (dict(rank=0), "rank"), (dict(rank=2.0), "rank"), (dict(rank=True), "rank"),
    (dict(alpha=0.0), "alpha"), (dict(alpha=float("nan")), "alpha"),
    (dict(targets=("q", "qkv")), "targets.*unknown.*qkv"), (dict(targets=()), "targets"),
    (dict(targets=("q", "q")), "targets"), (dict(targets="q"), "targets"),
    (dict(dropout=0.1), "dropout.*not implemented"), (dict(use_rslora="yes"), "use_rslora"),
])
def test_bad_lora_config_names_the_field(kw, field):
    with pytest.raises(LoraError, match=f"LoraConfig.{field}"):
        LoraConfig(**kw)


def test_bad_adapters_name_the_tensor():
    kind, kw, lc = CASES["llama"]
    _, cfg, params = make_hf(kind, **kw)
    good = lora.init_adapters(cfg, lc, jax.random.key(0))
    tok = jnp.zeros((1, 4), jnp.int32)
    pos = jnp.arange(4)[None]

    def with_layers(**change):
        layers = {k: v for k, v in good["layers"].items() if k not in change}
        layers.update({k: v for k, v in change.items() if v is not None})
        return {"layers": layers}

    q_b = good["layers"]["q_lora_b"]
    cases = [
        (with_layers(q_lora_b=q_b[:, :, :1]), r"adapters/layers/q_lora_b has shape"),
        (with_layers(down_lora_a=None), r"adapters/layers is missing .*down_lora_a"),
        (with_layers(bias_lora_a=q_b), r"adapters/layers has unexpected .*bias_lora_a"),
        ({"layers": tuple(range(3))}, "stacked"),
    ]
    for bad, msg in cases:
        with pytest.raises(decoder.ParamError, match=msg):
            decoder.forward(params, tok, pos, cfg, adapters=bad, lora=lc)
    with pytest.raises(decoder.ParamError, match="q_lora_a has shape"):  # rank 4 vs 8
        decoder.check_params(params, cfg, adapters=good, lora=LoraConfig(rank=8))
    with pytest.raises(decoder.ParamError, match="go together"):
        decoder.forward(params, tok, pos, cfg, adapters=good)
    with pytest.raises(decoder.ParamError, match="params/layers/q has shape"):
        lora.merge(dict(params, layers=dict(params["layers"], q=q_b)), good, cfg, lc)
    with pytest.raises(LoraError, match="stacked"):
        lora.merge(decoder.unstack_layers(params), good, cfg, lc)


def test_load_refuses_what_it_cannot_compute(tmp_path):
    kind, kw, lc = CASES["llama"]
    _, cfg, _ = make_hf(kind, **kw)
    ad = lora.init_adapters(cfg, lc, jax.random.key(0))
    d = lora.save_peft_adapter(ad, cfg, lc, tmp_path / "a")
    good = json.loads((d / lora.ADAPTER_CONFIG).read_text())

    def with_config(**change):
        (d / lora.ADAPTER_CONFIG).write_text(json.dumps({**good, **change}))

    for change, msg in [
        (dict(use_dora=True), "use_dora"), (dict(bias="all"), "bias"),
        (dict(peft_type="IA3"), "peft_type"), (dict(target_modules="all-linear"), "target_mod"),
        (dict(target_modules=["q_proj", "lm_head"]), "lm_head"),
        (dict(rank_pattern={"q_proj": 2}), "rank_pattern"), (dict(r=2), "shape"),
        (dict(r=0), "LoraConfig.rank"), (dict(lora_dropout=0.05), "lora_dropout"),
        (dict(target_modules=["q_proj"]), "unexpected tensor"),
    ]:
        with_config(**change)
        with pytest.raises(LoraError, match=msg):
            lora.load_peft_adapter(d, cfg)
    with_config(lora_dropout=0.05)  # dropout only acts in training: loadable for inference
    _, lc2 = lora.load_peft_adapter(d, cfg, ignore_dropout=True)
    assert lc2 == lc
    with_config(target_modules=list(reversed(good["target_modules"])))  # order is free
    assert lora.load_peft_adapter(d, cfg)[1] == lc
    with_config()
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(d / lora.ADAPTER_WEIGHTS))
    tensors.pop("base_model.model.model.layers.2.mlp.up_proj.lora_B.weight")
    save_file(tensors, str(d / lora.ADAPTER_WEIGHTS))
    with pytest.raises(LoraError, match=r"missing tensor.*layers\.2\.mlp\.up_proj\.lora_B"):
        lora.load_peft_adapter(d, cfg)
    with pytest.raises(LoraError, match="not a PEFT adapter folder"):
        lora.load_peft_adapter(tmp_path, cfg)
