"""Every option of the distillation step, as one ``ml_collections.ConfigDict``.

``default_distill_config()`` gives METHOD.md Table 12 defaults (SciKnowEval / tool-use column:
JSD alpha 0.5, top-100 with tail, EMA teacher at rate 0.05, AdamW lr 1e-5 warmup 10).
``lcb_distill_config()`` gives the LiveCodeBench column (reverse KL, top-20, EMA 0.01,
lr 1e-6, no warmup). ``grpo_baseline_config()`` gives Table 13's GRPO baseline.

``validate_distill_config`` checks a config (and the vocabulary size, when known) before any
compute and names the offending key. ``loss_config`` / ``optim_config`` turn the ConfigDict
into the frozen dataclasses the pure functions take.
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections
from ml_collections import config_dict

from pmd_jax.distill.losses import DistillLossConfig
from pmd_jax.distill.optim import OptimConfig

LOSS_MODES = ("sdpo", "grpo", "hybrid")
TEACHER_RULES = ("ema", "trust_region", "frozen", "live")
DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("full", "dots", "dots_no_batch")
LAYER_LOOPS = ("scan", "unrolled")
MATMUL_DTYPES = ("", "bfloat16", "float16")


class DistillConfigError(ValueError):
    """A distillation setting is invalid; the message names the key."""


def _nullable(value: Any, field_type: type) -> config_dict.FieldReference:
    return config_dict.FieldReference(value, field_type=field_type)


def default_distill_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    loss = ml_collections.ConfigDict()
    # "sdpo": pure self-distillation (verl loss_mode=sdpo); "grpo": the baseline, no teacher;
    # "hybrid": PPO-clip with A = lambda * A_GRPO + (1 - lambda) * A_SDPO (Eq. 3).
    loss.mode = "sdpo"
    # 0: forward KL(teacher||student); 1: reverse KL(student||teacher); else generalized JSD.
    loss.alpha = 0.5
    # True: divergence over next-token distributions ("logit-level"); False: the sampled-token
    # surrogate (needs alpha=1).
    loss.full_logit_distillation = True
    # None: full vocabulary; else K indices from the student (Table 12: 100 / 20).
    loss.topk = _nullable(100, int)
    loss.add_tail = True  # top-K + tail bucket, else renormalised top-K
    loss.temperature = 1.0  # sampling temperature (log-probs of logits / T)
    loss.is_clip = _nullable(2.0, float)  # clip of the detached IS ratio; None disables
    # token-level truncated IS between trainer and sampler log-probs (verl rollout_is=token);
    # None disables.
    loss.rollout_is_threshold = _nullable(2.0, float)
    # GRPO / hybrid PPO clip (Table 13: clip-high 0.28; verl clip low 0.2, dual clip 3.0)
    loss.grpo_clip_low = 0.2
    loss.grpo_clip_high = 0.28
    loss.grpo_clip_ratio_c = _nullable(3.0, float)
    loss.hybrid_lambda = 0.9  # Fig. 11
    loss.group_size = 8  # rollouts per prompt (GRPO advantages are per group)
    # response tokens per chunk in the memory-bounded loss (logits exist for one chunk only)
    loss.chunk_size = 512
    c.loss = loss

    teacher = ml_collections.ConfigDict()
    teacher.rule = "ema"  # "ema" | "trust_region" | "frozen" | "live"
    # EMA: theta' <- (1 - rate) theta' + rate theta once per step after the optimizer;
    # trust-region: logits = lerp(logits_ref, logits_current, rate).
    teacher.rate = 0.05
    teacher.dtype = "float32"  # storage dtype of the EMA / frozen teacher copy
    c.teacher = teacher

    optim = ml_collections.ConfigDict()
    optim.lr = 1e-5
    optim.warmup_steps = 10
    optim.weight_decay = 0.01
    optim.grad_clip = _nullable(1.0, float)
    optim.b1 = 0.9
    optim.b2 = 0.999
    optim.eps = 1e-8
    # leave params / optimizer state unchanged when loss or grads are not finite
    optim.skip_nonfinite = True
    c.optim = optim

    precision = ml_collections.ConfigDict()
    precision.param_dtype = "float32"  # compute dtype of the params in the forward
    # keep fp32 master weights (and fp32 optimizer state) when param_dtype is bfloat16
    precision.master_weights = True
    # rematerialise decoder layers in the backward pass (policy: "full" saves only layer
    # inputs; "dots" / "dots_no_batch" also keep matmul outputs); the chunked loss always
    # recomputes its per-chunk logits.
    precision.remat = True
    precision.remat_policy = "full"
    # how the step runs the decoder layers (ours): "scan" (lax.scan over the stacked weights)
    # or "unrolled" (weights split per layer inside the step, Python loop over layers). On the
    # 2-core CPU box, SmolLM2-135M step (bench_train_step.py): B=8 with remat dots_no_batch
    # 27.4 -> 23.1 s/step but peak RSS 6.2 -> 10.3 GiB; B=16 dots_no_batch 51.9 s/step either
    # way (RSS 8.7 -> 17.5 GiB); B=16 remat full 55.6 -> 53.2 s/step (RSS 6.6 -> 17.6 GiB).
    # Longer compile too, so scan is the default.
    precision.layer_loop = "scan"
    # operand dtype of the step's weight matmuls (ours): "" = the compute dtype; "bfloat16" =
    # bf16 operands with float32 accumulation and result in the forward and both backward
    # matmuls, everything else (norms, attention, softmax, loss, AdamW) in param_dtype
    # (pmd_jax.models.matmul). On CPUs with AMX-BF16 (Sapphire Rapids and later) and on
    # TPU/GPU this is the fast path (bench_train_step.py, B=16: ~56 -> ~33-37 s/step on a
    # 2-core AMX host); a CPU without bf16 matmul units is not expected to gain (not measured).
    precision.matmul_dtype = ""
    c.precision = precision
    return c


def lcb_distill_config() -> ml_collections.ConfigDict:
    """METHOD.md Table 12, LiveCodeBench rich-feedback column."""
    c = default_distill_config()
    c.loss.alpha = 1.0
    c.loss.topk = 20
    c.teacher.rate = 0.01
    c.optim.lr = 1e-6
    c.optim.warmup_steps = 0
    return c


def grpo_baseline_config() -> ml_collections.ConfigDict:
    """METHOD.md Table 13 GRPO baseline (on-policy variant: lr 1e-5)."""
    c = default_distill_config()
    c.loss.mode = "grpo"
    c.teacher.rule = "live"  # unused: no teacher forward in grpo mode
    return c


def _err(key: str, msg: str) -> DistillConfigError:
    return DistillConfigError(f"{key}: {msg}")


def _num(c: Any, key: str, lo: float | None = None, hi: float | None = None,
         *, open_lo: bool = False) -> float:
    node = c
    parts = key.split(".")
    for p in parts:
        node = node[p]
    v = node
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _err(key, f"must be a finite number, got {v!r}")
    if lo is not None and (v < lo or (open_lo and v == lo)):
        raise _err(key, f"must be {'>' if open_lo else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise _err(key, f"must be <= {hi}, got {v}")
    return float(v)


def validate_distill_config(c: ml_collections.ConfigDict, vocab_size: int | None = None) -> None:
    """Check every option; raises :class:`DistillConfigError` naming the key."""
    if c.loss.mode not in LOSS_MODES:
        raise _err("loss.mode", f"{c.loss.mode!r} is not one of {LOSS_MODES}")
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
    if not c.loss.full_logit_distillation and c.loss.alpha != 1.0:
        raise _err(
            "loss.alpha",
            f"the sampled-token mode (full_logit_distillation=False) needs alpha=1, got "
            f"{c.loss.alpha}",
        )
    for key in ("loss.is_clip", "loss.rollout_is_threshold"):
        if c.loss[key.split(".")[1]] is not None:
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


def loss_config(c: ml_collections.ConfigDict) -> DistillLossConfig:
    """The :class:`DistillLossConfig` (divergence settings) of a distill ConfigDict."""
    return DistillLossConfig(
        alpha=float(c.loss.alpha),
        full_logit_distillation=bool(c.loss.full_logit_distillation),
        topk=None if c.loss.topk is None else int(c.loss.topk),
        add_tail=bool(c.loss.add_tail),
        temperature=float(c.loss.temperature),
        is_clip=None if c.loss.is_clip is None else float(c.loss.is_clip),
    )


def optim_config(c: ml_collections.ConfigDict) -> OptimConfig:
    o = c.optim
    return OptimConfig.from_mapping(
        {
            "lr": o.lr, "warmup_steps": o.warmup_steps, "weight_decay": o.weight_decay,
            "grad_clip": o.grad_clip, "b1": o.b1, "b2": o.b2, "eps": o.eps,
        }
    )
