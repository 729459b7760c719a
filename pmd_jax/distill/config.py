"""Every option of the distillation step: the ``distill`` sections declared once as frozen
dataclasses (:class:`DistillConfig`), each knob with its help text; the editable
``ml_collections.ConfigDict`` is generated from them (:mod:`pmd_jax.config.schema`).

``default_distill_config()`` gives METHOD.md Table 12 defaults (SciKnowEval / tool-use column:
JSD alpha 0.5, top-100 with tail, EMA teacher at rate 0.05, AdamW lr 1e-5 warmup 10).
``lcb_distill_config()`` gives the LiveCodeBench column (reverse KL, top-20, EMA 0.01,
lr 1e-6, no warmup). ``grpo_baseline_config()`` gives Table 13's GRPO baseline.

``validate_distill_config`` checks a config (and the vocabulary size, when known) before any
compute and names the offending key (a ConfigDict or the frozen tree). ``loss_config`` /
``optim_config`` turn either into the dataclasses the pure functions take.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_collections

from pmd_jax.config.schema import Section, freeze_section, knob, section, to_config_dict
from pmd_jax.distill import topk as topk_lib
from pmd_jax.distill.losses import DistillLossConfig
from pmd_jax.distill.optim import OptimConfig
from pmd_jax.distill.registry import loss_names
from pmd_jax.models.remat import REMAT_POLICIES as DECODER_REMAT_POLICIES

TEACHER_RULES = ("ema", "trust_region", "frozen", "live")
TOP_K_IMPLS = topk_lib.TOP_K_IMPLS
DTYPES = ("float32", "bfloat16")
# the decoder's remat policies (pmd_jax.models.remat.remat_policy); "none" is remat=False
REMAT_POLICIES = tuple(p for p in DECODER_REMAT_POLICIES if p != "none")
LAYER_LOOPS = ("scan", "unrolled")
MATMUL_DTYPES = ("", "bfloat16", "float16")


class DistillConfigError(ValueError):
    """A distillation setting is invalid; the message names the key."""


def _loss_temperature(rollout_temperature: Any) -> float:
    """The loss's temperature in a run: the sampler's, with greedy (0) read as 1."""
    return float(rollout_temperature or 1.0)


@dataclasses.dataclass(frozen=True)
class DistillLoss(Section):
    """The divergence and policy-gradient settings of the update."""

    name: str = knob("", "Which loss (distill/registry.py); empty: the mode's default "
                     "(pmd_jax/modes: grpo and fast_slow 'grpo', mel 'mel', the others "
                     "'sdpo'); a loss the mode cannot train with is refused. 'sdpo' pure "
                     "self-distillation "
                     "(verl loss_mode=sdpo); 'grpo' the baseline, no teacher; 'hybrid' PPO-clip "
                     "with A = lambda * A_GRPO + (1 - lambda) * A_SDPO (Eq. 3), where A_SDPO is "
                     "the sampled token's teacher/student log-ratio (a reverse-KL advantage): "
                     "with 'hybrid' the divergence settings (alpha, topk, add_tail, "
                     "full_logit_distillation) do not reach the gradient, only the kl metric "
                     "(a warning says so at start-up).")
    alpha: float = knob(0.5, "0: forward KL(teacher||student); 1: reverse KL(student||teacher); "
                        "else the generalized JSD.")
    full_logit_distillation: bool = knob(True, "True: divergence over next-token distributions "
                                         "('logit-level'); False: the sampled-token surrogate "
                                         "(needs alpha=1).")
    topk: int | None = knob(100, "None: the full vocabulary; else K indices from the student "
                            "(Table 12: 100 / 20).", nullable=int)
    add_tail: bool = knob(True, "Top-K plus a tail bucket, else the renormalised top-K.")
    top_k_impl: str = knob("auto", "How the student's top-K is taken (ours; all give "
                           "lax.top_k's values and indices, ties included): 'sort' = lax.top_k "
                           "over the vocabulary (XLA:GPU sorts all of it when K > 16); "
                           "'two_stage' = the top-16 of each strided block of >= 1,024 entries, "
                           "then the top-K of those candidates, redone with lax.top_k when a "
                           "block may hold more winners (pmd_jax/distill/topk.py); 'auto' = "
                           "two_stage in a program lowered for a GPU when K > 16, else sort (CPU "
                           "results unchanged).")
    temperature: float = knob(1.0, "Sampling temperature (log-probs of logits / T). In a run "
                              "it is rollout.temperature (1.0 where that is 0, greedy).",
                              derived="rollout.temperature", derive=_loss_temperature)
    is_clip: float | None = knob(2.0, "Clip of the detached IS ratio; None disables.",
                                 nullable=float)
    rollout_is_threshold: float | None = knob(
        2.0, "Token-level truncated IS between trainer and sampler log-probs (verl "
        "rollout_is=token); None disables.", nullable=float)
    grpo_clip_low: float = knob(0.2, "GRPO / hybrid PPO clip low (verl 0.2).")
    grpo_clip_high: float = knob(0.28, "GRPO / hybrid PPO clip high (Table 13: clip-high 0.28).")
    grpo_clip_ratio_c: float | None = knob(3.0, "GRPO / hybrid dual clip (verl 3.0); None "
                                           "disables.", nullable=float)
    hybrid_lambda: float = knob(0.9, "Weight of the GRPO advantage in 'hybrid' (Fig. 11).")
    group_size: int = knob(8, "Rollouts per prompt (GRPO advantages are per group). In a run "
                           "it is rollout.n.", derived="rollout.n", derive=int)
    chunk_size: int = knob(512, "Response tokens per chunk in the memory-bounded loss (logits "
                           "exist for one chunk only), at most: the chunk used is the largest "
                           "that divides the response length R into at most twice as many chunks "
                           "as ceil(R / chunk_size) (e.g. 96 on R = 512: 8 chunks of 64, no "
                           "padded rows), else R split evenly into ceil(R / chunk_size) chunks "
                           "(fewer than that many padded rows) (pmd_jax/distill/chunked.py "
                           "chunk_for_length).")


@dataclasses.dataclass(frozen=True)
class DistillTeacher(Section):
    """How the teacher's weights follow the student's."""

    rule: str = knob("ema", "'ema' | 'trust_region' | 'frozen' | 'live'.")
    rate: float = knob(0.05, "EMA: theta' <- (1 - rate) theta' + rate theta once per step after "
                       "the optimizer; trust-region: logits = lerp(logits_ref, logits_current, "
                       "rate).")
    dtype: str = knob("float32", "Storage dtype of the EMA / frozen teacher copy.")


@dataclasses.dataclass(frozen=True)
class DistillOptim(Section):
    """AdamW with linear warmup."""

    lr: float = knob(1e-5, "Learning rate.")
    warmup_steps: int = knob(10, "Linear warmup steps.")
    weight_decay: float = knob(0.01, "AdamW weight decay.")
    grad_clip: float | None = knob(1.0, "Global gradient-norm clip; None disables.",
                                   nullable=float)
    b1: float = knob(0.9, "Adam beta1.")
    b2: float = knob(0.999, "Adam beta2.")
    eps: float = knob(1e-8, "Adam epsilon.")
    skip_nonfinite: bool = knob(True, "Leave params / optimizer state unchanged when the loss "
                                "or grads are not finite.")


@dataclasses.dataclass(frozen=True)
class DistillPrecision(Section):
    """Dtypes, rematerialisation and the layer loop of the train step."""

    param_dtype: str = knob("float32", "Compute dtype of the params in the forward.")
    master_weights: bool = knob(True, "Keep fp32 master weights (and fp32 optimizer state) "
                                "when param_dtype is bfloat16.")
    remat: bool = knob(True, "Rematerialise decoder layers in the backward pass (the chunked "
                       "loss always recomputes its per-chunk logits).")
    remat_policy: str = knob("full", "'full' saves only layer inputs; 'dots' / 'dots_no_batch' "
                             "also keep matmul outputs ('minimal' = 'dots_no_batch', MaxText's "
                             "name: the weight projections); by name (MaxText's policies, "
                             "pmd_jax.models.remat.remat_policy): 'save_qkv_proj', "
                             "'save_out_proj', 'save_dot_except_mlp', "
                             "'save_dot_with_context_except_mlp', 'save_dot_except_mlpwi'; "
                             "offloaded to pinned host memory between the passes: "
                             "'qkv_proj_offloaded', 'save_dot_except_mlp_offloaded', "
                             "'minimal_offloaded'. Compiled memory of each: docs/benchmarks.md.")
    right_padded: bool = knob(True, "The step's rows are right padded, as assemble and "
                              "make_lesson_rows build them: cuDNN attention then takes each "
                              "row's length instead of a padding mask (no [B, T, T] bias and no "
                              "dbias; pmd_jax/models/attend.py). Not checked on the device: set "
                              "False for batches with padding before real tokens "
                              "(align.build_distill_batch(pad_side='left')). Other attention "
                              "implementations read the mask either way.")
    layer_loop: str = knob("scan", "How the step runs the decoder layers (ours): 'scan' "
                           "(lax.scan over the stacked weights) or 'unrolled' (weights split per "
                           "layer inside the step, a Python loop over layers: more memory and a "
                           "longer compile; docs/scale.md has the measured trade-off).")
    matmul_dtype: str = knob("", "Operand dtype of the step's weight matmuls (ours): '' = the "
                             "compute dtype; 'bfloat16' = bf16 operands with float32 accumulation "
                             "and result in the forward and both backward matmuls, everything "
                             "else in param_dtype (pmd_jax.models.matmul). The fast path on TPU, "
                             "GPU and CPUs with AMX-BF16 (measured in docs/benchmarks.md).")


@dataclasses.dataclass(frozen=True)
class DistillConfig(Section):
    """Every option of the distillation step (METHOD.md Table 12, SciKnowEval column)."""

    loss: DistillLoss = section(DistillLoss, "The loss.")
    teacher: DistillTeacher = section(DistillTeacher, "The teacher's update rule.")
    optim: DistillOptim = section(DistillOptim, "The optimizer.")
    precision: DistillPrecision = section(DistillPrecision, "Dtypes, remat, layer loop.")

    def errors(self) -> list[str]:
        try:
            validate_distill_config(self)
        except ValueError as e:
            return [f"distill.{e}"]
        return []


def default_distill_config() -> ml_collections.ConfigDict:
    """The editable ConfigDict of :class:`DistillConfig`'s defaults, for a distill section
    used on its own (a train step outside a run: no mode chooses the loss, so SDPO's)."""
    c = to_config_dict(DistillConfig())
    c.loss.name = "sdpo"
    return c


def freeze_distill_config(c: ml_collections.ConfigDict) -> DistillConfig:
    """The frozen :class:`DistillConfig` of a distill ConfigDict (validate it first)."""
    return freeze_section(DistillConfig, c)


def lcb_distill_config(c: ml_collections.ConfigDict | None = None
                       ) -> ml_collections.ConfigDict:
    """METHOD.md Table 12, LiveCodeBench rich-feedback column: set on ``c`` (a run config's
    ``distill`` section, whose group size and temperature live in ``rollout``), or on
    :func:`default_distill_config` for a step used on its own. Returns the section."""
    c = default_distill_config() if c is None else c
    c.loss.alpha = 1.0
    c.loss.topk = 20
    c.teacher.rate = 0.01
    c.optim.lr = 1e-6
    c.optim.warmup_steps = 0
    return c


def grpo_baseline_config(c: ml_collections.ConfigDict | None = None
                         ) -> ml_collections.ConfigDict:
    """METHOD.md Table 13 GRPO baseline (on-policy variant: lr 1e-5), on ``c`` as
    :func:`lcb_distill_config`."""
    c = default_distill_config() if c is None else c
    c.loss.name = "grpo"
    c.teacher.rule = "live"  # unused: no teacher forward in grpo mode
    return c


def _err(key: str, msg: str) -> DistillConfigError:
    return DistillConfigError(f"{key}: {msg}")


def _num(c: DistillConfig, key: str, lo: float | None = None, hi: float | None = None,
         *, open_lo: bool = False) -> float:
    v = c
    for p in key.split("."):
        v = getattr(v, p)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _err(key, f"must be a finite number, got {v!r}")
    if lo is not None and (v < lo or (open_lo and v == lo)):
        raise _err(key, f"must be {'>' if open_lo else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise _err(key, f"must be <= {hi}, got {v}")
    return float(v)


def validate_distill_config(c: DistillConfig, vocab_size: int | None = None) -> None:
    """Check every option of a :class:`DistillConfig`; raises
    :class:`DistillConfigError` naming the key. The loss name is checked against the loss
    registry (:mod:`pmd_jax.distill.registry`)."""

    # (empty: the run mode's default, set by apply_mode; left empty only when the mode is
    # unknown, which the mode check names)
    if c.loss.name and c.loss.name not in loss_names():
        raise _err("loss.name", f"{c.loss.name!r} is not one of {loss_names()}")
    if c.teacher.rule not in TEACHER_RULES:
        raise _err("teacher.rule", f"{c.teacher.rule!r} is not one of {TEACHER_RULES}")
    _num(c, "loss.alpha", 0.0, 1.0)
    _num(c, "teacher.rate", 0.0, 1.0)
    _num(c, "loss.temperature", 0.0, open_lo=True)
    _num(c, "loss.hybrid_lambda", 0.0, 1.0)
    _num(c, "loss.grpo_clip_low", 0.0, 1.0)
    _num(c, "loss.grpo_clip_high", 0.0)
    if c.loss.topk is not None:
        k = c.loss.topk
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise _err("loss.topk", f"must be a positive int or None, got {k!r}")
        if vocab_size is not None and k > vocab_size:
            raise _err("loss.topk", f"top-K={k} is larger than the vocabulary ({vocab_size})")
    if c.loss.top_k_impl not in TOP_K_IMPLS:
        raise _err("loss.top_k_impl", f"{c.loss.top_k_impl!r} is not one of {TOP_K_IMPLS}")
    if not c.loss.full_logit_distillation and c.loss.alpha != 1.0:
        raise _err(
            "loss.alpha",
            f"the sampled-token mode (full_logit_distillation=False) needs alpha=1, got "
            f"{c.loss.alpha}",
        )
    for key in ("loss.is_clip", "loss.rollout_is_threshold"):
        if getattr(c.loss, key.split(".")[1]) is not None:
            _num(c, key, 0.0, open_lo=True)
    if c.loss.grpo_clip_ratio_c is not None:
        _num(c, "loss.grpo_clip_ratio_c", 1.0, open_lo=True)
    gs = c.loss.group_size
    if isinstance(gs, bool) or not isinstance(gs, int) or gs < 1:
        raise _err("loss.group_size", f"must be a positive int, got {gs!r}")
    cs = c.loss.chunk_size
    if isinstance(cs, bool) or not isinstance(cs, int) or cs < 1:
        raise _err("loss.chunk_size", f"must be a positive int, got {cs!r}")
    if c.precision.matmul_dtype not in MATMUL_DTYPES:
        raise _err("precision.matmul_dtype",
                   f"{c.precision.matmul_dtype!r} is not one of {MATMUL_DTYPES}")
    if c.precision.layer_loop not in LAYER_LOOPS:
        raise _err("precision.layer_loop",
                   f"{c.precision.layer_loop!r} is not one of {LAYER_LOOPS}")
    if c.precision.remat_policy not in REMAT_POLICIES:
        raise _err("precision.remat_policy",
                   f"{c.precision.remat_policy!r} is not one of {REMAT_POLICIES}")
    for key, val in (("precision.param_dtype", c.precision.param_dtype),
                     ("teacher.dtype", c.teacher.dtype)):
        if val not in DTYPES:
            raise _err(key, f"{val!r} is not one of {DTYPES}")
    try:
        optim_config(c)
    except ValueError as e:
        raise DistillConfigError(str(e)) from None


def loss_config(c: DistillConfig) -> DistillLossConfig:
    """The :class:`DistillLossConfig` (divergence settings) of a distill ConfigDict."""
    return DistillLossConfig(
        alpha=float(c.loss.alpha),
        full_logit_distillation=bool(c.loss.full_logit_distillation),
        topk=None if c.loss.topk is None else int(c.loss.topk),
        add_tail=bool(c.loss.add_tail),
        temperature=float(c.loss.temperature),
        is_clip=None if c.loss.is_clip is None else float(c.loss.is_clip),
        top_k_impl=str(c.loss.top_k_impl),
    )


def optim_config(c: DistillConfig) -> OptimConfig:
    o = c.optim
    return OptimConfig.from_mapping(
        {
            "lr": o.lr, "warmup_steps": o.warmup_steps, "weight_decay": o.weight_decay,
            "grad_clip": o.grad_clip, "b1": o.b1, "b2": o.b2, "eps": o.eps,
        }
    )
