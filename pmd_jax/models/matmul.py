"""Weight matmuls with low-precision operands and float32 accumulation (``matmul_dtype``).

``lowp_einsum(spec, x, w, dtype)`` is ``einsum(spec, x, w)`` computed from operands rounded to
``dtype`` (bfloat16 or float16) with float32 accumulation and a float32 result: the
mixed-precision recipe of torch.autocast and of bf16 training on TPU/GPU, for activations and
master weights kept in float32. Its backward rounds the incoming cotangent to ``dtype`` too and
runs both gradient matmuls (dX and dW) in ``dtype`` with float32 accumulation, so all three
matmuls of a layer take the fast low-precision path; the residuals kept for the backward are
the rounded operands (half the bytes of float32 ones).

Why a custom VJP: differentiating ``einsum(x.astype(bf16), w.astype(bf16),
preferred_element_type=float32)`` directly gives backward dots of a float32 cotangent against a
bfloat16 operand, which XLA runs in float32. On a 2-core Sapphire Rapids host (AMX-BF16) a
[4096, 576] x [576, 1536] matmul runs at ~100 GFLOP/s in float32 and ~450 with bf16 operands
and a float32 result; a bf16 *result* falls back to ~130. The dW matmul is written as an
einsum over the original N-D operands (not a 2-D dot contracting dimension 0), which XLA
canonicalises into the fast layout (38 vs 84 ms at that shape).
"""

from __future__ import annotations

import functools
import string

import jax
import jax.numpy as jnp

Array = jax.Array

LOWP_DTYPES = ("bfloat16", "float16")


def _expand(spec: str, x_ndim: int) -> tuple[str, str, str]:
    """The operand and output index strings of ``spec``, a leading ``...`` of ``x`` and the
    output replaced by explicit letters."""
    lhs, out = spec.replace(" ", "").split("->")
    xs, ws = lhs.split(",")
    if "..." in xs:
        free = [c for c in string.ascii_letters if c not in set(xs + ws + out)]
        ell = "".join(free[:x_ndim - (len(xs) - 3)])
        xs, out = xs.replace("...", ell), out.replace("...", ell)
    return xs, ws, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _lowp(spec: str, x: Array, w: Array, dtype: str) -> Array:
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype),
                      preferred_element_type=jnp.float32)


def _lowp_fwd(spec: str, x: Array, w: Array, dtype: str):
    xl, wl = x.astype(dtype), w.astype(dtype)
    y = jnp.einsum(spec, xl, wl, preferred_element_type=jnp.float32)
    # zero-size markers carry the primal dtypes to the backward
    return y, (xl, wl, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _lowp_bwd(spec: str, dtype: str, res, g: Array):
    xl, wl, xmark, wmark = res
    xs, ws, out = _expand(spec, xl.ndim)
    gl = g.astype(dtype)
    dx = jnp.einsum(f"{out},{ws}->{xs}", gl, wl, preferred_element_type=jnp.float32)
    dw = jnp.einsum(f"{xs},{out}->{ws}", xl, gl, preferred_element_type=jnp.float32)
    return dx.astype(xmark.dtype), dw.astype(wmark.dtype)


_lowp.defvjp(_lowp_fwd, _lowp_bwd)


def lowp_einsum(spec: str, x: Array, w: Array, dtype: str) -> Array:
    """``einsum(spec, x, w)`` from ``dtype``-rounded operands, float32 accumulation and result.

    ``spec`` is a two-operand einsum without repeated indices within an operand (every index
    of ``x`` appears in ``w`` or the output, and likewise for ``w``); an ellipsis may lead
    ``x`` and the output.
    """
    if dtype not in LOWP_DTYPES:
        raise ValueError(f"matmul dtype {dtype!r} is not one of {LOWP_DTYPES}")
    if "..." in spec.split("->")[0].split(",")[1]:
        raise ValueError(f"lowp_einsum: no ellipsis allowed in the weight's indices ({spec!r})")
    return _lowp(spec, x, w, dtype)


def weight_einsum(spec: str, x: Array, w: Array, matmul_dtype: str | None) -> Array:
    """A weight matmul of the decoder: plain ``einsum`` (result in ``x``'s dtype) when
    ``matmul_dtype`` is None, else :func:`lowp_einsum` cast back to ``x``'s dtype."""
    if matmul_dtype is None:
        return jnp.einsum(spec, x, w)
    return lowp_einsum(spec, x, w, matmul_dtype).astype(x.dtype)
