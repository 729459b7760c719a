"""Low-precision weight matmuls (``matmul_dtype``): forward and custom VJP against a numpy
formula on the rounded operands, the lowered program really runs its dots in bf16, and the
train step with ``precision.matmul_dtype="bfloat16"`` stays close to the float32 step,
unsharded and on 8 fake devices."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pmd_jax.distill import step as st
from pmd_jax.distill.config import DistillConfigError
from pmd_jax.models import decoder
from pmd_jax.models.config import ConfigError
from pmd_jax.models.matmul import lowp_einsum
from pmd_jax.run import sharding as shd
from tests.distill.test_step import TINY, _batch, _cfg, _params, _with_teacher
from tests.host import need_devices

SPECS = [  # the decoder's projections, the MLP, and the LM head (plain and vocab-major)
    ("btd,dhk->bthk", (3, 5, 16), (16, 2, 8)),
    ("bthk,hkd->btd", (3, 5, 2, 8), (2, 8, 16)),
    ("btf,fd->btd", (3, 5, 32), (32, 16)),
    ("...d,dv->...v", (3, 5, 16), (16, 48)),
    ("...d,vd->...v", (2, 3, 5, 16), (48, 16)),
]


def _round(x: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(x, np.float32).astype(dtype).astype(np.float64)


@pytest.mark.parametrize(("spec", "xs", "ws"), SPECS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_forward_and_vjp_equal_the_rounded_formula(spec, xs, ws, dtype):
    r = np.random.default_rng(0)
    x = r.standard_normal(xs).astype(np.float32)
    w = (0.2 * r.standard_normal(ws)).astype(np.float32)
    np_dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    y, vjp = jax.vjp(lambda a, b: lowp_einsum(spec, a, b, dtype), jnp.asarray(x), jnp.asarray(w))
    assert y.dtype == jnp.float32
    xr, wr = _round(x, np_dt), _round(w, np_dt)
    np.testing.assert_allclose(np.asarray(y), np.einsum(spec, xr, wr), rtol=1e-5, atol=1e-5)
    g = r.standard_normal(y.shape).astype(np.float32)
    dx, dw = vjp(jnp.asarray(g))
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
    gr = _round(g, np_dt)
    # the direct formula: gradients of sum(g * einsum(x, w)) from the rounded g, x and w
    lhs, out = spec.split("->")
    a, b = lhs.split(",")
    if "..." in a:
        ell = "ZYX"[: x.ndim - (len(a) - 3)]
        a, out = a.replace("...", ell), out.replace("...", ell)
    np.testing.assert_allclose(np.asarray(dx), np.einsum(f"{out},{b}->{a}", gr, wr),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), np.einsum(f"{a},{out}->{b}", xr, gr),
                               rtol=1e-5, atol=1e-4)
    # and it really is low precision: the float32 gradient differs at the rounding's scale
    _, vjp32 = jax.vjp(lambda a_, b_: jnp.einsum(spec, a_, b_), jnp.asarray(x), jnp.asarray(w))
    dx32, _ = vjp32(jnp.asarray(g))
    rel = np.linalg.norm(np.asarray(dx) - np.asarray(dx32)) / np.linalg.norm(np.asarray(dx32))
    assert 1e-5 < rel < 3e-2, rel


def test_all_three_matmuls_lower_with_low_precision_operands():
    """The speed property, checked on the lowered program (backend-independent): the forward
    and both gradient dots take bf16 operands and give float32 results."""
    x = jnp.ones((4, 8, 16), jnp.float32)
    w = jnp.ones((16, 32), jnp.float32)
    f = jax.grad(lambda a, b: jnp.sum(jnp.sin(lowp_einsum("btd,df->btf", a, b, "bfloat16"))),
                 argnums=(0, 1))
    text = jax.jit(f).lower(x, w).as_text()
    dots = [ln for ln in text.splitlines() if "stablehlo.dot_general" in ln]
    assert len(dots) == 3, dots
    for ln in dots:
        types = re.findall(r"tensor<[0-9x]*x(\w+)>", ln.split(":")[-1])
        assert types[:2] == ["bf16", "bf16"] and types[-1] == "f32", ln


def test_bad_dtypes_are_named():
    with pytest.raises(ValueError, match="int8"):
        lowp_einsum("ab,bc->ac", jnp.ones((2, 2)), jnp.ones((2, 2)), "int8")
    with pytest.raises(ConfigError, match="matmul_dtype"):
        TINY.replace(matmul_dtype="float64")
    with pytest.raises(DistillConfigError, match="precision.matmul_dtype"):
        st.TrainStep(TINY, _cfg(precision__matmul_dtype="int8"))


def test_decoder_logits_close_to_float32():
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, TINY.vocab_size, (2, 7)))
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    p = _params(0)
    ref, _ = decoder.forward(p, tokens, pos, TINY)
    low, _ = decoder.forward(p, tokens, pos, TINY.replace(matmul_dtype="bfloat16"))
    rel = float(jnp.linalg.norm(low - ref) / jnp.linalg.norm(ref))
    assert 1e-5 < rel < 2e-2, rel


def test_step_with_bf16_matmuls_tracks_float32_and_shards(mesh_8):
    batch = _batch()
    ref_step = st.TrainStep(TINY, _cfg())
    s_ref, m_ref = ref_step.step(_with_teacher(ref_step.init(_params(0), 0)), batch)
    cfg = _cfg(precision__matmul_dtype="bfloat16")
    results = []
    for mesh in (None, mesh_8):
        ts = st.TrainStep(TINY, cfg, mesh=mesh, rules=shd.ShardingRules.from_mapping())
        s, m = ts.step(_with_teacher(ts.init(_params(0), 0)), batch)
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(s.params))
        for k in ("loss", "kl", "grad_norm"):
            np.testing.assert_allclose(float(m[k]), float(m_ref[k]), rtol=3e-2, err_msg=k)
        assert float(m["loss"]) != float(m_ref["loss"])  # the option is not a no-op
        results.append((jax.tree.map(np.asarray, s.params), m))
    (p_u, m_u), (p_s, m_s) = results
    for k in ("loss", "kl", "grad_norm"):
        np.testing.assert_allclose(float(m_s[k]), float(m_u[k]), rtol=1e-3, err_msg=k)
    for a, b in zip(jax.tree.leaves(p_s), jax.tree.leaves(p_u)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


@pytest.fixture(scope="module")
def mesh_8():
    return shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, devices=need_devices(8))
