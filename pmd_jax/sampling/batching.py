"""How the JAX sampler cuts a request into compiled programs: length buckets and two plans.

A request is decoded in *batches* (rows = prompt x sample, sorted by prompt length); each
batch's cache is filled from *prefill groups*: its distinct prompts (a prompt's ``n`` samples
share one prefill), sorted by length and cut into groups, each left-padded to its own
length. Padding costs compute (a padded position goes through the prefill like a real one);
distinct shapes cost compiles. :func:`plan_batches` minimises a cost model of both by dynamic
programming over the sorted rows, once for the batches and once per batch for its groups
(:func:`plan_prefill_groups`):

* prefill: ``rows_padded * prompt_padded`` token-positions for a group; for a batch, the
  caller's estimate of its groups' prefill plus a charge for its cache (``batch_cost``);
* decode: ``out_len`` steps per batch, each costing about ``decode_step_base +
  decode_step_per_row * rows_padded`` prefill token-equivalents (a decode step reads every
  weight once, whatever the batch; on this project's 2-core CPU box a SmolLM2-135M decode step
  at 16 rows took about as long as a prefill of 64-100 tokens); a group pays
  ``group_overhead`` once instead (a prefill call also reads every weight);
* compile: ``compile_tokens`` for a shape this process has not compiled yet (shapes the
  sampler already ran are free), so a plan prefers programs it has.

Rows are padded to a *row bucket* (1, 2, 3, 4, 6, 8, 12, 16, 24, ... : powers of two and 1.5x
powers of two, rounded up to a multiple of the mesh's batch divisor); a batch's prompts to a
*length bucket* (same series, at least 16), a group's to a finer *prefill length* (eighth
steps between powers of two: ..., 128, 144, 160, ..., 256, 288, 320, ...; every length bucket
is one). The plans never change what is sampled: tokens depend on ``(seed, prompt index, sample
index, step)`` only, never on batch composition or padding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Sequence

import numpy as np

_MIN_BUCKET = 16


def bucket_length(n: int, minimum: int = _MIN_BUCKET) -> int:
    """Smallest bucket >= n among {minimum} U {2^k, 3 * 2^(k-1)}."""
    if n <= minimum:
        return minimum
    p = 1 << (n - 1).bit_length()  # next power of two >= n
    three_quarters = 3 * p // 4
    return three_quarters if three_quarters >= n else p


def prefill_length(n: int, minimum: int = _MIN_BUCKET) -> int:
    """Smallest of {minimum} U {m * 2^k : m in 8..16} >= n (eighth steps between powers of
    two, so at most 12.5% padding; contains every ``bucket_length``)."""
    if n <= minimum:
        return minimum
    p = 1 << (n - 1).bit_length()
    q = max(1, p // 16)
    return -(-n // q) * q


def row_bucket(n: int, divisor: int = 1) -> int:
    """Padded row count of a batch of ``n`` rows: a bucket of the 1, 2, 3, 4, 6, 8, 12, ...
    series, rounded up to a multiple of ``divisor`` (the mesh's batch split)."""
    b = bucket_length(max(1, n), minimum=1)
    return -(-b // divisor) * divisor


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Token-equivalent costs of the plan (see the module docstring)."""

    decode_step_base: float = 64.0
    decode_step_per_row: float = 2.0
    compile_tokens: float = 8192.0


# Prefill groups: no decode steps; each call reads every weight once (~64 prefill tokens);
# a prefill program compiles in ~3 s on the 2-core box (~1,400 prefill tokens), and runs keep
# compiled programs in the persistent compilation cache, so a shape is cheaper than that.
GROUP_COST = CostModel(decode_step_base=64.0, decode_step_per_row=0.0, compile_tokens=1024.0)


def plan_batches(
    lengths: Sequence[int],
    max_rows: int,
    shape_of: Callable[[int, int], tuple[int, ...]],
    out_len: int,
    *,
    divisor: int = 1,
    compiled: Collection[tuple[int, ...]] = (),
    cost: CostModel = CostModel(),
    batch_cost: Callable[[int, int, int, tuple[int, ...]], float] | None = None,
) -> list[tuple[int, int]]:
    """Cut rows sorted by prompt length into contiguous batches ``[(start, end), ...]``.

    Args:
      lengths: prompt length of each row, ascending.
      max_rows: most real rows in one batch.
      shape_of: ``(padded rows, longest prompt) -> shape key`` of the compiled program; its
        element 1 must be the padded prompt length (the prefill's cost).
      out_len: decode steps one batch may run (its output buffer length).
      divisor: padded row counts are multiples of this.
      compiled: shape keys already compiled in this process (no compile cost).
      batch_cost: ``(start, end, padded rows, shape key) -> tokens``, the prefill term of
        rows ``[start, end)`` (default ``padded rows * key[1]``).
    """
    n = len(lengths)
    if any(b < a for a, b in zip(lengths, lengths[1:], strict=False)):
        raise ValueError("plan_batches needs lengths sorted ascending")
    if n == 0:
        return []
    max_rows = max(1, int(max_rows))
    inf = float("inf")
    best = [0.0] + [inf] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[j - 1]
        for i in range(max(0, j - max_rows), j):
            rows = row_bucket(j - i, divisor)
            key = shape_of(rows, longest)
            c = rows * key[1] if batch_cost is None else batch_cost(i, j, rows, key)
            c += out_len * (cost.decode_step_base + cost.decode_step_per_row * rows)
            if key not in compiled:
                c += cost.compile_tokens
            if best[i] + c < best[j]:
                best[j], cut[j] = best[i] + c, i
    plan: list[tuple[int, int]] = []
    j = n
    while j > 0:
        plan.append((cut[j], j))
        j = cut[j]
    return plan[::-1]


def plan_prefill_groups(lengths: Sequence[int], max_rows: int, *, divisor: int = 1,
                        limit: int | None = None, max_tokens: int | None = None,
                        compiled: Collection[tuple[int, ...]] = (),
                        cost: CostModel = GROUP_COST) -> list[tuple[int, int, int, int]]:
    """Cut a batch's distinct prompts (``lengths`` ascending) into prefill groups:
    ``[(start, end, padded rows, padded length), ...]``, lengths ``prefill_length`` capped
    at ``limit`` (the batch's prompt slots). ``compiled`` holds ``(rows, length)`` keys.

    ``max_tokens``: no group of several prompts holds more than this many padded token
    positions (rows x length; a prompt alone is never split). A group's memory grows with
    its positions: its cache, its activations and, below the chunked-attention threshold,
    its float32 scores (x its length); see ``rollout.max_prefill_tokens``."""
    def shape(rows: int, longest: int) -> tuple[int, int]:
        p = prefill_length(longest)
        return rows, p if limit is None else min(p, limit)

    def group_cost(i: int, j: int, rows: int, key: tuple[int, ...]) -> float:
        if max_tokens and j - i > 1 and rows * key[1] > max_tokens:
            return float("inf")
        return rows * key[1]

    plan = plan_batches(lengths, max_rows, shape, 1, divisor=divisor, compiled=compiled,
                        cost=cost, batch_cost=group_cost)
    return [(s, e, *shape(row_bucket(e - s, divisor), lengths[e - 1])) for s, e in plan]


# One cache slot of one row for one decode step, in prefill token-equivalents: the step's
# attention reads it (SmolLM2-135M on the 2-core box: ~6 us a slot, a prefill token ~2 ms),
# and the cache's size bounds the batch's memory, so a short prompt is not kept in a long
# batch for long generations.
CACHE_SLOT_STEP = 0.005


def batch_cost(prompts: Sequence[int], lengths: Sequence[int], max_slots: int | None = None):
    """``plan_batches``' prefill term for rows sorted by length (``prompts[k]`` the prompt of
    row k): each distinct prompt of the batch once at its prefill length, plus the cache;
    infinite for a batch of several rows whose cache exceeds ``max_slots`` row-slots."""
    pre = [0]
    for k, (q, n) in enumerate(zip(prompts, lengths, strict=True)):
        pre.append(pre[-1] + (prefill_length(n) if k == 0 or prompts[k - 1] != q else 0))

    def cost(i: int, j: int, rows: int, key: tuple[int, ...]) -> float:
        if max_slots is not None and j - i > 1 and rows * key[2] > max_slots:
            return math.inf
        head = 0 if i == 0 or prompts[i - 1] != prompts[i] else prefill_length(lengths[i])
        return pre[j] - pre[i] + head + CACHE_SLOT_STEP * key[3] * rows * key[2]

    return cost


def shared_prefix_length(prompts: Sequence[Sequence[int] | np.ndarray], minimum: int) -> int:
    """Tokens of the prefix every one of ``prompts`` (two or more) starts with, cut to the
    largest ``prefill_length`` bucket within it (so its programs serve other requests too)
    and leaving every prompt at least one token of its own; 0 if that is under ``minimum``."""
    if len(prompts) < 2:
        return 0
    first = np.asarray(prompts[0])
    n = min(len(p) for p in prompts) - 1
    for p in prompts[1:]:
        diff = np.flatnonzero(np.asarray(p)[:n] != first[:n])
        n = int(diff[0]) if diff.size else n
    if n < minimum:
        return 0
    while prefill_length(n) > n:
        n -= 1
    return n
