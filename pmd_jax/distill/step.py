"""The jitted, sharded distillation train step (SDPO / GRPO / hybrid share one code path).

``TrainStep(model_cfg, distill_cfg, mesh=..., rules=...)`` builds:

* ``init(params, rng) -> TrainState``: fp32 master weights (or params in ``param_dtype``),
  optimizer state, the teacher tree (EMA copy, frozen initial params, or the trust-region
  reference; none for the live teacher), step counter and RNG key data, placed on the mesh;
* ``step(state, batch) -> (state, metrics)``: one ``jax.jit`` call with in/out shardings from
  the logical-axis rules, the state donated (params, optimizer state, teacher).

``microbatch_rows=N`` (``train.microbatch_rows``; 0 = off): gradient accumulation inside the
same jitted step, a ``lax.scan`` over microbatches of N rows with full-batch loss
normalisation, then one optimizer update (:mod:`pmd_jax.distill.accumulate`).

One step: student forward (``return_hidden``) on student prompt + response; teacher
forward(s) with ``stop_gradient`` params on teacher prompt + the same response; gather the
response positions on both sides (:mod:`pmd_jax.distill.align` indices); the chunked loss from
hidden states and unembedding matrices (:mod:`pmd_jax.distill.chunked`, no full
``[B, T, V]`` logits); gradient, global-norm clip, AdamW; the teacher update (EMA); a
non-finite loss or gradient leaves params, optimizer state and teacher unchanged
(``optim.skip_nonfinite``) and reports ``metrics["skipped"] = 1``.

Batch (a dict of arrays; ``B`` samples, ``Ts``/``Tt`` student/teacher sequence lengths, ``R``
response slots), built on the host by :func:`make_batch` from an
:class:`pmd_jax.distill.align.DistillBatch`:

=====================  ==========  ==========================================================
``student_tokens``     [B, Ts]     student prompt + response, padded
``student_positions``  [B, Ts]     position ids
``student_attn_mask``  [B, Ts]     1 on real tokens
``student_index``      [B, R]      position of the student logits predicting response token t
``teacher_tokens``     [B, Tt]     teacher prompt + the same response, padded
``teacher_positions``  [B, Tt]
``teacher_attn_mask``  [B, Tt]
``teacher_index``      [B, R]
``responses``          [B, R]      the response tokens (targets)
``response_mask``      [B, R]      1 for t < response length
``sd_mask``            [B]         self-distillation mask (1 iff the sample was reprompted)
``sampler_logp``       [B, R]      optional: the sampler's log-probs of the response tokens
``old_logp``           [B, R]      optional: old-policy log-probs (off-policy ratio); absent
                                   means on-policy (ratio 1, verl's old := stopgrad(logp))
``rewards``            [B]         grpo / hybrid: rewards, prompt-major groups of group_size
=====================  ==========  ==========================================================

Metrics: ``loss``, ``kl`` (per-token reverse KL(student||teacher) over the loss mask),
``top1_agree``, ``entropy``, ``grad_norm`` (before clipping), ``lr``,
``masked_sample_fraction``, ``logp_mismatch_mean`` / ``logp_mismatch_max`` (|trainer - sampler|
log-probs over response tokens), ``clip_frac`` (PPO clip for grpo/hybrid, IS-ratio clip for
sdpo), ``rollout_is_clip_frac``, ``num_loss_tokens``, ``skipped``, ``finite``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pmd_jax import sharding as shd
from pmd_jax.distill import accumulate, align, chunked, losses, sharded_topk
from pmd_jax.distill import config as dconfig
from pmd_jax.distill import optim as doptim
from pmd_jax.distill import teacher as tlib
from pmd_jax.models import decoder
from pmd_jax.models.config import ModelConfig

Array = jax.Array

SEQ_KEYS = {
    "student": ("student_tokens", "student_positions", "student_attn_mask"),
    "teacher": ("teacher_tokens", "teacher_positions", "teacher_attn_mask"),
}
RESPONSE_KEYS = ("student_index", "teacher_index", "responses", "response_mask")
OPTIONAL_RESPONSE_KEYS = ("sampler_logp", "old_logp")
SAMPLE_KEYS = ("sd_mask", "rewards")


class BatchError(ValueError):
    """A train batch is malformed; the message names the array and the shapes."""


@struct.dataclass
class TrainState:
    step: Array  # int32 scalar: number of steps taken
    params: Any  # master weights (fp32) or params in param_dtype
    opt_state: Any
    teacher: Any  # EMA / frozen / trust-region reference params; {} for the live teacher
    rng: Array  # uint32[2] raw PRNG key data


# --------------------------------------------------------------------------------------------
# batch
# --------------------------------------------------------------------------------------------


def make_batch(
    db: align.DistillBatch,
    *,
    sd_mask: Any | None = None,
    sampler_logp: Any | None = None,
    old_logp: Any | None = None,
    rewards: Any | None = None,
) -> dict[str, np.ndarray]:
    """The step's batch dict from an aligned :class:`~pmd_jax.distill.align.DistillBatch`.

    ``sampler_logp`` / ``old_logp``: ``[B, R]`` per response token (right-padded like
    ``db.responses``); ``sd_mask`` / ``rewards``: ``[B]``. ``sd_mask=None`` means all ones.
    """
    b, r = db.responses.shape
    out: dict[str, np.ndarray] = {
        "student_tokens": db.student.tokens,
        "student_positions": db.student.positions,
        "student_attn_mask": db.student.attention_mask,
        "student_index": db.student.logit_index,
        "teacher_tokens": db.teacher.tokens,
        "teacher_positions": db.teacher.positions,
        "teacher_attn_mask": db.teacher.attention_mask,
        "teacher_index": db.teacher.logit_index,
        "responses": db.responses,
        "response_mask": db.response_mask,
        "sd_mask": np.ones((b,), np.float32) if sd_mask is None
        else np.asarray(sd_mask, np.float32),
    }
    for name, val in (("sampler_logp", sampler_logp), ("old_logp", old_logp)):
        if val is not None:
            a = np.asarray(val, np.float32)
            if a.shape != (b, r):
                raise BatchError(f"{name} must be [B, R]={(b, r)}, got shape {a.shape}")
            out[name] = a
    if rewards is not None:
        out["rewards"] = np.asarray(rewards, np.float32)
    return out


def check_batch(batch: Mapping[str, Any], mode: str) -> tuple[int, int, int, int]:
    """Check keys and shapes before any compute; returns ``(B, Ts, Tt, R)``."""
    need = [*SEQ_KEYS["student"], *RESPONSE_KEYS, "sd_mask"]
    if mode != "grpo":
        need += [*SEQ_KEYS["teacher"]]
    if mode in ("grpo", "hybrid"):
        need.append("rewards")
    missing = [k for k in need if k not in batch]
    if missing:
        raise BatchError(f"batch is missing {missing} (loss mode {mode!r})")
    known = set(need) | set(SEQ_KEYS["teacher"]) | set(OPTIONAL_RESPONSE_KEYS) | {"rewards"}
    unknown = sorted(set(batch) - known)
    if unknown:
        raise BatchError(f"batch has unknown arrays {unknown}")

    def shape(k: str) -> tuple[int, ...]:
        x = batch[k]
        return tuple(x.shape) if hasattr(x, "shape") else tuple(np.shape(x))

    s_shape = shape("student_tokens")
    if len(s_shape) != 2:
        raise BatchError(f"student_tokens must be [B, Ts], got shape {s_shape}")
    b, ts = s_shape
    for k in SEQ_KEYS["student"]:
        if shape(k) != s_shape:
            raise BatchError(f"{k} has shape {shape(k)}, student_tokens has {s_shape}")
    tt = 0
    if "teacher_tokens" in batch:
        t_shape = shape("teacher_tokens")
        if len(t_shape) != 2:
            raise BatchError(f"teacher_tokens must be [B, Tt], got shape {t_shape}")
        if t_shape[0] != b:
            raise BatchError(
                f"student and teacher batches differ in batch size: student_tokens {s_shape}, "
                f"teacher_tokens {t_shape}"
            )
        tt = t_shape[1]
        for k in SEQ_KEYS["teacher"]:
            if shape(k) != t_shape:
                raise BatchError(f"{k} has shape {shape(k)}, teacher_tokens has {t_shape}")
    r_shape = shape("responses")
    if len(r_shape) != 2 or r_shape[0] != b:
        raise BatchError(f"responses must be [B={b}, R], got shape {r_shape}")
    r = r_shape[1]
    for k in (*RESPONSE_KEYS, *OPTIONAL_RESPONSE_KEYS):
        if k in batch and shape(k) != r_shape:
            raise BatchError(
                f"{k} has shape {shape(k)} but responses has {r_shape} (student and teacher "
                "response index maps must both be [B, R])"
            )
    for k in SAMPLE_KEYS:
        if k in batch and shape(k) != (b,):
            raise BatchError(f"{k} must be [B]={(b,)}, got shape {shape(k)}")
    if ts < 2 or (mode != "grpo" and tt < 2):
        raise BatchError(f"sequences too short: student {ts}, teacher {tt} (need >= 2)")
    for k in ("student_tokens", "teacher_tokens", "responses", "student_index", "teacher_index"):
        if k in batch:
            dt = getattr(batch[k], "dtype", None) or np.asarray(batch[k]).dtype
            if not jnp.issubdtype(dt, jnp.integer):
                raise BatchError(f"{k} must be an integer array, got {dt}")
    return b, ts, tt, r


# --------------------------------------------------------------------------------------------
# the step
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static settings of the step, read once from the ConfigDict."""

    mode: str
    loss: losses.DistillLossConfig
    rule: str
    rate: float
    teacher_dtype: str
    rollout_is_threshold: float | None
    clip_low: float
    clip_high: float
    clip_ratio_c: float | None
    hybrid_lambda: float
    group_size: int
    chunk: int
    param_dtype: str
    master_weights: bool
    remat: str
    unrolled_layers: bool
    matmul_dtype: str | None
    skip_nonfinite: bool
    optim: doptim.OptimConfig

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict, vocab_size: int) -> StepOptions:
        dconfig.validate_distill_config(c, vocab_size=vocab_size)
        return cls(
            mode=c.loss.mode,
            loss=dconfig.loss_config(c).validate(vocab_size=vocab_size),
            rule=c.teacher.rule,
            rate=float(c.teacher.rate),
            teacher_dtype=c.teacher.dtype,
            rollout_is_threshold=None if c.loss.rollout_is_threshold is None
            else float(c.loss.rollout_is_threshold),
            clip_low=float(c.loss.grpo_clip_low),
            clip_high=float(c.loss.grpo_clip_high),
            clip_ratio_c=None if c.loss.grpo_clip_ratio_c is None
            else float(c.loss.grpo_clip_ratio_c),
            hybrid_lambda=float(c.loss.hybrid_lambda),
            group_size=int(c.loss.group_size),
            chunk=int(c.loss.chunk_size),
            param_dtype=c.precision.param_dtype,
            master_weights=bool(c.precision.master_weights),
            remat=c.precision.remat_policy if c.precision.remat else "none",
            unrolled_layers=c.precision.layer_loop == "unrolled",
            matmul_dtype=c.precision.matmul_dtype or None,
            skip_nonfinite=bool(c.optim.skip_nonfinite),
            optim=dconfig.optim_config(c),
        )

    @property
    def storage_dtype(self) -> Any:
        if self.master_weights:
            return jnp.float32
        return jnp.dtype(self.param_dtype)

    @property
    def needs_teacher(self) -> bool:
        return self.mode != "grpo"

    @property
    def keeps_teacher(self) -> bool:
        """A teacher tree lives in the state (not for grpo, nor for the live teacher)."""
        return self.needs_teacher and tlib.keeps_copy(self.rule)


