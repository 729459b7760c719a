"""An exact top-K over a large last axis that XLA:GPU does not lower to a full sort.

XLA:GPU's TopK kernel takes ``k <= 16``; ``lax.top_k(x, 100)`` over a 128k vocabulary becomes
a sort of (value, index) pairs over the whole vocabulary for every row. :func:`two_stage_top_k`
returns exactly what ``lax.top_k`` returns (the same values, the same indices, ties in the same
order: equal values by ascending index) from small top-Ks only:

1. The last axis is padded with ``-inf`` to ``nb * L`` (``nb = floor(V / block)`` blocks of
   ``L = ceil(V / nb) >= block`` entries, so fewer than ``nb`` pad entries) and cut into
   **strided** blocks: block ``b`` holds indices ``b, b + nb, b + 2 nb, ...``. Each block
   gives its top ``per_block`` (16) with ``lax.top_k`` (rows of ``L``). Blocks of at least
   1,024 because XLA:GPU runs a top-16 as its TopK kernel only on rows that long (compiled for
   an H100 target: rows of 1,018 are sorted, rows of 1,025 or more take ``__gpu$TopK``).
2. The ``nb * per_block`` candidates are put in index order (a sort of the candidates' indices,
   so that equal values keep ``lax.top_k``'s lowest-index-first order) and ``lax.top_k`` of
   them gives the K winners.
3. Exactness check: a block whose ``per_block``-th candidate is not strictly below the K-th
   value found may hold more winners than it gave (with a tie at the boundary, a lower index
   that was cut), and so do rows where K reached the padding. Then the whole operand is
   redone with ``lax.top_k`` (one ``lax.cond`` for the batch). When every block's last
   candidate is strictly below the K-th value, every entry left out of the candidates has at
   least K candidates strictly above it, so the candidates hold the whole top-K; the check
   uses IEEE ``<``, so a NaN, or a tie (-0.0 and 0.0 counted equal), takes the fallback.

Why strided blocks: BPE vocabularies put the frequent tokens at low ids. On Qwen2.5-Coder-0.5B
logits (220 rows of code and prose, V = 151936) the top-100 put a median of 27 and up to 62
winners in one contiguous block of 1,024, so contiguous blocks of 16 candidates would fall
back on 76% of rows (nearly every loss chunk); with strided blocks the most any block held was
6 (measured, ``docs/benchmarks.md``).

For ``k <= per_block`` a block cannot hold more than ``per_block`` winners, so only the
padding check applies (XLA:GPU's own TopK kernel already serves that case; ``"auto"`` keeps
``lax.top_k`` there).

:func:`top_k` dispatches on an implementation name (``distill.loss.top_k_impl``):
``"sort"`` is ``lax.top_k`` (XLA:GPU sorts the full axis for K > 16), ``"two_stage"`` is
:func:`two_stage_top_k` on every backend, ``"auto"`` is the two-stage one when the program is
lowered for a GPU (``lax.platform_dependent``: decided at lowering, so a GPU program compiled
on a CPU host takes it too) and ``lax.top_k`` elsewhere (CPU results bitwise unchanged).

Compiled by XLA:GPU for an H100 target (no device; ``docs/benchmarks.md``), ``lax.top_k(x,
100)`` on ``[1536, 128256]`` is one sort of ``[1536, 128256]`` (value, index) pairs; the
two-stage program is a ``__gpu$TopK`` over ``[192000, 1027]`` rows, sorts of ``[1536, 2000]``
candidates, and the full sort only in the fallback branch. On a CPU the two-stage program is
slower than ``lax.top_k`` (XLA:CPU's TopK runs many short rows no faster than few long ones;
0.55-0.67 vs 0.07-0.12 s for ``[96, 128256]``), which is why ``"auto"`` keeps ``lax.top_k``
there.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
TopKIndices = Callable[[Array, int], Array]

TOP_K_IMPLS = ("auto", "sort", "two_stage")
BLOCK = 1024  # the shortest block
PER_BLOCK = 16  # candidates per block: the largest K of XLA:GPU's TopK kernel


def check_impl(impl: str) -> str:
    if impl not in TOP_K_IMPLS:
        raise ValueError(f"top-K implementation {impl!r} is not one of {TOP_K_IMPLS}")
    return impl


def block_layout(vocab: int, block: int = BLOCK) -> tuple[int, int]:
    """``(nb, L)``: the number of strided blocks and their length for a last axis of
    ``vocab`` entries: ``nb = max(vocab // block, 1)`` blocks of ``L = ceil(vocab / nb)``
    entries, ``block <= L < 2 block`` (when ``vocab >= block``), padding ``nb * L - vocab <
    nb``. (XLA:GPU runs a top-16 as its TopK kernel only over rows of >= 1,024 entries; shorter
    rows are sorted.) E.g. 128,256 -> 125 blocks of 1,027."""
    nb = max(vocab // block, 1)
    return nb, -(-vocab // nb)


def two_stage_top_k(
    x: Array, k: int, *, block: int = BLOCK, per_block: int = PER_BLOCK
) -> tuple[Array, Array]:
    """``lax.top_k(x, k)`` (values, int32 indices over the last axis), exactly, from a
    top-``per_block`` of strided blocks of at least ``block`` entries (:func:`block_layout`)
    and a top-``k`` of the candidates (module docstring). Shapes too small to gain are
    ``lax.top_k`` itself."""
    k = int(k)
    parts = _two_stage_check(x, k, block, per_block)
    if parts is None:
        return _top_k_i32(x, k)
    vals, idx, unsure = parts
    return lax.cond(unsure, lambda: _top_k_i32(x, k), lambda: (vals, idx))


def _two_stage_check(
    x: Array, k: int, block: int, per_block: int
) -> tuple[Array, Array, Array] | None:
    """``(values, indices, unsure)`` of the two stages, ``unsure`` a bool scalar that is True
    where the answer may differ from ``lax.top_k`` (the batch then takes the fallback); None
    where the shape is too small to gain (one block, or fewer candidates than ``k``, or no
    fewer than the entries)."""
    vocab = x.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k={k} must be in [1, {vocab}]")
    if block < 1 or per_block < 1:
        raise ValueError(f"block={block} and per_block={per_block} must be >= 1")
    nb, length = block_layout(vocab, block)
    per = min(per_block, length)
    if nb == 1 or nb * per < k or nb * per >= vocab:
        return None
    lead = x.shape[:-1]
    pad = nb * length - vocab
    xp = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)], constant_values=-jnp.inf) if pad else x
    # entry j * nb + b of the axis is row j of block b: [..., L, nb] -> blocks [..., nb, L]
    blocks = jnp.swapaxes(xp.reshape(*lead, length, nb), -1, -2)
    bvals, bpos = lax.top_k(blocks, per)  # [..., nb, per], each block's best first
    bidx = bpos.astype(jnp.int32) * nb + jnp.arange(nb, dtype=jnp.int32)[:, None]
    # candidates in index order, so that lax.top_k's tie rule (lower position) is the index's
    cidx, cvals = lax.sort(
        (bidx.reshape(*lead, nb * per), bvals.reshape(*lead, nb * per)), dimension=x.ndim - 1,
        num_keys=1)
    vals, pos = lax.top_k(cvals, k)
    idx = jnp.take_along_axis(cidx, pos, axis=-1)
    if k <= per:  # a block holds at most k <= per winners: only the padding can intrude
        unsure = jnp.any(idx >= vocab)
    else:  # IEEE "<": a tie at the boundary or a NaN is unsure. A block's last candidate and
        # the K-th value as the min of the top-K's values (the same value, NaN propagated): a
        # slice of a top-K's values keeps XLA:CPU from running it as its TopK (it sorts the
        # whole row instead, 60x slower here)
        unsure = jnp.any(~(jnp.min(bvals, axis=-1) < jnp.min(vals, axis=-1, keepdims=True)))
    return vals, idx, unsure


def _top_k_i32(x: Array, k: int) -> tuple[Array, Array]:
    vals, idx = lax.top_k(x, k)
    return vals, idx.astype(jnp.int32)


def top_k(x: Array, k: int, impl: str = "auto") -> tuple[Array, Array]:
    """``lax.top_k(x, k)`` by the implementation ``impl`` (one of :data:`TOP_K_IMPLS`)."""
    check_impl(impl)
    k = int(k)
    if impl == "sort":
        return lax.top_k(x, k)
    block, per_block = BLOCK, PER_BLOCK  # read at the call (tests shrink them)
    if impl == "two_stage":
        return two_stage_top_k(x, k, block=block, per_block=per_block)
    if k <= per_block:  # XLA:GPU's TopK kernel takes it whole
        return lax.top_k(x, k)
    two = lambda v: two_stage_top_k(v, k, block=block, per_block=per_block)  # noqa: E731
    return lax.platform_dependent(x, cuda=two, rocm=two, default=lambda v: _top_k_i32(v, k))


def topk_indices_fn(impl: str = "auto") -> TopKIndices:
    """``fn(x, k) -> int32 indices``: :func:`top_k`'s indices with ``impl``."""
    check_impl(impl)

    def fn(x: Array, k: int) -> Array:
        return top_k(x, k, impl)[1].astype(jnp.int32)

    return fn
