"""The train step as the loop holds it: the jitted step (``distill.step.TrainStep``), its
state and the initial params, and the host-side call of one update.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pmd_jax import footprint


@dataclasses.dataclass
class TrainBundle:
    step_fn: Any  # distill.step.TrainStep
    state: Any  # distill.step.TrainState
    initial_params: Any  # for KL(policy || initial) at eval (None to skip)


def init_train_state(cfg: Any, model: Any) -> TrainBundle:
    """The train step for ``model`` (a build.ModelBundle) and its initial state."""
    from pmd_jax.distill.step import TrainStep

    ts = TrainStep(model.cfg, cfg.distill, mesh=model.mesh, rules=model.rules,
                   microbatch_rows=int(cfg.train.microbatch_rows),
                   lesson_nll_weight=float(cfg.mel.nll_weight))  # used by the mel loss only
    state = ts.init(model.params, rng=int(cfg.seed))
    return TrainBundle(ts, state, model.params)


def train_step(bundle: TrainBundle, batch: dict[str, np.ndarray]) -> dict[str, float]:
    """One update on the host batch ``batch``; returns the step's scalar metrics."""
    import jax

    sh = bundle.step_fn.batch_shardings(batch)
    if sh is not None and jax.process_count() > 1:
        # Every process holds the same global host batch; jit refuses numpy inputs with
        # shardings that span processes, so place them first (each process its own shards).
        batch = {k: jax.device_put(v, sh[k]) for k, v in batch.items()}
    bundle.state, metrics = bundle.step_fn.step(bundle.state, batch)
    # The step is dispatched (compiled the first time a batch shape comes): the compiler's
    # freed working memory goes back to the kernel while the step runs, not beside its
    # temporaries (footprint module docstring).
    footprint.release_free_memory()
    return {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}


def current_params(cfg: Any, bundle: TrainBundle) -> Any:
    """The policy's params in the compute dtype (what the sampler and the export get)."""
    from pmd_jax.distill.step import compute_params

    return compute_params(bundle.state, cfg.distill)
