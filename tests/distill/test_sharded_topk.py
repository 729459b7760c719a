"""Top-K over a tensor-sharded vocabulary (``distill.sharded_topk``) on 8 fake CPU devices.

Reference: ``lax.top_k`` on the same (unsharded) array, and the chunked loss with the default
top-K. The memory check compares XLA's own temp-buffer figure for the two versions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from pmd_jax.distill import losses
from pmd_jax.distill.sharded_topk import dense_topk_indices, make_topk_indices
from pmd_jax.run import sharding as shd
from tests.distill.reference_losses import chunked_distill_loss
from tests.host import need_devices

MESHES = [
    {"data": 1, "fsdp": 4, "tensor": 2},
    {"data": 2, "fsdp": 1, "tensor": 4},
    {"data": 1, "fsdp": 1, "tensor": 8},
    {"data": 2, "fsdp": 4, "tensor": 1},
]


def _mesh(shape):
    """Every mesh here has 8 devices: skipped, naming the count found, with fewer."""
    __tracebackhide__ = True
    return shd.make_mesh(shape, devices=need_devices(8))


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s.values())))
@pytest.mark.parametrize("k", [1, 64, 200])
def test_equals_lax_top_k(shape, k):
    mesh = _mesh(shape)
    fn = jax.jit(make_topk_indices(mesh, shd.ShardingRules.from_mapping()), static_argnums=1)
    x = jax.random.normal(jax.random.key(k), (8, 3, 1000))
    got = np.asarray(fn(x, k))
    want = np.asarray(dense_topk_indices(x, k))
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int32


@pytest.mark.parametrize("shape", MESHES[:3], ids=lambda s: "x".join(map(str, s.values())))
def test_ties_pick_the_same_indices(shape):
    """Many exact ties (small integers): the lower index wins, as in lax.top_k."""
    mesh = _mesh(shape)
    fn = make_topk_indices(mesh, shd.ShardingRules.from_mapping())
    x = jax.random.randint(jax.random.key(1), (8, 4, 512), 0, 4).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(fn(x, 37)), np.asarray(dense_topk_indices(x, 37)))


def test_shapes_that_do_not_divide_fall_back():
    mesh = _mesh({"data": 1, "fsdp": 4, "tensor": 2})
    fn = make_topk_indices(mesh, shd.ShardingRules.from_mapping())
    for shape in [(6, 2, 100), (8, 2, 101), (3, 17)]:
        x = jax.random.normal(jax.random.key(0), shape)
        np.testing.assert_array_equal(np.asarray(fn(x, 9)), np.asarray(dense_topk_indices(x, 9)))


def test_chunked_loss_and_grads_equal_default_top_k():
    """The sharded index function inside the chunked JSD loss (scan + remat + grad)."""
    mesh = _mesh({"data": 1, "fsdp": 4, "tensor": 2})
    rules = shd.ShardingRules.from_mapping()
    cfg = losses.DistillLossConfig(alpha=0.5, topk=20, add_tail=True)
    r = np.random.default_rng(0)
    b, t, d, v = 8, 10, 16, 256
    hs = jnp.asarray(r.normal(size=(b, t, d)), jnp.float32)
    ht = jnp.asarray(r.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(r.normal(size=(d, v)) * 0.3, jnp.float32)
    wt = jnp.asarray(r.normal(size=(d, v)) * 0.3, jnp.float32)
    tok = jnp.asarray(r.integers(0, v, (b, t)), jnp.int32)
    mask = jnp.asarray(r.random((b, t)) < 0.8, jnp.float32)

    def loss(w, hs, fn):
        out, _, _ = chunked_distill_loss(hs, ht, w, wt, tok, mask, None, cfg, chunk=4,
                                         topk_indices=fn)
        return out

    want, g_want = jax.value_and_grad(loss, argnums=(0, 1))(w, hs, None)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    hs_s = put(hs, rules.spec(("batch", "seq", "embed")))
    w_s = put(w, rules.spec(("embed", "vocab")))
    fn = make_topk_indices(mesh, rules)
    got, g_got = jax.jit(jax.value_and_grad(lambda w, h: loss(w, h, fn), argnums=(0, 1)))(
        w_s, hs_s)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for a, e in zip(g_got, g_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-4, atol=1e-6)


def test_no_full_vocab_all_gather_and_less_temp_memory():
    """Compiled on the mesh, the dense lax.top_k replicates the [B, C, V] operand; ours
    gathers only K candidates per vocab shard."""
    mesh = _mesh({"data": 1, "fsdp": 4, "tensor": 2})
    rules = shd.ShardingRules.from_mapping()
    b, c, v, k = 8, 64, 32768, 100
    x = jax.ShapeDtypeStruct((b, c, v), jnp.float32,
                             sharding=NamedSharding(mesh, rules.spec(("batch", None, "vocab"))))
    out = NamedSharding(mesh, PartitionSpec(rules.spec(("batch",))[0], None, None))
    ours = jax.jit(lambda a: make_topk_indices(mesh, rules)(a, k), out_shardings=out)
    dense = jax.jit(lambda a: dense_topk_indices(a, k), out_shardings=out)
    c_ours = ours.lower(x).compile()
    c_dense = dense.lower(x).compile()
    local_bytes = b * c * v * 4 // 8
    assert c_ours.memory_analysis().temp_size_in_bytes < local_bytes
    assert c_dense.memory_analysis().temp_size_in_bytes > 2 * local_bytes
    hlo = c_ours.as_text()
    for line in hlo.splitlines():
        if "all-gather(" in line:
            assert f",{v}]" not in line.split("all-gather(")[0], line
