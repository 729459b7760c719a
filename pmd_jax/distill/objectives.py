"""The train step's losses: each is one function and one ``register_loss`` call.

A loss function is ``fn(x: LossInputs, opts) -> (loss, metrics)``: ``x`` holds what the step's
forward produced for the (micro)batch, ``opts`` the step's static settings
(:class:`pmd_jax.distill.loss_fn.StepOptions`: ``opts.loss`` the distillation settings,
``opts.clip_low`` / ``clip_high`` / ``clip_ratio_c`` the PPO clip, ``opts.hybrid_lambda``,
``opts.group_size``). ``loss`` is differentiated w.r.t. the student params; every metric is a
detached scalar whose combination over microbatches the spec's ``metric_kinds`` declares. The
step adds the metrics every loss shares (``logp_mismatch_*``, ``rollout_is_clip_frac``) and the
optimizer's (``grad_norm``, ``lr``, ``finite``, ``skipped``).

To add a loss: write its function here, register a :class:`LossSpec` below it (name, what it
needs, the batch arrays it reads, its metrics' kinds), and select it with
``--config.distill.loss.name=<name>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from pmd_jax.distill import losses
from pmd_jax.distill import policy_gradient as pg
from pmd_jax.distill.registry import LESSON_KEYS, TEACHER_KEYS, LossSpec, register_loss

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """What a loss function gets from the step's forward (``[B, R]`` per response token)."""

    token_logp: Array  # student log-probs of the response tokens at the temperature (grad)
    stats: dict[str, Array] | None  # chunked_distill_stats output; None without a teacher
    response_mask: Array  # float32 [B, R]
    sd_mask: Array  # float32 [B]
    old_logp: Array | None  # old-policy log-probs; None = on-policy
    rollout_is_weights: Array | None  # truncated IS weights trainer vs sampler, or None
    batch: Mapping[str, Array]  # the (micro)batch, for the loss's own batch_keys


# metrics shared by the PPO-style losses (grpo, hybrid): token means over the response mask
_PG_KINDS = {
    "loss": "response", "pg_loss": "response", "pg_clipfrac": "response",
    "clip_frac": "response", "num_loss_tokens": "sum", "masked_sample_fraction": "rows",
}
_DISTILL_METRIC_KINDS = {"kl": "loss_mask", "top1_agree": "loss_mask", "entropy": "response"}


def _teacher_stats(x: LossInputs, loss: str) -> dict[str, Array]:
    """``x.stats`` for a loss registered with ``needs_teacher=True``: the step runs the teacher
    forward for every such loss, so None here is a wiring bug, named rather than indexed."""
    if x.stats is None:
        raise ValueError(f"loss {loss!r} needs the teacher's distillation stats (its LossSpec "
                         "has needs_teacher=True) but the step passed none")
    return x.stats


def sdpo(x: LossInputs, opts: Any) -> tuple[Array, dict[str, Array]]:
    """Self-distillation (METHOD.md 1.2-1.3): the divergence to the teacher over the loss mask
    ``response_mask * sd_mask``, times the detached IS ratio to ``old_logp``."""
    lc = opts.loss
    metrics: dict[str, Array] = {}
    loss, m = losses.finalize_distill(
        _teacher_stats(x, "sdpo"), x.response_mask, x.sd_mask, lc, old_token_logp=x.old_logp,
        rollout_is_weights=x.rollout_is_weights,
    )
    metrics.update(m)
    if lc.is_clip is not None and x.old_logp is not None:
        over = (jnp.exp(jnp.clip(lax.stop_gradient(x.token_logp) - x.old_logp, -20.0, 20.0))
                > lc.is_clip).astype(jnp.float32)
        metrics["clip_frac"] = losses.masked_mean(over, losses.make_loss_mask(
            x.response_mask, x.sd_mask))
    else:
        metrics["clip_frac"] = jnp.float32(0.0)
    return loss, metrics


register_loss(LossSpec(
    name="sdpo", fn=sdpo, needs_teacher=True, needs_rewards=False, needs_old_logprobs=False,
    drops_unsignaled_rows=True,
    batch_keys=TEACHER_KEYS,
    doc="pure self-distillation (verl loss_mode=sdpo): divergence to the feedback-conditioned "
        "teacher on reprompted samples",
    metric_kinds={
        "loss": "loss_mask", **_DISTILL_METRIC_KINDS, "clip_frac": "loss_mask",
        "num_loss_tokens": "sum", "masked_sample_fraction": "rows",
        "logp_abs_diff_old": "response",
    },
))