def _cast(tree: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda x: x if x.dtype == dtype else x.astype(dtype), tree)


def _masked_max(x: Array, mask: Array) -> Array:
    return jnp.max(jnp.where(mask > 0, x, 0.0), initial=0.0)


def _unembed(params: Any, model_cfg: ModelConfig) -> Array:
    """The unembedding for the chunked loss: the ``[V, D]`` embedding table itself when tied
    (``vocab_major``; no transposed copy), else the ``[D, V]`` LM head."""
    if model_cfg.tie_embeddings:
        return params["embed"]
    return decoder.unembed_matrix(params, model_cfg)


def make_loss_fn(
    model_cfg: ModelConfig, opts: StepOptions, shard_ctx: Any = None, *,
    loss_chunk_remat: bool = True,
):
    """``loss_fn(params, teacher, batch) -> (loss, metrics)``; differentiate w.r.t. params.

    ``params``: the stored (master) params; ``teacher``: the teacher state of ``opts.rule``.
    ``loss_chunk_remat=False`` keeps the per-chunk logits for the backward pass instead of
    recomputing them (:func:`pmd_jax.distill.chunked.chunked_distill_stats`).
    Exposed for tests (teacher gradients are zero) and for custom loops.
    """
    compute_dtype = jnp.dtype(opts.param_dtype)
    remat = opts.remat
    if opts.matmul_dtype is not None:
        model_cfg = model_cfg.replace(matmul_dtype=opts.matmul_dtype)
    mm_dtype = model_cfg.matmul_dtype
    vocab_major = model_cfg.tie_embeddings
    # top-K over a tensor-sharded vocabulary without all-gathering each logits chunk
    topk_indices = (sharded_topk.make_topk_indices(*shard_ctx) if shard_ctx is not None
                    else None)

    def fwd_hidden(params: Any, side: str, batch: Mapping[str, Array]) -> Array:
        if opts.unrolled_layers:  # per-layer slices (gradients concatenated back)
            params = decoder.unstack_layers(params)
        h, _ = decoder.forward(
            params,
            batch[f"{side}_tokens"].astype(jnp.int32),
            batch[f"{side}_positions"].astype(jnp.int32),
            model_cfg,
            attn_mask=batch[f"{side}_attn_mask"],
            return_hidden=True,
            remat=remat,
            shard_ctx=shard_ctx,
        )
        return align.gather_response(h, batch[f"{side}_index"])

    def loss_fn(params: Any, teacher: Any, batch: Mapping[str, Array]) -> tuple[Array, dict]:
        p = _cast(params, compute_dtype)
        s_h = fwd_hidden(p, "student", batch)
        w_s = _unembed(p, model_cfg)
        tokens = batch["responses"].astype(jnp.int32)
        rmask = batch["response_mask"].astype(jnp.float32)
        sd_mask = batch["sd_mask"].astype(jnp.float32)
        old = batch.get("old_logp")
        sampler = batch.get("sampler_logp")
        lc = opts.loss
        metrics: dict[str, Array] = {}

        if opts.needs_teacher:
            trees = tlib.teacher_param_trees(opts.rule, teacher, params)
            trees = tuple(_cast(t, compute_dtype) for t in trees)
            cur = trees[-1]
            t_h = fwd_hidden(cur, "teacher", batch)
            kw: dict[str, Any] = {}
            if opts.rule == "trust_region":
                ref = trees[0]
                kw = dict(
                    ref_teacher_hidden=fwd_hidden(ref, "teacher", batch),
                    ref_teacher_unembed=_unembed(ref, model_cfg),
                    trust_region_alpha=opts.rate,
                )
            stats = chunked.chunked_distill_stats(
                s_h, t_h, w_s, _unembed(cur, model_cfg), tokens, lc,
                chunk=opts.chunk, vocab_major=vocab_major, remat=loss_chunk_remat,
                topk_indices=topk_indices, matmul_dtype=mm_dtype, **kw,
            )
            token_logp = stats["student_logp"]
        else:
            stats = None
            token_logp = chunked.chunked_token_logprobs(
                s_h, w_s, tokens, lc.temperature, opts.chunk, vocab_major=vocab_major,
                remat=loss_chunk_remat, matmul_dtype=mm_dtype,
            )

        rollout_w = None
        if sampler is not None:
            trainer_lp = lax.stop_gradient(token_logp)
            diff = jnp.abs(trainer_lp - sampler)
            metrics["logp_mismatch_mean"] = losses.masked_mean(diff, rmask)
            metrics["logp_mismatch_max"] = _masked_max(diff, rmask)
            if opts.rollout_is_threshold is not None:
                rollout_w = losses.truncated_is_weights(
                    trainer_lp, sampler, opts.rollout_is_threshold, rmask
                )
                over = (jnp.exp(jnp.clip(trainer_lp - sampler, -20.0, 20.0))
                        > opts.rollout_is_threshold).astype(jnp.float32)
                metrics["rollout_is_clip_frac"] = losses.masked_mean(over, rmask)

        if opts.mode == "sdpo":
            loss, m = losses.finalize_distill(
                stats, rmask, sd_mask, lc, old_token_logp=old, rollout_is_weights=rollout_w
            )
            metrics.update(m)
            if lc.is_clip is not None and old is not None:
                over = (jnp.exp(jnp.clip(lax.stop_gradient(token_logp) - old, -20.0, 20.0))
                        > lc.is_clip).astype(jnp.float32)
                metrics["clip_frac"] = losses.masked_mean(over, losses.make_loss_mask(
                    rmask, sd_mask))
            else:
                metrics["clip_frac"] = jnp.float32(0.0)
        else:
            adv = losses.grpo_advantages(batch["rewards"], opts.group_size)
            common = dict(
                old_token_logp=old, clip_low=opts.clip_low, clip_high=opts.clip_high,
                clip_ratio_c=opts.clip_ratio_c, rollout_is_weights=rollout_w,
            )
            if opts.mode == "grpo":
                loss, m = losses.grpo_loss(token_logp, rmask, adv, **common)
            else:
                loss, m = losses.hybrid_loss(
                    token_logp, stats["teacher_logp"], rmask, adv, opts.hybrid_lambda,
                    sd_mask=sd_mask, **common,
                )
                _, dm = losses.finalize_distill(stats, rmask, sd_mask, lc)
                metrics.update({k: dm[k] for k in ("kl", "top1_agree", "entropy")})
            metrics.update(m)
            metrics["loss"] = lax.stop_gradient(loss)
            metrics["clip_frac"] = m["pg_clipfrac"]
            metrics["num_loss_tokens"] = jnp.sum(rmask)
            metrics["masked_sample_fraction"] = 1.0 - jnp.mean(sd_mask)
        return loss, metrics

    return loss_fn


