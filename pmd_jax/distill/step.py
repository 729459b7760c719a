"""The jitted, sharded distillation train step (every registered loss shares one code path).

``TrainStep(model_cfg, distill_cfg, mesh=..., rules=...)`` builds:

* ``init(params, rng) -> TrainState``: fp32 master weights (or params in ``param_dtype``),
  optimizer state, the teacher tree (EMA copy, frozen initial params, or the trust-region
  reference; none for the live teacher), step counter and RNG key data, placed on the mesh;
* ``step(state, batch) -> (state, metrics)``: one ``jax.jit`` call with in/out shardings from
  the logical-axis rules, the state donated (params, optimizer state, teacher).

A loss with ``lesson_nll`` (``mel``): the lesson rows are taken out of the batch before the
microbatch split; ``lesson_nll_weight`` x their token-mean NLL (a second forward, once per
step on all lesson rows) is added to the loss and its gradient to the (accumulated) gradient,
in the same jitted step; ``grpo_loss`` reports the loss without it.

``microbatch_rows=N`` (``train.microbatch_rows``; 0 = off): gradient accumulation inside the
same jitted step, a ``lax.scan`` over microbatches of N rows with full-batch loss
normalisation, then one optimizer update (:mod:`pmd_jax.distill.accumulate`).

``gradients(params, teacher, batch)`` then ``apply_gradients(state, loss, metrics, grads)``:
the same step as two programs, the first reading no optimizer state, so the AdamW moments can
wait in a file while the forwards and backwards run (``train.offload_optimizer_during_grads``,
``distill/train.py``): the gradient program's peak then holds params, teacher, gradient and
activations, the update's params, moments, teacher and gradient, never all at once.

One step: the loss and its gradient (:func:`pmd_jax.distill.loss_fn.make_loss_fn`: student
and, if the loss needs one, teacher forwards, chunked statistics, the registered loss of
``distill.loss.name``), then global-norm clip, AdamW and the EMA teacher in one pass
(:func:`pmd_jax.distill.optim.fused_update`); a non-finite loss or gradient leaves params,
optimizer state and teacher unchanged (``optim.skip_nonfinite``) and reports
``metrics["skipped"] = 1``. The batch is described in :mod:`pmd_jax.distill.batch`.

Metrics: ``loss``, ``kl`` (per-token reverse KL(student||teacher) over the loss mask),
``top1_agree``, ``entropy``, ``grad_norm`` (before clipping), ``lr``,
``masked_sample_fraction``, ``logp_mismatch_mean`` / ``logp_mismatch_max`` (|trainer - sampler|
log-probs over response tokens), ``clip_frac`` (PPO clip for grpo/hybrid, IS-ratio clip for
sdpo), ``rollout_is_clip_frac``, ``num_loss_tokens``, ``skipped``, ``finite``, and the loss's
own (:mod:`pmd_jax.distill.objectives`).

LoRA (``lora=LoraConfig(...)``, :mod:`pmd_jax.models.lora`): the trainable tree is the
adapters. The :class:`TrainState` keeps its fields and their roles: ``params`` holds the
adapters (fp32 master copies or ``param_dtype``), ``opt_state`` their AdamW moments,
``teacher`` the teacher's adapters (EMA / frozen / trust-region reference, all over the same
base; none for the live teacher). The frozen base params are not in the state: they are an
argument of their own of every program (``step(state, batch, base=...)``; :meth:`TrainStep.
place_base` casts them to ``base_dtype`` and places them like the params), never donated,
never differentiated and never checkpointed (a run loads them again from ``model.source``).
The adapters are initialised as PEFT does (A uniform, B zero: step 0 is the base model) from a
key folded out of the init RNG; the state's RNG key is the same as without LoRA.
:meth:`TrainStep.merged_params` folds them into plain weights in the compute dtype (the
sampler's and the HF export's). Without ``lora`` every program is the one it was before.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, Generic

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from typing_extensions import TypeVar

from pmd_jax.distill import accumulate
from pmd_jax.distill import optim as doptim
from pmd_jax.distill import shared_prefix as spx
from pmd_jax.distill import teacher as tlib
from pmd_jax.distill.batch import BatchError, check_batch
from pmd_jax.distill.config import DistillConfig
from pmd_jax.distill.loss_fn import StepOptions, _cast, make_lesson_nll_fn, make_loss_fn
from pmd_jax.distill.registry import LESSON_KEYS
from pmd_jax.models import decoder
from pmd_jax.models import lora as lora_lib
from pmd_jax.models.config import ModelConfig
from pmd_jax.run import sharding as shd

Array = jax.Array

# The leaf type of a TrainState tree: the arrays of a state (the default), or, for a tree of
# the same structure, their NamedShardings (state_shardings) or ShapeDtypeStructs
# (abstract_state). typing_extensions: TypeVar defaults are Python 3.13 typing.
Leaf = TypeVar("Leaf", default=Array)

# The adapters' init key: folded out of the init RNG with this stream number, so the state's
# own RNG key (and every draw made from it) is the same with and without LoRA.
LORA_INIT_STREAM = 0x4C6F5241


@struct.dataclass
class TrainState(Generic[Leaf]):
    step: Leaf  # int32 scalar: number of steps taken
    params: Any  # master weights (fp32) or params in param_dtype (LoRA: the adapters)
    opt_state: Any
    teacher: Any  # EMA / frozen / trust-region reference params (LoRA: adapters); {} for live
    rng: Leaf  # uint32[2] raw PRNG key data


def apply_update(o: StepOptions, state: TrainState, loss: Array, metrics: Mapping[str, Array],
                 grads: Any) -> tuple[TrainState, dict[str, Array]]:
    """:func:`apply_update_and_clip` without the clipped gradient."""
    return apply_update_and_clip(o, state, loss, metrics, grads)[:2]


def apply_update_and_clip(o: StepOptions, state: TrainState, loss: Array,
                          metrics: Mapping[str, Array], grads: Any
                          ) -> tuple[TrainState, dict[str, Array], Any]:
    """The new state and the step's metrics from the loss, its metrics and the gradient: global
    norm clip, AdamW, the EMA teacher and the non-finite skip in one fused pass, the step counter
    and the RNG key advanced. Pure; :class:`TrainStep` jits it after the gradient."""
    # clip + AdamW + EMA teacher + non-finite skip in one pass per parameter (optim.py:
    # the optax chain made XLA:CPU copy params and moments before updating them)
    ema = o.keeps_teacher and o.rule == "ema"
    upd = doptim.fused_update(
        o.optim, grads, state.opt_state, state.params, loss=loss,
        skip_nonfinite=o.skip_nonfinite,
        ema_teacher=state.teacher if ema else None,
        ema_rate=tlib.check_rate(o.rate, o.rule) if ema else None,
    )
    params = _cast(upd.params, o.storage_dtype)
    opt_state = upd.opt_state
    teacher = upd.teacher if ema else state.teacher
    grad_norm, finite = upd.grad_norm, upd.finite
    skipped = (1.0 - finite.astype(jnp.float32)) if o.skip_nonfinite else jnp.float32(0.0)
    rng, _ = jax.random.split(jax.random.wrap_key_data(state.rng))
    new_state = TrainState(
        step=state.step + 1, params=params, opt_state=opt_state, teacher=teacher,
        rng=jax.random.key_data(rng),
    )
    metrics = dict(metrics)
    metrics.update(
        loss=loss,
        grad_norm=grad_norm,
        lr=doptim.learning_rate_at(o.optim, state.step),
        finite=finite.astype(jnp.float32),
        skipped=skipped,
    )
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return new_state, metrics, upd.clipped_grads


class TrainStep:
    """The train step for one model config, distill config and (optional) mesh."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        distill_cfg: DistillConfig,
        *,
        mesh: Mesh | None = None,
        rules: shd.ShardingRules | None = None,
        donate: bool = True,
        loss_chunk_remat: bool = True,
        microbatch_rows: int = 0,
        lesson_nll_weight: float = 1.0,
        shared_prefix: str = "off",
        trains: bool = True,
        lora: lora_lib.LoraConfig | None = None,
        base_dtype: str = "",
    ):
        self.model_cfg = model_cfg
        # LoRA: the state trains the adapters; the frozen base (in base_dtype; '' = as
        # given) is an argument of every program (module docstring)
        if lora is not None and not isinstance(lora, lora_lib.LoraConfig):
            raise TypeError(f"lora must be a models.lora.LoraConfig, got {type(lora).__name__}")
        if lora is not None and not trains:
            raise ValueError("lora needs trains=True: a step whose weights never change has no "
                             "adapters to train")
        self.lora = lora
        if base_dtype not in ("", "float32", "bfloat16", "float16"):
            raise ValueError(f"base_dtype={base_dtype!r} is not '', float32, bfloat16 or "
                             "float16")
        self.base_dtype = base_dtype
        # trains=False (a mode whose weights never change, e.g. memory_only): the state holds
        # the params only, no AdamW moments or teacher copy (Qwen2.5-Coder-0.5B: 7 of its
        # 9.4 GiB, in memory and in every checkpoint); step() refuses to run.
        self.trains = bool(trains)
        self.opts = StepOptions.from_config(distill_cfg, model_cfg.vocab_size)
        self.mesh = mesh
        self.rules = rules if rules is not None else shd.ShardingRules.from_mapping()
        self.donate = donate
        self.optimizer = doptim.make_optimizer(self.opts.optim)
        shard_ctx = (mesh, self.rules) if mesh is not None else None
        self.loss_fn = make_loss_fn(model_cfg, self.opts, shard_ctx,
                                    loss_chunk_remat=loss_chunk_remat, lora=lora)
        self.lesson_nll_weight = float(lesson_nll_weight)
        self.lesson_nll_fn = (make_lesson_nll_fn(model_cfg, self.opts, shard_ctx,
                                                 loss_chunk_remat=loss_chunk_remat, lora=lora)
                              if self.opts.loss_spec.lesson_nll else None)
        self._compiled: dict[tuple, Any] = {}
        self._state_shardings: TrainState[NamedSharding] | None = None
        # gradient accumulation (train.microbatch_rows; 0 = off): checked against the mesh now
        self.microbatch_rows = int(microbatch_rows)
        accumulate.check_microbatch_rows(self.microbatch_rows, self.microbatch_unit())
        # shared-prefix rows (train.shared_prefix): microbatches split rollout rows
        if shared_prefix not in spx.MODES:
            raise ValueError(f"shared_prefix={shared_prefix!r} is not one of {spx.MODES}")
        if shared_prefix == "always" and self.microbatch_rows:
            raise ValueError("shared_prefix='always' cannot be combined with microbatch_rows "
                             f"({self.microbatch_rows}): microbatches split rollout rows")
        self.shared_prefix = "off" if self.microbatch_rows else shared_prefix

    def pack(self, batch: Mapping[str, Any], sides: tuple[str, ...] | None = None
             ) -> tuple[dict[str, Any], dict[str, float]]:
        """The host batch with its sides in shared-prefix rows where ``shared_prefix`` says so
        (:mod:`pmd_jax.distill.shared_prefix`; ``sides``: default both sides the loss reads),
        and the rows and slots each side's forward gets."""
        if sides is None:
            sides = ("student", "teacher") if self.opts.needs_teacher else ("student",)
        return spx.share_prefixes(batch, self.model_cfg, mode=self.shared_prefix, sides=sides,
                                  row_multiple=self.batch_divisor())

    def microbatch_unit(self) -> int:
        """A microbatch must be a multiple of this: the mesh's batch axes x the GRPO group."""
        group = self.opts.group_size if self.opts.group_size_matters else 1
        return math.lcm(self.batch_divisor(), group)

    def num_microbatches(self, rows: int) -> int:
        """How many microbatches a batch of ``rows`` is split into (1: no accumulation)."""
        return rows // accumulate.microbatch_size(rows, self.microbatch_rows,
                                                  self.microbatch_unit())

    # ------------------------------------------------------------- shardings
    def _named(self, spec: PartitionSpec) -> NamedSharding:
        assert self.mesh is not None
        return NamedSharding(self.mesh, spec)

    def state_shardings(self) -> TrainState[NamedSharding] | None:
        """NamedShardings for every TrainState leaf (None without a mesh)."""
        return None if self.mesh is None else self._mesh_state_shardings()

    def _mesh_state_shardings(self) -> TrainState[NamedSharding]:
        """:meth:`state_shardings` of a step with a mesh (built once)."""
        assert self.mesh is not None
        if self._state_shardings is None:
            p_sh = shd.tree_shardings(self.mesh, self.rules, self._trained_axes())
            abstract = jax.eval_shape(self._init_host, self._abstract_params(),
                                      jax.ShapeDtypeStruct((2,), jnp.uint32))
            rep = self._named(PartitionSpec())
            opt_sh = optax.tree_map_params(
                self.optimizer, lambda _, s: s, abstract.opt_state, p_sh,
                transform_non_params=lambda _: rep,
            ) if self.trains else {}
            teacher_sh = p_sh if self.opts.keeps_teacher and self.trains else {}
            self._state_shardings = TrainState(
                step=rep, params=p_sh, opt_state=opt_sh, teacher=teacher_sh, rng=rep
            )
        return self._state_shardings

    def _trained_axes(self) -> Any:
        """Logical axes of the trained tree: the params', or the adapters' under LoRA."""
        if self.lora is not None:
            return lora_lib.adapter_axes(self.model_cfg, self.lora)
        return decoder.param_axes(self.model_cfg)

    def _abstract_params(self) -> Any:
        if self.lora is not None:
            return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
                                lora_lib.adapter_shapes(self.model_cfg, self.lora),
                                is_leaf=lambda x: isinstance(x, tuple))
        return jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32),
            decoder.param_shapes(self.model_cfg),
        )

    def base_shardings(self) -> Any:
        """NamedShardings of the frozen base (the params' rules; None without a mesh)."""
        if self.mesh is None:
            return None
        return shd.tree_shardings(self.mesh, self.rules, decoder.param_axes(self.model_cfg))

    def abstract_base(self) -> Any:
        """ShapeDtypeStructs (with shardings on a mesh) of the placed base (LoRA), for
        :meth:`lower`; ``base_dtype`` '' reads as the model's ``param_dtype``."""
        dt = jnp.dtype(self.base_dtype or self.model_cfg.param_dtype)
        shapes = decoder.param_shapes(self.model_cfg)
        sh = self.base_shardings()
        if sh is None:
            return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dt), shapes)
        return jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, dt, sharding=h),
                            shapes, sh)

    def place_base(self, params: Any) -> Any:
        """The frozen base of a LoRA step: ``params`` cast to ``base_dtype`` (no copy when
        they are in it already, or ``base_dtype`` is '') and placed like the params."""
        if self.lora is None:
            raise ValueError("place_base: this TrainStep has no lora (full fine-tuning)")
        decoder.check_params(params, self.model_cfg)
        dt = jnp.dtype(self.base_dtype) if self.base_dtype else None
        same = dt is None or all(x.dtype == dt for x in jax.tree.leaves(params))
        if self.mesh is None:
            return params if same else jax.jit(lambda p: _cast(p, dt))(params)
        sh = self.base_shardings()
        shd.check_divisible(self.mesh, self.rules, params, decoder.param_axes(self.model_cfg))
        params = jax.device_put(params, sh)
        return params if same else jax.jit(lambda p: _cast(p, dt), out_shardings=sh)(params)

    def batch_shardings(self, batch: Mapping[str, Any]) -> dict[str, NamedSharding] | None:
        if self.mesh is None:
            return None
        out = {}
        for k, v in batch.items():
            axes = ("batch",) if np.ndim(v) == 1 else ("batch", "seq")
            out[k] = self._named(self.rules.spec(axes))
        return out

    # ------------------------------------------------------------- init
    def _init_host(self, params: Any, rng: Array) -> TrainState:
        if self.lora is not None:  # the adapters are what trains (``params`` is unused)
            key = jax.random.fold_in(jax.random.wrap_key_data(jnp.asarray(rng, jnp.uint32)),
                                     LORA_INIT_STREAM)
            params = lora_lib.init_adapters(self.model_cfg, self.lora, key)
        master = _cast(params, self.opts.storage_dtype)
        teacher = None
        if self.opts.keeps_teacher and self.trains:
            teacher = tlib.init_teacher(self.opts.rule, params, jnp.dtype(self.opts.teacher_dtype))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=master,
            opt_state=self.optimizer.init(master) if self.trains else {},
            teacher={} if teacher is None else teacher,
            rng=jnp.asarray(rng, jnp.uint32),
        )

    def init(self, params: Any, rng: Array | int = 0) -> TrainState:
        """The initial TrainState (placed on the mesh when there is one). LoRA: the adapters'
        state (``params`` is not read: the base goes to :meth:`place_base`)."""
        if isinstance(rng, int):
            rng = jax.random.key_data(jax.random.PRNGKey(rng))
        elif jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
            rng = jax.random.key_data(rng)
        if self.lora is not None:
            return jax.jit(self._init_host, out_shardings=self.state_shardings())(None, rng)
        if self.mesh is None:
            return jax.jit(self._init_host)(params, rng)
        p_sh = self._mesh_state_shardings().params
        shd.check_divisible(self.mesh, self.rules, params, decoder.param_axes(self.model_cfg))
        params = jax.device_put(params, p_sh)
        return jax.jit(self._init_host, out_shardings=self.state_shardings())(params, rng)

    # ------------------------------------------------------------- step
    def _step(self, state: TrainState, batch: dict[str, Array], base: Any = None
              ) -> tuple[TrainState, dict]:
        """The function jitted per batch layout: loss and gradient, then :func:`apply_update`
        (``base``: the frozen base of a LoRA step, else None)."""
        return apply_update(self.opts, state,
                            *self._loss_and_grads(state.params, state.teacher, batch, base))

    def _loss_and_grads(self, params: Any, teacher: Any, batch: dict[str, Array],
                        base: Any = None) -> tuple[Array, dict, Any]:
        """The loss, its metrics and its gradient w.r.t. ``params`` (accumulated over
        microbatches, plus the lesson NLL's for ``mel``); reads no optimizer state. LoRA:
        ``params`` are the adapters and ``base`` the frozen params (no gradient)."""
        if base is not None:
            loss_fn = functools.partial(self.loss_fn, base=base)
            nll_fn = (None if self.lesson_nll_fn is None
                      else functools.partial(self.lesson_nll_fn, base=base))
            return self._loss_and_grads_of(loss_fn, nll_fn, params, teacher, batch)
        return self._loss_and_grads_of(self.loss_fn, self.lesson_nll_fn, params, teacher, batch)

    def _loss_and_grads_of(self, loss_fn: Any, nll_fn: Any, params: Any, teacher: Any,
                           batch: dict[str, Array]) -> tuple[Array, dict, Any]:
        lessons = None
        if self.lesson_nll_fn is not None:  # mode=mel: the lesson rows, outside the split
            lessons = {k: batch[k] for k in LESSON_KEYS}
            batch = {k: v for k, v in batch.items() if k not in LESSON_KEYS}
        n_micro = self.num_microbatches(batch["response_mask"].shape[0])
        if n_micro > 1:
            (loss, metrics), grads = self._accumulated(loss_fn, params, teacher, batch, n_micro)
        else:
            grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
            (loss, metrics), grads = grad_fn(params, teacher, batch)
        if lessons is not None:
            loss, metrics, grads = self._add_lesson_nll(nll_fn, params, lessons, loss, metrics,
                                                        grads)
        return loss, metrics, grads

    def _add_lesson_nll(self, nll_fn: Any, params: Any, lessons: dict[str, Array],
                        loss: Array, metrics: Mapping[str, Array], grads: Any
                        ) -> tuple[Array, dict, Any]:
        """``loss + w * NLL(lessons)`` and its gradient (``w = lesson_nll_weight``); with
        ``w = 0`` the NLL is only measured (loss and gradient are the GRPO ones, bitwise)."""
        assert nll_fn is not None
        w = self.lesson_nll_weight
        metrics = {**metrics, "grpo_loss": loss}
        if w == 0.0:
            _, m = nll_fn(jax.lax.stop_gradient(params), lessons)
            return loss, {**metrics, **m}, grads
        (nll, m), g = jax.value_and_grad(nll_fn, has_aux=True)(params, lessons)
        grads = jax.tree.map(lambda a, b: (a.astype(jnp.float32) + w * b.astype(jnp.float32)
                                           ).astype(a.dtype), grads, g)
        return loss + w * nll, {**metrics, **m}, grads

    def _accumulated(self, loss_fn: Any, params: Any, teacher: Any, batch: dict[str, Array],
                     n: int) -> Any:
        """Loss, metrics and gradient of the whole batch from ``n`` microbatches."""
        sharding = grad_sh = None
        if self.mesh is not None:
            s2, s1 = self.rules.spec(("batch", "seq")), self.rules.spec(("batch",))
            sharding = lambda nd: self._named(accumulate.mesh_spec(s2, s1, nd))  # noqa: E731
            grad_sh = self._mesh_state_shardings().params
        return accumulate.accumulated_value_and_grad(
            loss_fn, params, teacher, batch, loss_name=self.opts.loss_name, n=n,
            sharding=sharding, grad_sharding=grad_sh)

    def _update(self, state: TrainState, loss: Array, metrics: dict[str, Array], grads: Any
                ) -> tuple[TrainState, dict, Any]:
        """:func:`apply_update`, returning the clipped gradient too: the caller drops it, and
        with the gradient donated XLA writes it over the gradient's buffer (without it, the
        clipped gradient is a temporary the size of the weights: 2.35 GiB on the 0.5B coder,
        measured with ``memory_analysis()``)."""
        return apply_update_and_clip(self.opts, state, loss, metrics, grads)

    def _base_in_shardings(self) -> tuple[Any, ...]:
        """The base's in_shardings entry of a program (LoRA), else nothing."""
        return (self.base_shardings(),) if self.lora is not None else ()

    def _get_compiled(self, batch: Mapping[str, Any]) -> Any:
        key = tuple(sorted(batch))
        if key not in self._compiled:
            donate = (0,) if self.donate else ()
            if self.mesh is None:
                fn = jax.jit(self._step, donate_argnums=donate)
            else:
                st = self.state_shardings()
                rep = self._named(PartitionSpec())
                fn = jax.jit(
                    self._step,
                    in_shardings=(st, self.batch_shardings(batch), *self._base_in_shardings()),
                    out_shardings=(st, rep),
                    donate_argnums=donate,
                )
            self._compiled[key] = fn
        return self._compiled[key]

    def _get_grad_program(self, batch: Mapping[str, Any]) -> Any:
        """:meth:`_loss_and_grads` jitted per batch layout (:meth:`gradients`); nothing
        donated: the update reads params and teacher again."""
        key = ("grads",) + tuple(sorted(batch))
        if key not in self._compiled:
            if self.mesh is None:
                fn = jax.jit(self._loss_and_grads)
            else:
                st = self._mesh_state_shardings()
                rep = self._named(PartitionSpec())
                fn = jax.jit(self._loss_and_grads,
                             in_shardings=(st.params, st.teacher, self.batch_shardings(batch),
                                           *self._base_in_shardings()),
                             out_shardings=(rep, rep, st.params))
            self._compiled[key] = fn
        return self._compiled[key]

    def _get_update_program(self) -> Any:
        """:meth:`_update` jitted (:meth:`apply_gradients`): state and gradient donated."""
        key = ("update",)
        if key not in self._compiled:
            donate = (0, 3) if self.donate else ()
            if self.mesh is None:
                fn = jax.jit(self._update, donate_argnums=donate)
            else:
                st = self._mesh_state_shardings()
                rep = self._named(PartitionSpec())
                fn = jax.jit(self._update, in_shardings=(st, rep, rep, st.params),
                             out_shardings=(st, rep, st.params), donate_argnums=donate)
            self._compiled[key] = fn
        return self._compiled[key]

    def batch_divisor(self) -> int:
        """The batch size must be a multiple of this (the mesh's batch axes; 1 unsharded)."""
        if self.mesh is None:
            return 1
        spec = self.rules.spec(("batch",))[0]
        if spec is None:
            return 1
        axes = (spec,) if isinstance(spec, str) else spec
        return int(np.prod([self.mesh.shape[a] for a in axes]))

    def _check_batch_divisible(self, b: int) -> None:
        n = self.batch_divisor()
        if b % n:
            spec = self.rules.spec(("batch",))[0]
            axes = (spec,) if isinstance(spec, str) else spec
            raise BatchError(
                f"batch size {b} is not divisible by the mesh's batch axes {axes} (size {n})"
            )

    def __call__(self, state: TrainState, batch: Mapping[str, Any], base: Any = None
                 ) -> tuple[TrainState, dict]:
        return self.step(state, batch, base)

    def _base_args(self, base: Any) -> tuple[Any, ...]:
        """``(base,)`` for a LoRA step (which needs it), ``()`` otherwise (which takes none)."""
        if self.lora is None:
            if base is not None:
                raise ValueError("base= is for a LoRA step; this TrainStep trains the full "
                                 "params (lora=None)")
            return ()
        if base is None:
            raise ValueError("a LoRA TrainStep needs the frozen base params: pass "
                             "base=TrainStep.place_base(params)")
        return (base,)

    def step(self, state: TrainState, batch: Mapping[str, Any], base: Any = None
             ) -> tuple[TrainState, dict]:
        """One update; raises :class:`BatchError` on a malformed batch before any compute.
        ``base``: the frozen base params of a LoRA step (:meth:`place_base`), else None."""
        if not self.trains:
            raise ValueError("this TrainStep was built with trains=False (a mode whose weights "
                             "never change): its state has no optimizer to update")
        extra = self._base_args(base)
        batch = self._checked(batch)
        return self._get_compiled(batch)(state, batch, *extra)

    def gradients(self, params: Any, teacher: Any, batch: Mapping[str, Any], base: Any = None
                  ) -> tuple[Array, dict, Any]:
        """The first half of :meth:`step` as its own program: the loss, its metrics and the
        gradient, computed to the end before returning. It reads params and teacher only, so
        the optimizer state may wait elsewhere meanwhile
        (``train.offload_optimizer_during_grads``); :meth:`apply_gradients` is the rest.
        ``base`` as in :meth:`step`."""
        extra = self._base_args(base)
        batch = self._checked(batch)
        return jax.block_until_ready(self._get_grad_program(batch)(params, teacher, batch,
                                                                   *extra))

    def apply_gradients(self, state: TrainState, loss: Array, metrics: dict[str, Array],
                        grads: Any) -> tuple[TrainState, dict]:
        """The second half of :meth:`step`: clip, AdamW, the EMA teacher and the non-finite
        skip (:func:`apply_update`) on what :meth:`gradients` returned; the state and the
        gradient are donated."""
        if state.opt_state is None:
            raise ValueError("apply_gradients needs the optimizer state, and the state has "
                             "none (still offloaded?)")
        new_state, new_metrics, _ = self._get_update_program()(state, loss, metrics, grads)
        return new_state, new_metrics

    def _checked(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The batch the programs get, after its checks (:class:`BatchError` names a
        problem before any compute)."""
        spec = self.opts.loss_spec
        b, _, _, _ = check_batch(batch, spec)
        self._check_batch_divisible(b)
        if spec.needs_rewards:
            if b % self.opts.group_size:
                raise BatchError(
                    f"batch size {b} is not a multiple of loss.group_size={self.opts.group_size}"
                )
        if not spec.needs_teacher:
            batch = {k: v for k, v in batch.items() if not k.startswith("teacher_")}
        if spec.lesson_nll:
            self._check_batch_divisible(int(np.shape(batch["lesson_tokens"])[0]))
        return dict(batch)

    def lower(self, state: Any, batch: Mapping[str, Any], base: Any = None) -> Any:
        """``jax.jit(...).lower`` on (abstract) state and batch, for dry-run compiles (a LoRA
        step: and base, e.g. :meth:`abstract_base`)."""
        check_batch(batch, self.opts.loss_spec)
        return self._get_compiled(batch).lower(state, dict(batch), *self._base_args(base))

    def merged_params(self, state: TrainState, base: Any) -> Any:
        """LoRA: the policy as plain params in the compute dtype, each target ``W + scaling *
        A B`` (:func:`pmd_jax.models.lora.merge`, summed in float32): what the sampler and the
        HF export get. One jitted program (placed like the params on a mesh)."""
        if self.lora is None:
            raise ValueError("merged_params: this TrainStep has no lora (use compute_params)")
        key = ("merge",)
        if key not in self._compiled:
            cfg, lc, dt = self.model_cfg, self.lora, jnp.dtype(self.opts.param_dtype)

            def merge(adapters: Any, base: Any) -> Any:
                return lora_lib.merge(_cast(base, dt), _cast(adapters, dt), cfg, lc)

            self._compiled[key] = jax.jit(merge, out_shardings=self.base_shardings())
        return self._compiled[key](state.params, base)

    def abstract_state(self) -> TrainState[jax.ShapeDtypeStruct]:
        """ShapeDtypeStructs (with shardings on a mesh) of the TrainState, no allocation."""
        abstract = jax.eval_shape(self._init_host, self._abstract_params(),
                                  jax.ShapeDtypeStruct((2,), jnp.uint32))
        sh = self.state_shardings()
        if sh is None:
            return abstract
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, sh
        )


def compute_params(state: TrainState, distill_cfg: DistillConfig) -> Any:
    """The params in the compute dtype (what the sampler / an HF export should receive)."""
    return _cast(state.params, jnp.dtype(distill_cfg.precision.param_dtype))