def _pg_common(x: LossInputs, opts: Any) -> tuple[Array, dict[str, Any]]:
    """GRPO advantages of the batch's rewards and the PPO-clip keyword arguments."""
    adv = pg.grpo_advantages(x.batch["rewards"], opts.group_size)
    common = dict(
        old_token_logp=x.old_logp, clip_low=opts.clip_low, clip_high=opts.clip_high,
        clip_ratio_c=opts.clip_ratio_c, rollout_is_weights=x.rollout_is_weights,
    )
    return adv, common


def _pg_metrics(metrics: dict[str, Array], loss: Array, m: dict[str, Array],
                x: LossInputs) -> dict[str, Array]:
    metrics.update(m)
    metrics["loss"] = lax.stop_gradient(loss)
    metrics["clip_frac"] = m["pg_clipfrac"]
    metrics["num_loss_tokens"] = jnp.sum(x.response_mask)
    metrics["masked_sample_fraction"] = 1.0 - jnp.mean(x.sd_mask)
    return metrics


def grpo(x: LossInputs, opts: Any) -> tuple[Array, dict[str, Array]]:
    """The GRPO baseline (METHOD.md Table 13): PPO-clip with group-relative advantages, no
    teacher, token mean over the response mask."""
    adv, common = _pg_common(x, opts)
    loss, m = pg.grpo_loss(x.token_logp, x.response_mask, adv, **common)
    return loss, _pg_metrics({}, loss, m, x)


register_loss(LossSpec(
    name="grpo", fn=grpo, needs_teacher=False, needs_rewards=True, needs_old_logprobs=False,
    batch_keys=("rewards",),
    doc="the GRPO baseline: PPO-clip with group-relative advantages, no teacher",
    metric_kinds=_PG_KINDS,
))


def hybrid(x: LossInputs, opts: Any) -> tuple[Array, dict[str, Array]]:
    """GRPO + SDPO (Eq. 3): PPO-clip with ``lam * A_GRPO + (1 - lam) * A_SDPO`` per token, plus
    the distillation metrics (kl, top1_agree, entropy) of the teacher forward."""
    adv, common = _pg_common(x, opts)
    stats = _teacher_stats(x, "hybrid")
    loss, m = pg.hybrid_loss(
        x.token_logp, stats["teacher_logp"], x.response_mask, adv, opts.hybrid_lambda,
        sd_mask=x.sd_mask, **common,
    )
    _, dm = losses.finalize_distill(stats, x.response_mask, x.sd_mask, opts.loss)
    metrics = {k: dm[k] for k in ("kl", "top1_agree", "entropy")}
    return loss, _pg_metrics(metrics, loss, m, x)


def _hybrid_warning(loss: Any) -> str | None:
    """The knobs that shape SDPO's gradient but only hybrid's kl metric, when set."""
    if loss.alpha == 1.0 and not loss.full_logit_distillation:
        return None
    return ("distill.loss.name='hybrid': its SDPO advantage is the sampled token's teacher / "
            f"student log-ratio (reverse KL on the sampled token); distill.loss.alpha="
            f"{loss.alpha}, topk={loss.topk} and full_logit_distillation="
            f"{loss.full_logit_distillation} only define its kl metric, not its gradient")


register_loss(LossSpec(
    name="hybrid", fn=hybrid, needs_teacher=True, needs_rewards=True, needs_old_logprobs=False,
    batch_keys=(*TEACHER_KEYS, "rewards"),
    doc="GRPO + SDPO hybrid (Eq. 3): the PPO-clip loss with the combined advantage "
        "(distill.loss.hybrid_lambda); its A_SDPO is the sampled token's log-ratio "
        "log q(y_t) - log pi(y_t) (Eq. 2, a reverse-KL advantage), so distill.loss.alpha, "
        "topk, add_tail and full_logit_distillation do not shape its gradient (they only "
        "define its kl metric)",
    metric_kinds={**_PG_KINDS, **_DISTILL_METRIC_KINDS, "hybrid_adv_mean": "response"},
    config_warning=_hybrid_warning,
))


register_loss(LossSpec(
    name="mel", fn=grpo, needs_teacher=False, needs_rewards=True, needs_old_logprobs=False,
    batch_keys=("rewards", *LESSON_KEYS), lesson_nll=True,
    doc="Meta-Experience Learning (mode=mel, pmd_jax/modes/mel): the GRPO loss plus mel.nll_weight "
        "x the token-mean NLL of the kept lessons given their problem's prompt",
    # The lesson terms are computed once per step on the whole lesson batch, outside the
    # microbatch scan (pmd_jax.distill.step), so no microbatch ever combines them: "sum" of
    # one value is that value. grpo_loss is the GRPO part alone (a response-token mean).
    metric_kinds={**_PG_KINDS, "grpo_loss": "response", "mel_lesson_nll": "sum",
                  "mel_lesson_tokens": "sum", "mel_lesson_rows": "sum"},
))