class TrainStep:
    """The train step for one model config, distill config and (optional) mesh."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        distill_cfg: ml_collections.ConfigDict,
        *,
        mesh: Mesh | None = None,
        rules: shd.ShardingRules | None = None,
        donate: bool = True,
        loss_chunk_remat: bool = True,
        microbatch_rows: int = 0,
    ):
        self.model_cfg = model_cfg
        self.opts = StepOptions.from_config(distill_cfg, model_cfg.vocab_size)
        self.mesh = mesh
        self.rules = rules if rules is not None else shd.ShardingRules.from_mapping()
        self.donate = donate
        self.optimizer = doptim.make_optimizer(self.opts.optim)
        shard_ctx = (mesh, self.rules) if mesh is not None else None
        self.loss_fn = make_loss_fn(model_cfg, self.opts, shard_ctx,
                                    loss_chunk_remat=loss_chunk_remat)
        self._compiled: dict[tuple, Any] = {}
        self._state_shardings: Any = None
        # gradient accumulation (train.microbatch_rows; 0 = off): checked against the mesh now
        self.microbatch_rows = int(microbatch_rows)
        accumulate.check_microbatch_rows(self.microbatch_rows, self.microbatch_unit())

    def microbatch_unit(self) -> int:
        """A microbatch must be a multiple of this: the mesh's batch axes x the GRPO group."""
        group = self.opts.group_size if self.opts.mode in ("grpo", "hybrid") else 1
        return math.lcm(self.batch_divisor(), group)

    def num_microbatches(self, rows: int) -> int:
        """How many microbatches a batch of ``rows`` is split into (1: no accumulation)."""
        return rows // accumulate.microbatch_size(rows, self.microbatch_rows,
                                                  self.microbatch_unit())

    # ------------------------------------------------------------- shardings
    def _named(self, spec: PartitionSpec) -> NamedSharding:
        assert self.mesh is not None
        return NamedSharding(self.mesh, spec)

    def state_shardings(self) -> Any:
        """NamedShardings for every TrainState leaf (None without a mesh)."""
        if self.mesh is None:
            return None
        if self._state_shardings is None:
            p_sh = shd.tree_shardings(self.mesh, self.rules, decoder.param_axes(self.model_cfg))
            abstract = jax.eval_shape(self._init_host, self._abstract_params(),
                                      jax.ShapeDtypeStruct((2,), jnp.uint32))
            rep = self._named(PartitionSpec())
            opt_sh = optax.tree_map_params(
                self.optimizer, lambda _, s: s, abstract.opt_state, p_sh,
                transform_non_params=lambda _: rep,
            )
            teacher_sh = p_sh if self.opts.keeps_teacher else {}
            self._state_shardings = TrainState(
                step=rep, params=p_sh, opt_state=opt_sh, teacher=teacher_sh, rng=rep
            )
        return self._state_shardings

    def _abstract_params(self) -> Any:
        return jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32),
            decoder.param_shapes(self.model_cfg),
        )

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
        master = _cast(params, self.opts.storage_dtype)
        teacher = None
        if self.opts.keeps_teacher:
            teacher = tlib.init_teacher(self.opts.rule, params, jnp.dtype(self.opts.teacher_dtype))
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=master,
            opt_state=self.optimizer.init(master),
            teacher={} if teacher is None else teacher,
            rng=jnp.asarray(rng, jnp.uint32),
        )

    def init(self, params: Any, rng: Array | int = 0) -> TrainState:
        """The initial TrainState (placed on the mesh when there is one)."""
        if isinstance(rng, int):
            rng = jax.random.key_data(jax.random.PRNGKey(rng))
        elif jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
            rng = jax.random.key_data(rng)
        if self.mesh is None:
            return jax.jit(self._init_host)(params, rng)
        p_sh = self.state_shardings().params
        shd.check_divisible(self.mesh, self.rules, params, decoder.param_axes(self.model_cfg))
        params = jax.device_put(params, p_sh)
        return jax.jit(self._init_host, out_shardings=self.state_shardings())(params, rng)

    # ------------------------------------------------------------- step
    def _step(self, state: TrainState, batch: dict[str, Array]) -> tuple[TrainState, dict]:
        o = self.opts
        n_micro = self.num_microbatches(batch["response_mask"].shape[0])
        if n_micro > 1:
            (loss, metrics), grads = self._accumulated(state, batch, n_micro)
        else:
            grad_fn = jax.value_and_grad(self.loss_fn, has_aux=True)
            (loss, metrics), grads = grad_fn(state.params, state.teacher, batch)
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
        return new_state, metrics

    def _accumulated(self, state: TrainState, batch: dict[str, Array], n: int) -> Any:
        """Loss, metrics and gradient of the whole batch from ``n`` microbatches."""
        sharding = grad_sh = None
        if self.mesh is not None:
            s2, s1 = self.rules.spec(("batch", "seq")), self.rules.spec(("batch",))
            sharding = lambda nd: self._named(accumulate.mesh_spec(s2, s1, nd))  # noqa: E731
            grad_sh = self.state_shardings().params
        return accumulate.accumulated_value_and_grad(
            self.loss_fn, state.params, state.teacher, batch, mode=self.opts.mode, n=n,
            sharding=sharding, grad_sharding=grad_sh)

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
                    in_shardings=(st, self.batch_shardings(batch)),
                    out_shardings=(st, rep),
                    donate_argnums=donate,
                )
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

    def __call__(self, state: TrainState, batch: Mapping[str, Any]) -> tuple[TrainState, dict]:
        return self.step(state, batch)

    def step(self, state: TrainState, batch: Mapping[str, Any]) -> tuple[TrainState, dict]:
        """One update; raises :class:`BatchError` on a malformed batch before any compute."""
        b, _, _, _ = check_batch(batch, self.opts.mode)
        self._check_batch_divisible(b)
        if self.opts.mode == "grpo" or self.opts.mode == "hybrid":
            if b % self.opts.group_size:
                raise BatchError(
                    f"batch size {b} is not a multiple of loss.group_size={self.opts.group_size}"
                )
        if self.opts.mode == "grpo":
            batch = {k: v for k, v in batch.items() if not k.startswith("teacher_")}
        return self._get_compiled(batch)(state, dict(batch))

    def lower(self, state: Any, batch: Mapping[str, Any]) -> Any:
        """``jax.jit(...).lower`` on (abstract) state and batch, for dry-run compiles."""
        check_batch(batch, self.opts.mode)
        return self._get_compiled(batch).lower(state, dict(batch))

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs (with shardings on a mesh) of the TrainState, no allocation."""
        abstract = jax.eval_shape(self._init_host, self._abstract_params(),
                                  jax.ShapeDtypeStruct((2,), jnp.uint32))
        sh = self.state_shardings()
        if sh is None:
            return abstract
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, sh
        )


def compute_params(state: TrainState, distill_cfg: ml_collections.ConfigDict) -> Any:
    """The params in the compute dtype (what the sampler / an HF export should receive)."""
    return _cast(state.params, jnp.dtype(distill_cfg.precision.param_dtype))
