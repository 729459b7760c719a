"""Top-K indices over a vocabulary that is sharded across devices, without gathering it.

``lax.top_k`` on a ``[B, T, V]`` array whose batch is sharded over ``data x fsdp`` and whose
vocabulary is sharded over ``tensor`` is not partitioned by XLA: the SPMD partitioner
replicates the operand first. For the Qwen3-8B dry run (64 devices, 256-token loss chunks,
V = 151936) that all-gather of the logits chunk is about 37 GiB per device.

:func:`make_topk_indices` returns a drop-in for ``lax.top_k(x, k)[1]`` that runs under
``jax.shard_map``: each device takes the top-K of its own vocabulary slice (local indices
shifted to global ones), the K candidates of every vocabulary shard are gathered over the
vocabulary mesh axes (``K x shards`` numbers per row, not ``V``), and a second top-K over the
candidates picks the global K. The batch stays sharded throughout. The result equals
``lax.top_k`` on the unsharded array (same values; on exact ties the lower index wins in both).

Shapes that do not divide the mesh fall back to the unsharded top-K. Each top-K over a
vocabulary (a shard's, or the unsharded fallback) is :func:`pmd_jax.distill.topk.top_k` with
the loss's ``top_k_impl`` (on GPU not a sort of the whole slice); the final one over the
``K x shards`` candidates is ``lax.top_k``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from pmd_jax.distill import topk as topk_lib
from pmd_jax.distill.losses import TopKIndices
from pmd_jax.run.sharding import ShardingRules

Array = jax.Array


def dense_topk_indices(x: Array, k: int) -> Array:
    """``lax.top_k(x, k)`` indices over the last axis (the unsharded reference)."""
    return lax.top_k(x, int(k))[1]


def _axes_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(int(mesh.shape[a]) for a in axes)


def make_topk_indices(mesh: Mesh, rules: ShardingRules, impl: str = "auto") -> TopKIndices:
    """``fn(x, k) -> int32 indices [..., k]`` for ``x`` of shape ``[B, ..., V]``.

    The leading axis is placed like the logical ``batch`` axis and the last like ``vocab``
    (``rules``); the axes between are replicated. ``x`` must not need gradients through the
    indices (pass ``stop_gradient`` values, as the top-K loss does). ``impl``: the top-K
    implementation of each vocabulary slice (:data:`pmd_jax.distill.topk.TOP_K_IMPLS`).
    """
    topk_lib.check_impl(impl)
    dense = topk_lib.topk_indices_fn(impl)
    spec = rules.spec(("batch", "vocab"))
    batch_axes = _as_tuple(spec[0])
    vocab_axes = _as_tuple(spec[1])

    def fn(x: Array, k: int) -> Array:
        k = int(k)
        b, v = x.shape[0], x.shape[-1]
        nb = _axes_size(mesh, batch_axes)
        nv = _axes_size(mesh, vocab_axes)
        if (nb == 1 and nv == 1) or b % nb or v % nv:
            return dense(x, k)
        v_local = v // nv
        k_local = min(k, v_local)
        middle = (None,) * (x.ndim - 2)
        b_spec = batch_axes if batch_axes else None
        v_spec = vocab_axes if vocab_axes else None
        in_spec = PartitionSpec(b_spec, *middle, v_spec)
        out_spec = PartitionSpec(b_spec, *middle, None)

        def local(xs: Array) -> Array:
            vals, idx = topk_lib.top_k(xs, k_local, impl)
            if not vocab_axes:
                return idx.astype(jnp.int32)
            shard = lax.axis_index(vocab_axes)
            idx = idx.astype(jnp.int32) + (shard * v_local).astype(jnp.int32)
            # candidates of every vocab shard, in shard order: [..., nv * k_local]
            vals = lax.all_gather(vals, vocab_axes, axis=xs.ndim - 1, tiled=True)
            idx = lax.all_gather(idx, vocab_axes, axis=xs.ndim - 1, tiled=True)
            _, pos = lax.top_k(vals, k)
            return jnp.take_along_axis(idx, pos, axis=-1)

        return jax.shard_map(local, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                             check_vma=False)(lax.stop_gradient(x))

    return fn


def _as_tuple(entry: object) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)  # type: ignore[arg-type]
