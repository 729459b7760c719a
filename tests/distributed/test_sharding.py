"""Params are really sharded per the logical-axis rules; sharded forward == unsharded forward."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.models import decoder
from pmd_jax.models.config import ModelConfig, RopeConfig
from pmd_jax.run import sharding as sh
from tests.host import need_devices

pytestmark = pytest.mark.devices(8)  # every mesh below has 8 devices (tests/host.py)
jax.config.update("jax_default_matmul_precision", "highest")
# Random OLMo-3 (post-norm: each sublayer output is RMS-normalised, which amplifies rounding
# noise) is ill-conditioned: the *unsharded* fp32 logits already differ from a float64 run by
# ~1.2e-4. A sharded run only reorders fp32 reductions, so it must agree to a few times that;
# a real sharding bug moves logits by O(0.1).
ATOL = 1e-3


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(
        family="olmo3", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, qk_norm="full",
        norm_placement="post", sliding_window=4,
        layer_types=("sliding_attention", "full_attention") * 2,
        rope=(("full_attention", RopeConfig(theta=1e4, rope_type="yarn", factor=2.0,
                                            original_max_position_embeddings=32)),
              ("sliding_attention", RopeConfig(theta=1e4))),
    )
    base.update(kw)
    return ModelConfig(**base)


MESHES = [
    {"data": 2, "fsdp": 4, "tensor": 1},
    {"data": 1, "fsdp": 4, "tensor": 2},
    {"data": 2, "fsdp": 2, "tensor": 2},
]


def _mesh(shape):
    __tracebackhide__ = True  # a skip for too few devices is reported at the test's line
    return sh.make_mesh(shape, devices=need_devices(math.prod(shape.values())))


def _expected_shard_shape(shape, axes, rules, mesh):
    out = []
    for size, part in zip(shape, rules.spec(axes) + (None,) * (len(shape) - len(axes))):
        if part is None:
            out.append(size)
        else:
            parts = (part,) if isinstance(part, str) else part
            out.append(size // math.prod(mesh.shape[p] for p in parts))
    return tuple(out)


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_cfg()
    params = decoder.init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda x: x * 5.0 if x.ndim > 1 else x, params)  # sharper logits
    rng = np.random.default_rng(0)
    B, T = 8, 12
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)))
    mask = np.ones((B, T), np.int32)
    mask[1, :5] = 0
    mask[6, :2] = 0
    mask = jnp.asarray(mask)
    positions = decoder.positions_from_mask(mask)
    ref, _ = jax.jit(lambda p: decoder.forward(p, tokens, positions, cfg, attn_mask=mask))(params)
    return cfg, params, tokens, positions, mask, np.asarray(ref)


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_params_sharded_per_rules_and_forward_matches(setup, shape):
    cfg, params, tokens, positions, mask, ref = setup
    mesh = _mesh(shape)
    rules = sh.ShardingRules.from_mapping(None)
    axes = decoder.param_axes(cfg)
    sharded = sh.shard_tree(params, mesh, rules, axes)

    flat_axes = jax.tree.leaves(axes, is_leaf=sh._is_axes_leaf)
    flat = jax.tree.leaves(sharded)
    assert len(flat) == len(flat_axes)
    n_split = 0
    for arr, ax in zip(flat, flat_axes):
        assert arr.sharding.spec == rules.spec(ax)
        want = _expected_shard_shape(arr.shape, ax, rules, mesh)
        shard_shapes = {s.data.shape for s in arr.addressable_shards}
        assert shard_shapes == {want}, (ax, arr.shape, shard_shapes)
        n_split += want != arr.shape
    if max(shape.values()) > 1:
        assert n_split > 0
    # e.g. q [L, D, H, hd]: embed over fsdp, heads over tensor
    q = sharded["layers"]["q"]
    assert q.addressable_shards[0].data.shape == (
        cfg.num_layers, cfg.hidden_size // shape["fsdp"], cfg.num_heads // shape["tensor"],
        cfg.head_dim,
    )

    batch_sharding = sh.named_sharding(mesh, rules, ("batch", "seq"))
    tok, pos, m = (jax.device_put(x, batch_sharding) for x in (tokens, positions, mask))

    @jax.jit
    def fwd(p, t, ps, mm):
        return decoder.forward(p, t, ps, cfg, attn_mask=mm, shard_ctx=(mesh, rules))[0]

    out = fwd(sharded, tok, pos, m)
    np.testing.assert_allclose(np.asarray(out), ref, atol=ATOL, rtol=0)


def test_sharded_grad_matches_unsharded(setup):
    cfg, params, tokens, positions, mask, _ = setup

    def loss(p, t, ps, mm, ctx=None):
        lg, _ = decoder.forward(p, t, ps, cfg, attn_mask=mm, remat="full", shard_ctx=ctx)
        logp = jax.nn.log_softmax(lg[:, :-1])
        nll = -jnp.take_along_axis(logp, t[:, 1:, None], -1)[..., 0]
        w = mm[:, 1:] * mm[:, :-1]  # a real token predicting a real token
        return jnp.sum(nll * w) / jnp.sum(w)

    ref = jax.jit(jax.grad(loss))(params, tokens, positions, mask)
    mesh = _mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sh.ShardingRules.from_mapping(None)
    sp = sh.shard_tree(params, mesh, rules, decoder.param_axes(cfg))
    bs = sh.named_sharding(mesh, rules, ("batch", "seq"))
    p_shard = sh.tree_shardings(mesh, rules, decoder.param_axes(cfg))
    g = jax.jit(jax.grad(lambda p, *a: loss(p, *a, ctx=(mesh, rules))), out_shardings=p_shard)(
        sp, *(jax.device_put(x, bs) for x in (tokens, positions, mask))
    )
    for a, b, ax in zip(jax.tree.leaves(g), jax.tree.leaves(ref),
                        jax.tree.leaves(decoder.param_axes(cfg), is_leaf=sh._is_axes_leaf)):
        assert a.sharding.spec == rules.spec(ax)
        # same conditioning caveat as ATOL: measure the error against the leaf's scale (a
        # missing all-reduce or a wrong shard would be off by O(100%))
        err = float(np.abs(np.asarray(a) - np.asarray(b)).max())
        assert err <= 1e-2 * float(np.abs(np.asarray(b)).max()) + 1e-7, (ax, err)


def test_kv_cache_sharded_decode_matches(setup):
    cfg, params, tokens, positions, mask, ref = setup
    mesh = _mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sh.ShardingRules.from_mapping(None)
    sp = sh.shard_tree(params, mesh, rules, decoder.param_axes(cfg))
    cache = decoder.init_cache(cfg, tokens.shape[0], 16, jnp.float32)
    cache = sh.shard_tree(cache, mesh, rules, decoder.cache_axes(cfg))
    assert cache["k"].sharding.spec == rules.spec(decoder.cache_axes(cfg)["k"])
    step = jax.jit(lambda p, t, ps, mm, c: decoder.forward(p, t, ps, cfg, attn_mask=mm, cache=c))
    out, cache = step(sp, tokens[:, :8], positions[:, :8], mask[:, :8], cache)
    outs = [out]
    for i in range(8, tokens.shape[1]):
        out, cache = step(sp, tokens[:, i:i + 1], positions[:, i:i + 1], mask[:, i:i + 1], cache)
        outs.append(out)
    got = np.concatenate([np.asarray(o) for o in outs], axis=1)
    real = np.asarray(mask).astype(bool)
    np.testing.assert_allclose(got[real], ref[real], atol=ATOL, rtol=0)


def test_config_that_cannot_shard_names_the_tensor():
    cfg = tiny_cfg(num_heads=9, num_kv_heads=3, hidden_size=72, qk_norm="per_head",
                   norm_placement="pre", family="llama", layer_types=None, sliding_window=None,
                   rope=(("full_attention", RopeConfig()),))
    mesh = _mesh({"data": 1, "fsdp": 4, "tensor": 2})
    rules = sh.ShardingRules.from_mapping(None)
    with pytest.raises(sh.ShardingError, match=r"\['layers'\]\['(q|k|v|o)'\].*heads"):
        sh.check_divisible(mesh, rules, decoder.param_shapes(cfg), decoder.param_axes(cfg))


def test_custom_rules_are_followed():
    cfg = tiny_cfg()
    mesh = _mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sh.ShardingRules.from_mapping({"embed": None, "mlp": ("fsdp", "tensor")})
    sp = sh.shard_tree(decoder.init_params(cfg, jax.random.key(1)), mesh, rules,
                       decoder.param_axes(cfg))
    gate = sp["layers"]["gate"]
    assert gate.addressable_shards[0].data.shape == (cfg.num_layers, cfg.hidden_size,
                                                     cfg.intermediate_size // 4)
    with pytest.raises(sh.ShardingError, match="unknown logical axis"):
        sh.ShardingRules.from_mapping({"hidden": "fsdp"})
