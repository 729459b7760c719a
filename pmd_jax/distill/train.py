"""The train step as the loop holds it: the jitted step (``distill.step.TrainStep``), its
state and the initial params, and the host-side call of one update.

LoRA (``lora.enabled``): the state trains the adapters and the bundle holds the frozen base
(``TrainBundle.base``), which is also the initial policy the KL measures against (the
forward with the adapters off: no second copy of the weights and no file, so
``train.offload_initial_policy`` has nothing to do); :func:`current_params` merges the adapters
into the base for the sampler and the export.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from pmd_jax.distill.offload import DiskParams, optimizer_set_aside, temp_files
from pmd_jax.distill.step import TrainStep, compute_params
from pmd_jax.loop.phases import TrainingError
from pmd_jax.run import footprint
from pmd_jax.run.disk import check_temp_space

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainBundle:
    step_fn: Any  # distill.step.TrainStep
    state: Any  # distill.step.TrainState
    initial_params: Any  # for KL(policy || initial) at eval (None to skip)
    # train.offload_optimizer_during_grads: the run key its optimizer file is named by
    optimizer_offload_key: str | None = None
    # LoRA: the frozen base params (placed, in lora.base_dtype), an argument of every step
    base: Any = None

    @property
    def lora(self) -> Any:
        """The step's models.lora.LoraConfig (None: full fine-tuning)."""
        return getattr(self.step_fn, "lora", None)

    def parts(self) -> dict[str, Any]:
        """What the bundle holds, by name (run.footprint's memory breakdown)."""
        return {"params": self.state.params, "optimizer": self.state.opt_state,
                "teacher": self.state.teacher, "lora_base": self.base,
                "initial_policy": self.initial_params}

    def base_is_cast(self, params: Any) -> bool:
        """LoRA: whether the frozen base is a cast copy of the loaded ``params``
        (lora.base_dtype), not the loaded arrays themselves."""

        return self.base is not None and any(
            b.dtype != p.dtype for b, p in zip(jax.tree.leaves(self.base),
                                               jax.tree.leaves(params), strict=True))


def init_train_state(cfg: RunConfig, model: Any, trains: bool = True) -> TrainBundle:
    """The train step for ``model`` (a build.ModelBundle) and its initial state. ``trains``
    False (the mode's weights never change): the state holds no optimizer or teacher, and
    the initial policy, which only the KL to it reads, is not kept
    (:func:`place_initial_policy`); ``lora`` is ignored then (nothing trains). LoRA: the
    state holds the adapters, the bundle the frozen base, which is the initial policy."""

    lora = cfg.lora.config() if trains else None
    if cfg.lora.enabled and not trains:
        log.info("lora.enabled is ignored: mode=%s never changes the weights", cfg.mode)
    ts = TrainStep(model.cfg, cfg.distill, mesh=model.mesh, rules=model.rules,
                   microbatch_rows=int(cfg.train.microbatch_rows),
                   lesson_nll_weight=float(cfg.mel.nll_weight),  # used by the mel loss only
                   shared_prefix=cfg.train.shared_prefix, trains=trains, lora=lora,
                   base_dtype=cfg.lora.base_dtype if lora is not None else "")
    state = ts.init(model.params, rng=int(cfg.seed))
    key = str(cfg.run_dir) if cfg.train.offload_optimizer_during_grads else None
    if lora is None:
        return TrainBundle(ts, state, model.params, key)
    base = ts.place_base(model.params)
    return TrainBundle(ts, state, base, key, base=base)


def prepare_offloads(cfg: RunConfig, bundle: TrainBundle, model: Any, run_key: str
                     ) -> list[str]:
    """Start-up, before any step: the offload options' temp files checked against the temp
    disk (``DiskSpaceError`` when they cannot fit; ``main``: exit 2), then the initial
    policy placed (:func:`place_initial_policy`). Returns the lines for the log."""

    lines = []
    files = temp_files(cfg.train, bundle)
    if files:
        lines.append(check_temp_space(files))
    placed = place_initial_policy(cfg, bundle, model, run_key)
    if placed:
        lines.append(f"initial policy {placed}; process RSS {footprint.rss_gib():.2f} GiB")
    return lines


