"""Gradient accumulation inside one jitted train step (``train.microbatch_rows``).

The update batch of ``B`` rows is split into ``n = B / microbatch_rows`` microbatches of
consecutive rows (GRPO groups stay whole); a ``lax.scan`` runs the loss and its gradient on
one microbatch at a time and sums the gradients, then the caller applies ONE optimizer update.
Activation memory is that of one microbatch; the gradient accumulator costs one fp32 copy of
the params.

Same numbers as the full batch. Every loss of :mod:`pmd_jax.distill.losses` is a token mean
``sum(x * m) / max(sum(m), 1)`` over a mask ``m`` of the WHOLE batch: the loss mask
``response_mask * sd_mask`` (SDPO) or the response mask (GRPO, hybrid), as the loss's
``metric_kinds["loss"]`` declares (:mod:`pmd_jax.distill.registry`). A microbatch's loss
function returns its own mean ``L_i = S_i / max(M_i, 1)``; weighting it by
``w_i = max(M_i, 1) / max(M, 1)`` (``M = sum_i M_i``, a constant of the batch, no gradient)
gives ``sum_i w_i L_i = sum_i S_i / max(M, 1)``, the full-batch mean, exactly (a microbatch
with ``M_i = 0`` has ``S_i = 0``). The gradient is linear, so the summed gradients of
``w_i L_i`` are the full-batch gradient. Metrics are combined by kind (:func:`metric_kinds`):
token means over either mask with the same weights, row means with ``1 / n``, counts summed,
maxima maxed. A metric of unknown kind is an error at trace time, not a silent mean.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from pmd_jax.distill import registry

Array = jax.Array

# metric name -> how it combines over microbatches:
#   "loss_mask": token mean over response_mask * sd_mask; "response": token mean over
#   response_mask; "rows": mean over rows; "sum": summed; "max": maximum.
# The metrics the step adds for every loss; each loss declares its own in its LossSpec
# (pmd_jax.distill.objectives), "loss" naming the mask that normalises it.
_STEP_KINDS = {
    "logp_mismatch_mean": "response",
    "logp_mismatch_max": "max",
    "rollout_is_clip_frac": "response",
}


class MicrobatchError(ValueError):
    """``train.microbatch_rows`` does not fit the batch or the mesh; the message says why."""


def metric_kinds(loss_name: str) -> dict[str, str]:
    """How each metric of the step with the registered loss ``loss_name`` combines
    over microbatches (an unknown name is a ValueError listing the known ones)."""
    return {**_STEP_KINDS, **registry.get_loss(loss_name).metric_kinds}


def loss_mask_kind(loss_name: str) -> str:
    """The mask whose token count normalises the registered loss ``loss_name``."""
    return metric_kinds(loss_name)["loss"]


def check_microbatch_rows(microbatch_rows: int, unit: int) -> None:
    """``microbatch_rows`` is 0 (off) or a positive multiple of ``unit``."""
    if isinstance(microbatch_rows, bool) or microbatch_rows < 0:
        raise MicrobatchError(f"train.microbatch_rows must be >= 0 (0 = off), got "
                              f"{microbatch_rows!r}")
    if microbatch_rows and microbatch_rows % unit:
        raise MicrobatchError(
            f"train.microbatch_rows={microbatch_rows} is not a multiple of {unit} (the mesh's "
            "batch axes times the GRPO group size): each microbatch must split evenly")


def microbatch_size(rows: int, microbatch_rows: int, unit: int = 1) -> int:
    """The rows per microbatch for a batch of ``rows``: ``microbatch_rows`` when it divides
    ``rows``; a batch of at most ``microbatch_rows`` rows is one microbatch; otherwise the
    largest multiple of ``unit`` (the mesh's batch size x the GRPO group) below
    ``microbatch_rows`` that divides ``rows`` (the dropped-row buckets of
    :func:`pmd_jax.update_rows.rows_for_update` need not be multiples of it).
    """
    check_microbatch_rows(microbatch_rows, unit)
    if microbatch_rows == 0 or rows <= microbatch_rows:
        return rows
    for m in range(microbatch_rows, 0, -unit):
        if rows % m == 0:
            return m
    raise MicrobatchError(f"a batch of {rows} rows does not split into microbatches of a "
                          f"multiple of {unit} rows")


def _masks(batch: Mapping[str, Array]) -> dict[str, Array]:
    resp = batch["response_mask"].astype(jnp.float32)
    sd = batch["sd_mask"].astype(jnp.float32)
    return {"response": resp, "loss_mask": resp * sd[:, None]}


def _weights(batch: Mapping[str, Array], n: int) -> dict[str, Array]:
    """Per microbatch ``[n]``: ``max(M_i, 1) / max(M, 1)`` for each mask, ``1/n`` for rows."""
    out = {}
    for name, m in _masks(batch).items():
        per = jnp.sum(m.reshape(n, -1), axis=1)
        out[name] = jnp.maximum(per, 1.0) / jnp.maximum(jnp.sum(per), 1.0)
    out["rows"] = jnp.full((n,), 1.0 / n, jnp.float32)
    return out


def split(batch: Mapping[str, Array], n: int,
          sharding: Callable[[int], NamedSharding] | None = None) -> dict[str, Array]:
    """Each ``[B, ...]`` array as ``[n, B/n, ...]`` (microbatch i = rows i*B/n .. ); with
    ``sharding(ndim)`` the microbatch axis is replicated and the rows sharded on the mesh's
    batch axes (one reshuffle before the loop)."""
    out = {}
    for k, v in batch.items():
        x = v.reshape(n, v.shape[0] // n, *v.shape[1:])
        if sharding is not None:
            x = lax.with_sharding_constraint(x, sharding(v.ndim))
        out[k] = x
    return out


def combine_metrics(per_mb: Mapping[str, Array], weights: Mapping[str, Array],
                    loss_name: str) -> dict[str, Array]:
    """Full-batch metrics from ``[n]`` per-microbatch values (see the module docstring)."""
    kinds = metric_kinds(loss_name)
    out = {}
    for k, v in per_mb.items():
        kind = kinds.get(k)
        if kind is None:
            raise KeyError(f"metric {k!r} of loss {loss_name!r} has no accumulation rule: declare "
                           "it in the loss's LossSpec.metric_kinds (pmd_jax.distill.objectives)")
        v = v.astype(jnp.float32)
        if kind == "sum":
            out[k] = jnp.sum(v)
        elif kind == "max":
            out[k] = jnp.max(v)
        else:
            out[k] = jnp.sum(weights[kind] * v)
    return out


def accumulated_value_and_grad(
    loss_fn: Callable[[Any, Any, Mapping[str, Array]], tuple[Array, dict]],
    params: Any,
    teacher: Any,
    batch: Mapping[str, Array],
    *,
    loss_name: str,
    n: int,
    sharding: Callable[[int], NamedSharding] | None = None,
    grad_sharding: Any = None,
) -> tuple[tuple[Array, dict[str, Array]], Any]:
    """``((loss, metrics), grads)`` of the whole batch from ``n`` microbatches in a scan.

    ``loss_fn(params, teacher, microbatch) -> (loss, metrics)`` as
    :func:`pmd_jax.distill.loss_fn.make_loss_fn`. Gradients accumulate in fp32 and come back in
    each param's dtype; ``grad_sharding`` (the params' shardings) pins the accumulator.
    """
    rows = batch["response_mask"].shape[0]
    if n < 1 or rows % n:
        raise MicrobatchError(f"a batch of {rows} rows does not split into {n} microbatches")
    weights = _weights(batch, n)
    loss_w = weights[loss_mask_kind(loss_name)]
    mbs = split(batch, n, sharding)

    def scaled(p: Any, mb: Mapping[str, Array], w: Array) -> tuple[Array, tuple]:
        loss, metrics = loss_fn(p, teacher, mb)
        return loss * w, (loss, metrics)

    grad_fn = jax.value_and_grad(scaled, has_aux=True)

    def body(acc: Any, xs: tuple) -> tuple[Any, tuple]:
        mb, w = xs
        (_, (loss, metrics)), g = grad_fn(params, mb, w)
        acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g)
        return acc, (loss, metrics)

    acc0 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    if grad_sharding is not None:
        acc0 = lax.with_sharding_constraint(acc0, grad_sharding)
    acc, (losses, per_mb) = lax.scan(body, acc0, (mbs, loss_w))
    grads = jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params)
    loss = jnp.sum(loss_w * losses)
    metrics = combine_metrics(per_mb, weights, loss_name)
    metrics["loss"] = loss
    return (loss, metrics), grads


def mesh_spec(rules_spec_2d: PartitionSpec, rules_spec_1d: PartitionSpec, ndim: int
              ) -> PartitionSpec:
    """``PartitionSpec(None, *row_spec)``: the microbatch axis first, unsharded."""
    return PartitionSpec(None, *(rules_spec_1d if ndim == 1 else rules_spec_2d))
