"""The train step's forward and loss: :class:`StepOptions` and :func:`make_loss_fn`.

``loss_fn(params, teacher, batch)``: student forward (``return_hidden``) on student prompt +
response; for a loss that needs a teacher (:mod:`pmd_jax.distill.registry`), teacher
forward(s) with ``stop_gradient`` params on teacher prompt + the same response; the response
positions gathered on both sides (:mod:`pmd_jax.distill.align` indices); the chunked
statistics from hidden states and unembedding matrices (:mod:`pmd_jax.distill.chunked`, no
full ``[B, T, V]`` logits); the sampler/trainer log-prob mismatch metrics and rollout IS
weights; then the registered loss function (:mod:`pmd_jax.distill.objectives`).

LoRA (``lora=``): ``loss_fn(adapters, teacher_adapters, batch, base=base)``; every forward is
the frozen ``base`` (used as stored) with a tree of adapters (:mod:`pmd_jax.models.lora`), the
student's or, under ``stop_gradient``, the teacher's; the unembedding is the base's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pmd_jax.distill import align, chunked, losses, objectives, registry, sharded_topk
from pmd_jax.distill import config as dconfig
from pmd_jax.distill import optim as doptim
from pmd_jax.distill import teacher as tlib
from pmd_jax.distill.config import DistillConfig
from pmd_jax.models import decoder
from pmd_jax.models.config import ModelConfig
from pmd_jax.models.lora import LoraConfig

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static settings of the step, read once from the ConfigDict."""

    loss_name: str  # distill.loss.name: a loss of pmd_jax.distill.registry
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
    right_padded: bool  # the batch rows are right padded: cuDNN attention gets lengths
    matmul_dtype: str | None
    skip_nonfinite: bool
    optim: doptim.OptimConfig

    @classmethod
    def from_config(cls, c: DistillConfig, vocab_size: int) -> StepOptions:
        if not isinstance(c, DistillConfig):
            raise TypeError(
                f"the train step takes a frozen DistillConfig, got {type(c).__name__}; freeze "
                "an edited ConfigDict with pmd_jax.distill.config.freeze_distill_config(c)")
        dconfig.validate_distill_config(c, vocab_size=vocab_size)
        return cls(
            loss_name=c.loss.name,
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
            right_padded=bool(c.precision.right_padded),
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
    def loss_spec(self) -> registry.LossSpec:
        """The registered loss this step optimises."""
        return registry.get_loss(self.loss_name)

    @property
    def needs_teacher(self) -> bool:
        return self.loss_spec.needs_teacher

    @property
    def group_size_matters(self) -> bool:
        """Rows come in GRPO groups of ``group_size`` (the loss reads group-relative rewards)."""
        return self.loss_spec.needs_rewards

    @property
    def keeps_teacher(self) -> bool:
        """A teacher tree lives in the state (not without a teacher, nor for the live one)."""
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


def _model_parts(tree: Any, base: Any) -> tuple[Any, Any]:
    """``(params, adapters)`` of one forward: a params tree alone, or (LoRA, ``base`` given)
    the base with ``tree`` as its adapters."""
    return (tree, None) if base is None else (base, tree)


def make_loss_fn(
    model_cfg: ModelConfig, opts: StepOptions, shard_ctx: Any = None, *,
    loss_chunk_remat: bool = True, lora: LoraConfig | None = None,
):
    """``loss_fn(params, teacher, batch, base=None) -> (loss, metrics)``; differentiate
    w.r.t. params.

    ``params``: the stored (master) params; ``teacher``: the teacher state of ``opts.rule``.
    With ``lora``: ``params`` and ``teacher`` are adapter trees and ``base`` the frozen params.
    ``loss_chunk_remat=False`` keeps the per-chunk logits for the backward pass instead of
    recomputing them (:func:`pmd_jax.distill.chunked.chunked_distill_stats`).
    Exposed for tests (teacher gradients are zero) and for custom loops.
    """
    spec = opts.loss_spec
    compute_dtype = jnp.dtype(opts.param_dtype)
    remat = opts.remat
    if opts.matmul_dtype is not None:
        model_cfg = model_cfg.replace(matmul_dtype=opts.matmul_dtype)
    mm_dtype = model_cfg.matmul_dtype
    vocab_major = model_cfg.tie_embeddings
    # top-K over a tensor-sharded vocabulary without all-gathering each logits chunk
    topk_indices = (sharded_topk.make_topk_indices(shard_ctx[0], shard_ctx[1],
                                                   impl=opts.loss.top_k_impl)
                    if shard_ctx is not None else None)

    def fwd_hidden(params: Any, side: str, batch: Mapping[str, Array],
                   adapters: Any = None) -> Array:
        if opts.unrolled_layers:  # per-layer slices (gradients concatenated back)
            params = decoder.unstack_layers(params)
        seg = batch.get(f"{side}_segments")  # shared-prefix rows (distill.shared_prefix)
        lora_kw: dict[str, Any] = {} if adapters is None else {"adapters": adapters,
                                                               "lora": lora}
        h, _ = decoder.forward(
            params,
            batch[f"{side}_tokens"].astype(jnp.int32),
            batch[f"{side}_positions"].astype(jnp.int32),
            model_cfg,
            attn_mask=batch[f"{side}_attn_mask"],
            segment_ids=seg,
            shared_prefix=seg is not None,
            return_hidden=True,
            remat=remat,
            shard_ctx=shard_ctx,
            right_padded=opts.right_padded,
            **lora_kw,
        )
        return align.side_hidden(h, batch, side)

    def loss_fn(params: Any, teacher: Any, batch: Mapping[str, Array], base: Any = None
                ) -> tuple[Array, dict]:
        if (base is None) != (lora is None):
            raise ValueError("loss_fn: the frozen base goes with a LoRA loss (lora=), and only "
                             "with one")
        p, ad = _model_parts(_cast(params, compute_dtype), base)
        s_h = fwd_hidden(p, "student", batch, ad)
        w_s = _unembed(p, model_cfg)
        tokens = batch["responses"].astype(jnp.int32)
        rmask = batch["response_mask"].astype(jnp.float32)
        sd_mask = batch["sd_mask"].astype(jnp.float32)
        old = batch.get("old_logp")
        sampler = batch.get("sampler_logp")
        lc = opts.loss
        metrics: dict[str, Array] = {}

        if spec.needs_teacher:
            trees = tlib.teacher_param_trees(opts.rule, teacher, params)
            trees = tuple(_cast(t, compute_dtype) for t in trees)
            cur, cur_ad = _model_parts(trees[-1], base)
            t_h = fwd_hidden(cur, "teacher", batch, cur_ad)
            kw: dict[str, Any] = {}
            if opts.rule == "trust_region":
                ref, ref_ad = _model_parts(trees[0], base)
                kw = dict(
                    ref_teacher_hidden=fwd_hidden(ref, "teacher", batch, ref_ad),
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

        loss, m = spec.fn(objectives.LossInputs(
            token_logp=token_logp, stats=stats, response_mask=rmask, sd_mask=sd_mask,
            old_logp=old, rollout_is_weights=rollout_w, batch=batch,
        ), opts)
        metrics.update(m)
        return loss, metrics

    return loss_fn


def make_lesson_nll_fn(model_cfg: ModelConfig, opts: StepOptions, shard_ctx: Any = None, *,
                       loss_chunk_remat: bool = True, lora: LoraConfig | None = None):
    """``nll_fn(params, batch, base=None) -> (nll, metrics)`` (LoRA: ``params`` the adapters,
    ``base`` the frozen params): the token-mean negative log-likelihood
    (temperature 1) of the lesson rows (``lesson_*`` arrays, :func:`pmd_jax.distill.batch.
    make_lesson_rows`) given their prompts, over ``lesson_mask``; 0 when the mask is empty.

    The same forward, response gather and chunked log-probs as the student side of
    :func:`make_loss_fn` (mode=mel, :mod:`pmd_jax.modes.mel`); the step differentiates it in the
    same jitted step as the GRPO loss.
    """
    compute_dtype = jnp.dtype(opts.param_dtype)
    if opts.matmul_dtype is not None:
        model_cfg = model_cfg.replace(matmul_dtype=opts.matmul_dtype)

    def nll_fn(params: Any, batch: Mapping[str, Array], base: Any = None
               ) -> tuple[Array, dict[str, Array]]:
        p, ad = _model_parts(_cast(params, compute_dtype), base)
        if opts.unrolled_layers:
            p = decoder.unstack_layers(p)
        lora_kw: dict[str, Any] = {} if ad is None else {"adapters": ad, "lora": lora}
        h, _ = decoder.forward(
            p, batch["lesson_tokens"].astype(jnp.int32),
            batch["lesson_positions"].astype(jnp.int32), model_cfg,
            attn_mask=batch["lesson_attn_mask"], return_hidden=True, remat=opts.remat,
            shard_ctx=shard_ctx, right_padded=opts.right_padded, **lora_kw,
        )
        h = align.gather_response(h, batch["lesson_index"])
        logp = chunked.chunked_token_logprobs(
            h, _unembed(p, model_cfg), batch["lesson_targets"].astype(jnp.int32), 1.0,
            opts.chunk, vocab_major=model_cfg.tie_embeddings, remat=loss_chunk_remat,
            matmul_dtype=model_cfg.matmul_dtype,
        )
        mask = batch["lesson_mask"].astype(jnp.float32)
        count = jnp.sum(mask)
        nll = jnp.sum(jnp.where(mask > 0, -logp, 0.0)) / jnp.maximum(count, 1.0)
        rows = jnp.sum((jnp.sum(mask, axis=1) > 0).astype(jnp.float32))
        return nll, {"mel_lesson_nll": lax.stop_gradient(nll), "mel_lesson_tokens": count,
                     "mel_lesson_rows": rows}

    return nll_fn