def place_initial_policy(cfg: RunConfig, bundle: TrainBundle, model: Any, run_key: str) -> str:
    """The initial policy is read by the KL to it only (``distill/kl.py``): dropped when that
    is never measured (``train.kl_initial_every=0``), written to a file with
    ``train.offload_initial_policy`` (``distill/offload.py``, the file named by ``run_key``);
    either way ``model.params``, its only other holder, lets go of it. Returns what was done
    ('' when it stays in memory)."""

    tr = cfg.train
    measured = tr.kl_initial_every > 0 and bundle.step_fn.trains
    if bundle.lora is not None:  # the initial policy is the base, which the steps need
        model.params = None
        footprint.release_free_memory()
        if not measured:
            bundle.initial_params = None
            return "the base model (LoRA); the KL to it is not measured"
        return ("the base model (LoRA: no copy; train.offload_initial_policy has nothing "
                "to do)" if tr.offload_initial_policy else "")
    if measured and not tr.offload_initial_policy:
        return ""
    disk = DiskParams.write_temp(bundle.initial_params, run_key) if measured else None
    bundle.initial_params = model.params = None
    footprint.release_free_memory()
    bundle.initial_params = disk
    if disk is None:
        return ("dropped (train.kl_initial_every=0)" if bundle.step_fn.trains else
                "dropped (the mode never changes the weights: no KL to measure)")
    return f"offloaded to {disk.path} ({disk.nbytes_on_disk / footprint.GiB:.2f} GiB)"


def train_step(bundle: TrainBundle, batch: dict[str, np.ndarray]) -> dict[str, float]:
    """One update on the host batch ``batch``; returns the step's scalar metrics."""

    batch, layout = bundle.step_fn.pack(batch)  # shared-prefix rows (train.shared_prefix)
    sh = bundle.step_fn.batch_shardings(batch)
    if sh is not None and jax.process_count() > 1:
        # Every process holds the same global host batch; jit refuses numpy inputs with
        # shardings that span processes, so place them first (each process its own shards).
        batch = {k: jax.device_put(v, sh[k]) for k, v in batch.items()}
    base = bundle.base  # (LoRA: the frozen base; None otherwise)
    if bundle.optimizer_offload_key is None:
        bundle.state, metrics = bundle.step_fn.step(bundle.state, batch, base)
    else:  # train.offload_optimizer_during_grads: the moments wait in a file meanwhile
        with optimizer_set_aside(bundle, bundle.optimizer_offload_key):
            loss, metrics, grads = bundle.step_fn.gradients(bundle.state.params,
                                                            bundle.state.teacher, batch, base)
        bundle.state, metrics = bundle.step_fn.apply_gradients(bundle.state, loss, metrics,
                                                               grads)
        del grads
    # The step is dispatched (compiled the first time a batch shape comes): the compiler's
    # freed working memory goes back to the kernel while the step runs, not beside its
    # temporaries (footprint module docstring).
    footprint.release_free_memory()
    out = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
    return {**out, **layout}


def count_nonfinite(metrics: dict[str, Any], in_a_row: int, limit: int, step: int) -> int:
    """Non-finite updates in a row after this step's ``metrics`` (0 after a finite one); the
    step function skipped a non-finite update. Raises TrainingError at ``limit`` in a row."""

    if bool(metrics.get("finite", True)) and math.isfinite(float(metrics.get("loss", 0.0))):
        return 0
    in_a_row += 1
    log.warning("step %d: non-finite loss or gradient; update skipped (%d in a row)",
                step, in_a_row)
    if in_a_row >= limit:
        raise TrainingError(f"{in_a_row} non-finite updates in a row at step {step}: "
                            "stopping (lower distill.optim.lr or check the data)")
    return in_a_row


def current_params(cfg: RunConfig, bundle: TrainBundle) -> Any:
    """The policy's params in the compute dtype (what the sampler and the export get); LoRA:
    the adapters merged into the base (``TrainStep.merged_params``)."""

    if bundle.lora is not None:
        return bundle.step_fn.merged_params(bundle.state, bundle.base)
    return compute_params(bundle.state, cfg.distill)
