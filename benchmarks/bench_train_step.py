"""Our jitted distillation step vs the same step in torch + HF transformers, on one CPU or GPU.

Both sides do, on a Llama-shaped model with random weights (``--model``: SmolLM2-135M,
Llama-3-8B, tiny-llama; ``--layers N`` cuts it to N layers), fp32 master weights and AdamW
state, compute in ``--dtype`` (bfloat16: our activations and weight matmuls in bf16, i.e.
ModelConfig.dtype and distill precision.param_dtype; torch under ``torch.autocast`` bf16):
student forward + backward on student prompt + response (length ``--student-len``), teacher
(EMA copy) forward without gradient on teacher prompt + the same response
(``--teacher-len``), the same loss on the response tokens (generalized JSD alpha=0.5 over
the student's top-100 + tail bucket, or full-vocabulary reverse KL: ``--loss``), token-mean,
global-norm clip 1.0, AdamW (lr 1e-5, wd 0.01), and the EMA teacher update. The torch side
computes logits only on the response positions too (hidden states of the base model gathered,
then ``lm_head``), so neither side pays for prompt logits. Both get an all-ones attention mask,
as a trainer would pass (HF drops an all-ones mask; ours runs the mask it is given).

Each side runs in its own process (``python bench_train_step.py --child jax|torch ...``,
one after the other; see ``benchmarks/bench_common.py``): JAX keeps the GPU memory it took
until its process ends. Each child also measures its framework's GEMM peak on the device in
the compute dtype (a large square ``jnp.dot`` / ``torch.matmul``; ``--gemm-n``); the parent
takes the larger as the peak and prints, per side: s/step (median of ``--steps`` after a
warm-up step), model TFLOP/s and its fraction of that peak, peak memory (GPU: the device
allocator's peak; CPU: peak RSS), and the ratio.

Model FLOPs per step (:func:`model_flops`; remat recompute not counted): per token of each
sequence ``2 * N_body`` (the decoder's matmul weights without the LM head) plus causal
attention ``2 * q_size * T`` per layer (QK^T and PV over the causal half of the T x T
scores), plus ``2 * V * D`` for the LM head on the R response positions only; the student
(forward + backward) counts 3x, the teacher (forward only) 1x.

    python benchmarks/bench_train_step.py                       # CPU, SmolLM2-135M, B=16
    python benchmarks/bench_train_step.py --batch 4 --steps 2   # a quick CPU figure
    python benchmarks/bench_train_step.py --device gpu --model llama3-8b --layers 8 \\
        --batch 16 --student-len 1024 --teacher-len 1536 --response-len 512 \\
        --dtype bfloat16 --steps 5                               # the GPU figure (README)

``--ablate``: the same measurement once per variant, each in its own process: all of issue
50's changes on (the new defaults), then one run per change switched off, then our XLA GPU
flags off (``launch/xla_gpu_flags.sh``, which ``launch/gpu.sh`` sets for the trainer; every
run of ours gets them unless ``--no-launch-xla-flags``), plus torch + HF once (after the
baseline); one table: s/step, model TFLOP/s, % of the GEMM peak measured in the same run,
peak memory, the ratio to torch + HF and what switching the change off costs. What each
variant flips: :func:`ablation_variants`. ``--variants`` picks and orders them, ``--budget``
stops starting children when the next would not fit (the table says which were not run),
``--out`` writes the table as JSON (rewritten after every child, so a killed run keeps what
it measured), ``--dry`` prints the child command lines without running them:

    python benchmarks/bench_train_step.py --device gpu --ablate --model llama3-8b --layers 8 \\
        --batch 16 --student-len 1024 --teacher-len 1536 --response-len 512 \\
        --dtype bfloat16 --steps 3 --budget 540 --out benchmarks/results/ablate_gpu.json
    python benchmarks/bench_train_step.py --device cpu --ablate --model tiny-llama \\
        --batch 2 --student-len 32 --teacher-len 48 --response-len 16 --chunk 12 \\
        --steps 1 --gemm-n 256                                    # the same on a CPU, tiny

``--gemm-shapes`` also times ``jnp.dot`` against ``torch.matmul`` on the step's matmul
shapes. Threads (CPU): torch uses ``--threads`` intra-op threads; XLA's CPU backend uses all
cores. The 1-minute load average is printed with each figure (shared hosts).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks import bench_common as bc  # noqa: E402

LAUNCH_FLAGS_SH = REPO / "launch" / "xla_gpu_flags.sh"


# ------------------------------------------------------------------------------ variants
@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of ``--ablate``: a child process (``side``) run with ``argv`` added."""

    name: str  # what --variants calls it
    label: str  # the table's row label
    flips: str  # the knob it sets, for the legend and the JSON
    side: str = "jax"
    argv: tuple[str, ...] = ()


BASELINE = Variant("baseline", "all on (baseline)",
                   "the new defaults: distill.precision.right_padded=True, "
                   "distill.loss.top_k_impl as --top-k-impl (auto), the LM head in the compute "
                   "dtype, loss chunks dividing R, remat --remat, XLA GPU flags of "
                   "launch/xla_gpu_flags.sh")
TORCH = Variant("torch", "torch + HF", "HF LlamaForCausalLM, sdpa attention, AdamW (fused on "
                "GPU), torch.autocast bf16 with --dtype bfloat16", side="torch")
# in the order they run: the estimates of each share of the gap, largest first
OFF_VARIANTS: tuple[Variant, ...] = (
    Variant("topk", "part 2 off: top-K by sort",
            "distill.loss.top_k_impl=sort (lax.top_k: a full-vocabulary sort on GPU)",
            argv=("--top-k-impl", "sort")),
    Variant("attention", "part 1 off: padding as mask",
            "distill.precision.right_padded=False (cuDNN gets a [B,1,T,S] mask: a bias and "
            "its dbias)", argv=("--no-right-padded",)),
    Variant("lm_head", "part 3 off: fp32 LM-head bwd",
            "the LM head's product as before part 3: fp32 cotangent against the compute-dtype "
            "operands (child-only stand-in: chunked.lowp_dtype -> None)",
            argv=("--lm-head-fp32",)),
    Variant("xla_flags", "XLA GPU flags off",
            "XLA_FLAGS without launch/xla_gpu_flags.sh's flags", argv=("--no-launch-xla-flags",)),
    Variant("chunks", "part 3 off: padded chunks",
            "the loss chunk as --chunk gives it, the last one padded (child-only stand-in: "
            "chunked.chunk_for_length -> min(chunk, R))", argv=("--pad-chunks",)),
)
VARIANT_NAMES: tuple[str, ...] = tuple(v.name for v in (BASELINE, TORCH, *OFF_VARIANTS))
# parent-only options, not passed to children (name -> takes a value); probes: baseline only
PARENT_ONLY = {"--ablate": False, "--dry": False, "--variants": True, "--ablate-remat": True,
               "--budget": True, "--out": True}
BASELINE_ONLY = {"--attention-probe": False, "--gemm-shapes": False}


def remat_variant(policy: str) -> Variant:
    flips = ("distill.precision.remat=False (no recompute)" if policy == "none" else
             f"distill.precision.remat_policy={policy}")
    return Variant(f"remat:{policy}", f"part 4: remat {policy}", flips,
                   argv=("--remat", policy))


def ablation_variants(args: argparse.Namespace) -> list[Variant]:
    """The children of ``--ablate`` in run order: the baseline first (always), then torch +
    HF, then each change off (``--variants`` picks and orders them; ``remat:POLICY`` for a
    remat policy), then ``--ablate-remat``'s policies other than ``--remat``."""
    fixed = {v.name: v for v in (BASELINE, TORCH, *OFF_VARIANTS)}
    if args.variants:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
    else:
        names = [*fixed, *(f"remat:{p.strip()}" for p in args.ablate_remat.split(",")
                           if p.strip())]
    out = [BASELINE]
    for n in names:
        if n.startswith("remat:"):
            policy = n.split(":", 1)[1]
            if policy not in _remat_policies():
                raise SystemExit(f"--variants {n}: {policy!r} is not one of {_remat_policies()}")
            v = remat_variant(policy)
            if policy == args.remat:
                continue  # that is the baseline
        elif n in fixed:
            v = fixed[n]
        else:
            raise SystemExit(f"--variants: {n!r} is not one of {VARIANT_NAMES} or remat:POLICY")
        if (v.side == "torch" and args.skip_torch) or (v.side == "jax" and args.skip_jax):
            continue
        if v not in out:
            out.append(v)
    if args.skip_jax:
        out.remove(BASELINE)
    return out


def child_argv(argv: list[str], variant: Variant) -> list[str]:
    """The parent's ``argv`` for ``variant``'s child: without the parent-only options (and the
    probes, except for the baseline), ``variant.argv`` appended (argparse: the last wins)."""
    drop = dict(PARENT_ONLY)
    if variant != BASELINE:
        drop.update(BASELINE_ONLY)
    out: list[str] = []
    it = iter(argv)
    for a in it:
        name = a.split("=", 1)[0]
        if name in drop:
            if drop[name] and "=" not in a:
                next(it, None)
            continue
        out.append(a)
    return [*out, *variant.argv]


def launch_xla_flags() -> list[str]:
    """The flags of ``launch/xla_gpu_flags.sh`` (what launch/gpu.sh gives the trainer)."""
    script = 'source "$0" && printf "%s\\n" "${PMD_XLA_GPU_FLAG_LIST[@]}"'
    r = subprocess.run(["bash", "-c", script, str(LAUNCH_FLAGS_SH)], capture_output=True,
                       text=True, timeout=60, check=True)
    return r.stdout.split()


def xla_accepts(flags: list[str]) -> bool:
    """Whether this jaxlib starts with ``flags`` in XLA_FLAGS (XLA aborts on a flag it does
    not know; its CPU client parses the GPU flags too, so this runs on the CPU)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
    code = "import jax.numpy as jnp; (jnp.ones(2) + 1).block_until_ready()"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          timeout=300).returncode == 0


_USABLE: dict[str, tuple[list[str], list[str]]] = {}


def usable_launch_flags() -> tuple[list[str], list[str]]:
    """(kept, dropped): the launch flags this jaxlib knows, and those it would abort on (a
    jaxlib other than the one they were checked with; each dropped one is printed)."""
    if "v" not in _USABLE:
        flags = launch_xla_flags()
        if xla_accepts(flags):
            _USABLE["v"] = (flags, [])
        else:
            kept = [f for f in flags if xla_accepts([f])]
            dropped = [f for f in flags if f not in kept]
            print(f"launch/xla_gpu_flags.sh: this jaxlib does not know {dropped}: our "
                  f"children run without them", flush=True)
            _USABLE["v"] = (kept, dropped)
    return _USABLE["v"]


def jax_env(args: argparse.Namespace, launch_flags: bool) -> dict[str, str]:
    """Our child's environment: XLA_FLAGS = the launch flags (unless off; those this jaxlib
    knows), then the environment's XLA_FLAGS, then ``--xla-flags`` (XLA takes a flag's last
    value)."""
    env = bc.child_env("jax", args.device)
    flags = [*(usable_launch_flags()[0] if launch_flags else []), env.get("XLA_FLAGS", ""),
             args.xla_flags]
    env["XLA_FLAGS"] = " ".join(f for f in flags if f)
    return env


def _remat_policies() -> tuple[str, ...]:
    from pmd_jax.models.remat import REMAT_POLICIES

    return REMAT_POLICIES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--model", choices=bc.MODELS, default="smollm2-135m")
    p.add_argument("--layers", type=int, default=0, help="cut the model to N layers (0: all)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--student-len", type=int, default=256)
    p.add_argument("--teacher-len", type=int, default=384)
    p.add_argument("--response-len", type=int, default=192)
    p.add_argument("--steps", type=int, default=3, help="timed steps per side (after warm-up)")
    p.add_argument("--loss", choices=("jsd_top100", "rkl_full"), default="jsd_top100")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    p.add_argument("--remat", choices=_remat_policies(), default="dots_no_batch",
                   help="our decoder's remat policy (compiled memory of each: "
                        "benchmarks/bench_remat_memory.py, docs/benchmarks.md)")
    p.add_argument("--layer-loop", choices=("scan", "unrolled"), default="scan",
                   help="distill.precision.layer_loop")
    p.add_argument("--attention", default="auto",
                   help="model.attention_impl[:chunk], e.g. chunked:64, cudnn (auto: by "
                        "backend, see pmd_jax/models/attention_select.py)")
    p.add_argument("--chunk", type=int, default=96, help="response tokens per loss chunk")
    p.add_argument("--chunk-remat", action="store_true",
                   help="recompute each loss chunk's logits in the backward pass")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype of both sides (fp32 master weights and AdamW state)")
    p.add_argument("--matmul-dtype", choices=("", "bfloat16"), default="",
                   help="our distill.precision.matmul_dtype (bf16 operands, fp32 results) ")
    p.add_argument("--torch-autocast", action="store_true",
                   help="torch under autocast bf16 even with --dtype float32")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--skip-jax", action="store_true")
    p.add_argument("--gemm-n", type=int, default=0,
                   help="square GEMM size of the peak (0: 2048 on CPU, 8192 on GPU)")
    p.add_argument("--gemm-shapes", action="store_true",
                   help="also time jnp.dot vs torch.matmul on the step's matmul shapes")
    p.add_argument("--attention-probe", action="store_true",
                   help="also time one layer's attention forward+backward at the student's "
                        "shape in each implementation (cuDNN with the padding as lengths, as "
                        "a mask, and without, on GPU; its xla twin on CPU; dense, chunked)")
    p.add_argument("--xla-flags", default="", help="extra XLA_FLAGS for our child")
    p.add_argument("--no-launch-xla-flags", dest="launch_xla_flags", action="store_false",
                   help="our child without the XLA GPU flags of launch/xla_gpu_flags.sh")
    # issue 50's changes, each on by default (--ablate switches each off in turn)
    p.add_argument("--no-right-padded", dest="right_padded", action="store_false",
                   help="part 1 off: distill.precision.right_padded=False (cuDNN attention "
                        "gets the padding as a mask: a bias, and its dbias)")
    p.add_argument("--top-k-impl", default="auto",
                   help="part 2: distill.loss.top_k_impl (auto | sort | two_stage; sort is "
                        "lax.top_k, the full-vocabulary sort on GPU)")
    p.add_argument("--lm-head-fp32", action="store_true",
                   help="part 3 off: the LM head's product with an fp32 cotangent in the "
                        "backward, as before (a stand-in in this child: the library has no "
                        "knob for it)")
    p.add_argument("--pad-chunks", action="store_true",
                   help="part 3 off: --chunk used as given, the last chunk padded, as before "
                        "(a stand-in in this child: no library knob)")
    # the ablation (parent only)
    p.add_argument("--ablate", action="store_true",
                   help="one run per variant (each change off in turn), one table")
    p.add_argument("--variants", default="",
                   help=f"--ablate: these variants in this order (comma list of "
                        f"{', '.join(VARIANT_NAMES)}, remat:POLICY; default all)")
    p.add_argument("--ablate-remat", default="none,full",
                   help="--ablate: the remat policies (part 4) run against --remat's (none: "
                        "no recompute, the floor; full: the config's default, the most)")
    p.add_argument("--budget", type=float, default=0,
                   help="--ablate: seconds for the whole run; a child that would not fit "
                        "(by the longest of ours so far) is not started (0: no limit)")
    p.add_argument("--out", default="", help="--ablate: write the table as JSON here")
    p.add_argument("--dry", action="store_true",
                   help="--ablate: print the child command lines, run none")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per side")
    p.add_argument("--child", choices=("jax", "torch"), help=argparse.SUPPRESS)
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if not args.gemm_n:
        args.gemm_n = 8192 if args.device == "gpu" else 2048
    return args


def peak_dtype(args) -> str:
    """bf16 matmuls on either side: the bf16 GEMM peak is the ceiling."""
    return ("bfloat16" if args.dtype == "bfloat16" or args.matmul_dtype
            or args.torch_autocast else "float32")


# ------------------------------------------------------------------------------ data
def make_data(args, vocab: int) -> dict[str, np.ndarray]:
    b, ts, tt, r = args.batch, args.student_len, args.teacher_len, args.response_len
    if not (0 < r < ts and r < tt):
        raise SystemExit(f"--response-len {r} must be < student {ts} and teacher {tt} lengths")
    rng = np.random.default_rng(0)
    resp = rng.integers(0, vocab, (b, r), dtype=np.int64)
    s_tok = np.concatenate([rng.integers(0, vocab, (b, ts - r)), resp], axis=1)
    t_tok = np.concatenate([rng.integers(0, vocab, (b, tt - r)), resp], axis=1)
    return {
        "student_tokens": s_tok.astype(np.int32),
        "teacher_tokens": t_tok.astype(np.int32),
        "responses": resp.astype(np.int32),
        "student_index": np.broadcast_to(np.arange(ts - r - 1, ts - 1), (b, r)).astype(np.int32),
        "teacher_index": np.broadcast_to(np.arange(tt - r - 1, tt - 1), (b, r)).astype(np.int32),
    }


def model_flops(cfg, args) -> float:
    """Model FLOPs of one step (see the module docstring); no remat recompute counted."""
    b, ts, tt, r = args.batch, args.student_len, args.teacher_len, args.response_len
    head = 2.0 * cfg.vocab_size * cfg.hidden_size  # LM head, per projected position

    def fwd(t: int) -> float:  # forward FLOPs of one sequence of length t
        return t * (cfg.flops_per_token(t) - head) + r * head

    return b * (3.0 * fwd(ts) + fwd(tt))


def step_gemm_shapes(cfg, args) -> list[tuple[str, tuple[int, int, int]]]:
    """The step's matmuls (forward orientation) at the student's token count."""
    m = args.batch * args.student_len
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [
        ("q/o proj", (m, d, q)), ("k/v proj", (m, d, kv)), ("gate/up", (m, d, f)),
        ("down", (m, f, d)), ("dW gate/up (bwd)", (d, m, f)),
        ("LM head chunk", (args.batch * min(args.chunk, args.response_len), d,
                           cfg.vocab_size)),
    ]


def _gemms(args, cfg, rate) -> dict:
    out = {"gemm_peak_tflops": rate(args.gemm_n, args.gemm_n, args.gemm_n)}
    if args.gemm_shapes:
        out["gemm_shapes"] = {name: rate(*mkn) for name, mkn in step_gemm_shapes(cfg, args)}
    return out


# ------------------------------------------------------------------------------ jax
def attention_probe(cfg, args) -> dict[str, float | str]:
    """ms per forward+backward of one layer's attention (B, student T, the model's heads) in
    each implementation; a variant that fails gives its error instead."""
    import functools

    import jax
    import jax.numpy as jnp

    from pmd_jax.models import attention as attn
    from pmd_jax.models import attention_fused as fused

    B, T, hd = args.batch, args.student_len, cfg.head_dim
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    dt = jnp.dtype(cfg.dtype)
    q = jax.random.normal(ks[0], (B, T, cfg.num_heads, hd), jnp.float32).astype(dt)
    k, v = (jax.random.normal(kk, (B, cfg.num_kv_heads, T, hd), jnp.float32).astype(dt)
            for kk in ks[1:])
    km = jnp.ones((B, T), jnp.bool_)
    i = jnp.arange(T)
    lib = "cudnn" if args.device == "gpu" else "xla"
    variants = {
        f"{lib} + padding as sequence lengths (as the step)": functools.partial(
            fused.dpa_attention, seq_lengths=fused.right_padded_lengths(km),
            implementation=lib),
        f"{lib} + padding mask (a bias, and its dbias)": functools.partial(
            fused.dpa_attention, key_mask=km, implementation=lib),
        f"{lib} causal only": functools.partial(fused.dpa_attention, implementation=lib),
        "dense": functools.partial(attn.dense_attention,
                                   mask=jnp.broadcast_to(i[None, :] <= i[:, None], (B, T, T))),
        "chunked": functools.partial(attn.chunked_attention, key_mask=km,
                                     q_chunk=cfg.attention_chunk, k_chunk=cfg.attention_chunk),
    }
    out: dict[str, float | str] = {}
    for name, fn in variants.items():
        g = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                             argnums=(0, 1, 2)))
        try:
            out[name] = 1e3 * bc.best_time(lambda g=g: jax.block_until_ready(g(q, k, v)), 5)
        except Exception as e:  # noqa: BLE001  (reported, the benchmark goes on)
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return out


def _set_knob(section: Any, key: str, value: Any, default: Any) -> None:
    """``section.key = value``; a knob this checkout lacks is an error unless ``value`` is its
    default (then there is nothing to set)."""
    if key in section:
        setattr(section, key, value)
    elif value != default:
        raise SystemExit(f"this checkout's distill config has no {key!r} knob (asked: "
                         f"{value!r}); its --ablate variant cannot run here")


def before_part3(args: argparse.Namespace) -> dict[str, Any]:
    """The LM head and the loss chunks as before issue 50's part 3, where asked: stand-ins in
    this child only (the library keeps no switch for them). Returns what the step will use."""
    from pmd_jax.distill import chunked

    r = args.response_len
    if args.lm_head_fp32:
        if not hasattr(chunked, "lowp_dtype"):
            raise SystemExit("--lm-head-fp32: this checkout's chunked.py has no lowp_dtype "
                             "(part 3 not landed: the head is already as before)")
        chunked.lowp_dtype = lambda *arrays: None  # project(): the fp32 einsum, as before
    if args.pad_chunks:
        if not hasattr(chunked, "chunk_for_length"):
            raise SystemExit("--pad-chunks: this checkout's chunked.py has no chunk_for_length "
                             "(part 3 not landed: chunks are already as before)")
        chunked.chunk_for_length = lambda length, chunk: min(chunk, max(length, 1))
    pick = getattr(chunked, "chunk_for_length", lambda length, chunk: min(chunk, length))
    c = pick(r, args.chunk)
    n = -(-r // c)
    lm = "fp32 cotangent (before part 3)" if args.lm_head_fp32 else "compute dtype"
    if args.matmul_dtype:
        lm = f"{args.matmul_dtype} (--matmul-dtype)"
    return {"loss_chunks": f"{n} x {c}" + (f" ({n * c} rows for {r})" if n * c != r else ""),
            "lm_head_gemms": lm}


def child_jax(args) -> dict:
    import jax

    from pmd_jax.distill import step as st
    from pmd_jax.distill.config import default_distill_config, freeze_distill_config
    from pmd_jax.models import attend

    knobs = before_part3(args)
    cfg = bc.model_config(args.model, args.layers, args.dtype)
    impl, _, blk = args.attention.partition(":")
    cfg = cfg.replace(attention_impl=impl, **({"attention_chunk": int(blk)} if blk else {}))
    res = _gemms(args, cfg, lambda m, k, n: bc.jax_matmul_tflops(m, k, n, peak_dtype(args)))
    bc.log(f"jax: {bc.device_name('jax', args.device)}; GEMM peak "
           f"{res['gemm_peak_tflops']:.3g} TFLOP/s ({peak_dtype(args)})")
    res["attention"] = {
        side: attend.choose(cfg, impl, T=t, S=t, has_cache=False, key_padding=True,
                            segments=False, shared_prefix=False,
                            right_padded=args.right_padded).__dict__
        for side, t in (("student", args.student_len), ("teacher", args.teacher_len))}
    if args.attention_probe:
        res["attention_probe_ms"] = attention_probe(cfg, args)
    params = bc.init_params(cfg)
    data = make_data(args, cfg.vocab_size)
    c = default_distill_config()
    c.teacher.rule = "ema"
    c.optim.warmup_steps = 0
    c.loss.chunk_size = args.chunk
    c.loss.rollout_is_threshold = None
    c.precision.remat = args.remat != "none"
    c.precision.layer_loop = args.layer_loop
    c.precision.param_dtype = args.dtype
    c.precision.matmul_dtype = args.matmul_dtype
    if args.remat != "none":
        c.precision.remat_policy = args.remat
    _set_knob(c.precision, "right_padded", args.right_padded, True)
    _set_knob(c.loss, "top_k_impl", args.top_k_impl, "auto")
    res["knobs"] = {"right_padded": args.right_padded, "top_k_impl": args.top_k_impl,
                    **knobs, "remat": args.remat, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    if args.loss == "jsd_top100":
        c.loss.alpha, c.loss.topk, c.loss.add_tail = 0.5, 100, True
    else:
        c.loss.alpha, c.loss.topk = 1.0, None
    ts = st.TrainStep(cfg, freeze_distill_config(c), loss_chunk_remat=args.chunk_remat)
    b = args.batch
    batch = dict(data)
    for side in ("student", "teacher"):
        t = data[f"{side}_tokens"].shape[1]
        batch[f"{side}_positions"] = np.broadcast_to(np.arange(t), (b, t)).astype(np.int32)
        batch[f"{side}_attn_mask"] = np.ones((b, t), np.int32)
    batch["response_mask"] = np.ones(data["responses"].shape, np.int32)
    batch["sd_mask"] = np.ones((b,), np.float32)
    batch = {k: jax.device_put(v) for k, v in batch.items()}
    state = ts.init(params, 0)
    del params
    t0 = time.perf_counter()
    state, m = ts.step(state, batch)
    jax.block_until_ready(m)
    res["first_step_s"] = time.perf_counter() - t0
    res["first_loss"] = float(m["loss"])
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = ts.step(state, batch)
        jax.block_until_ready((state.params, m))
        times.append(time.perf_counter() - t0)
    res["steps_s"] = times
    res["peak_mem_gib"], res["mem_what"] = bc.jax_peak_memory()
    res["device"] = bc.device_name("jax", args.device)
    return res


# ------------------------------------------------------------------------------ torch
def child_torch(args) -> dict:
    import jax
    import torch

    dev = bc.torch_device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = bc.model_config(args.model, args.layers, args.dtype)
    res = _gemms(args, cfg, lambda m, k, n: bc.torch_matmul_tflops(
        m, k, n, peak_dtype(args), args.device))
    bc.log(f"torch: {bc.device_name('torch', args.device)}; GEMM peak "
           f"{res['gemm_peak_tflops']:.3g} TFLOP/s ({peak_dtype(args)})")
    params = jax.tree.map(np.asarray, bc.init_params(cfg))  # JAX on the CPU (child_env)
    data = make_data(args, cfg.vocab_size)
    student = bc.hf_llama(cfg, args.device)
    bc.load_into_torch(student, params, cfg)
    del params
    student.train()
    teacher = copy.deepcopy(student).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01, fused=dev == "cuda")

    def tens(name):
        return torch.from_numpy(data[name].astype(np.int64)).to(dev)

    s_tok, t_tok, resp = tens("student_tokens"), tens("teacher_tokens"), tens("responses")
    s_idx, t_idx = tens("student_index"), tens("teacher_index")
    mask = torch.ones(resp.shape, dtype=torch.float32, device=dev)
    alpha = 0.5 if args.loss == "jsd_top100" else 1.0

    def resp_logits(model, tok, idx):
        h = model.model(input_ids=tok, attention_mask=torch.ones_like(tok)).last_hidden_state
        h = torch.gather(h, 1, idx[..., None].expand(-1, -1, h.shape[-1]))
        return model.lm_head(h).float()

    def add_tail(lp):
        lse = torch.logsumexp(lp, dim=-1, keepdim=True).clamp(max=-1e-7)
        return torch.cat([lp, torch.log(-torch.expm1(lse))], dim=-1)

    def loss_fn(s_logits, t_logits):
        s = torch.log_softmax(s_logits, -1)
        t = torch.log_softmax(t_logits, -1)
        if args.loss == "jsd_top100":
            idx = s.detach().topk(100, dim=-1).indices
            s, t = add_tail(s.gather(-1, idx)), add_tail(t.gather(-1, idx))
            log_m = torch.logsumexp(
                torch.stack([s + np.log(1 - alpha), t + np.log(alpha)]), dim=0)
            per = (1 - alpha) * (s.exp() * (s - log_m)).sum(-1) + alpha * (
                t.exp() * (t - log_m)).sum(-1)
        else:
            per = (s.exp() * (s - t)).sum(-1)
        return (per * mask).sum() / mask.sum().clamp(min=1)

    def autocast():
        on = args.dtype == "bfloat16" or args.torch_autocast
        return torch.autocast("cuda" if dev == "cuda" else "cpu", dtype=torch.bfloat16,
                              enabled=on)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def step():
        with torch.no_grad(), autocast():
            t_logits = resp_logits(teacher, t_tok, t_idx)
        with autocast():
            s_logits = resp_logits(student, s_tok, s_idx)
        loss = loss_fn(s_logits, t_logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for pt, ps in zip(teacher.parameters(), student.parameters()):
                pt.lerp_(ps, 0.05)
        return loss.detach()

    t0 = time.perf_counter()
    res["first_loss"] = float(step())
    sync()
    res["first_step_s"] = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    res["steps_s"] = times
    res["peak_mem_gib"], res["mem_what"] = bc.torch_peak_memory(args.device)
    res["device"] = bc.device_name("torch", args.device)
    return res


def child_main(args) -> None:
    bc.child_job(args, {"jax": child_jax, "torch": child_torch})


# ------------------------------------------------------------------------------ parent
def header(args: argparse.Namespace, cfg: Any, flops: float) -> str:
    return (f"{args.model} ({cfg.num_layers} layers, {cfg.num_params() / 1e9:.2f}B params, "
            f"random weights) train step on {args.device}: B={args.batch} student "
            f"T={args.student_len} teacher T={args.teacher_len} response R={args.response_len} "
            f"loss={args.loss} dtype={args.dtype} matmul_dtype={args.matmul_dtype or 'same'} "
            f"remat={args.remat} layer_loop={args.layer_loop} attention={args.attention} "
            f"chunk={args.chunk} chunk_remat={args.chunk_remat} "
            f"launch_xla_flags={'on' if args.launch_xla_flags else 'off'}; "
            f"{flops / 1e12:.4g} model TFLOP/step; {bc.load()}")


def report_child(args: argparse.Namespace, side: str, r: dict[str, Any],
                 label: str = "") -> None:
    """One finished child's lines (``r`` gets its median ``s_per_step``)."""
    r["s_per_step"] = float(np.median(r["steps_s"]))
    first = "compile+first step" if side == "jax" else "first step"
    print(f"{label or side}: {r['device']}; {first} {r['first_step_s']:.1f} s, "
          f"steps {[round(x, 3) for x in r['steps_s']]}, first-step loss "
          f"{r['first_loss']:.6f} ({r['load']})", flush=True)
    if side == "jax":
        k = r.get("knobs", {})
        if k:
            print("  " + ", ".join(f"{n}={v}" for n, v in k.items() if n != "xla_flags")
                  + f"; XLA_FLAGS={k.get('xla_flags') or '(none)'}")
        for s, c in r["attention"].items():
            print(f"  attention ({s}): {c['impl']} ({c['reason']})")
        for name, ms in r.get("attention_probe_ms", {}).items():
            val = f"{ms:.2f} ms" if isinstance(ms, float) else ms
            print(f"  attention probe, one layer fwd+bwd at B={args.batch} "
                  f"T={args.student_len}: {name}: {val}")


def side_env(args: argparse.Namespace, side: str, launch_flags: bool) -> dict[str, str]:
    return (jax_env(args, launch_flags) if side == "jax"
            else bc.child_env(side, args.device))


# ------------------------------------------------------------------------------ --ablate
def table_rows(rows: list[dict[str, Any]], flops: float) -> tuple[list[dict[str, Any]], float]:
    """``rows`` (one per child, in run order; ``status`` "ok" for a measured one) with the
    derived columns added, and the GEMM peak of the run (the largest any child measured):
    ``tflops`` (model TFLOP/s), ``pct_peak``, ``vs_torch`` (torch + HF's s/step over this
    row's: > 1 is faster than torch), ``off_cost_s`` (this row's s/step minus the baseline's:
    what the change it switches off buys; for a remat row, the other policy's difference),
    ``loss_rel`` (first-step loss vs the baseline's)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    peak = max((r["gemm_peak_tflops"] for r in ok), default=float("nan"))
    by = {r["variant"]: r for r in ok}
    base, torch = by.get(BASELINE.name), by.get(TORCH.name)
    out = []
    for r in rows:
        r = dict(r)
        if r.get("status") == "ok":
            sps = r["s_per_step"]
            r["tflops"] = flops / sps / 1e12
            r["pct_peak"] = r["tflops"] / peak
            r["vs_torch"] = torch["s_per_step"] / sps if torch else None
            off = base is not None and r["variant"] not in (BASELINE.name, TORCH.name)
            r["off_cost_s"] = sps - base["s_per_step"] if off else None
            r["loss_rel"] = (abs(r["first_loss"] - base["first_loss"])
                             / max(abs(base["first_loss"]), 1e-12)
                             if base is not None and r["variant"] != BASELINE.name else None)
        out.append(r)
    return out, peak


def format_table(rows: list[dict[str, Any]]) -> str:
    """The table :func:`ablate` prints (rows from :func:`table_rows`); a row not measured
    shows its status instead of figures."""
    cols = ["variant", "s/step", "TFLOP/s", "% peak", "peak GiB", "x torch",
            "d s/step vs base", "loss vs base", "compile s"]
    cells: list[list[str]] = []
    for r in rows:
        if r.get("status") != "ok":
            cells.append([r["label"], r.get("status", "?")])
            continue
        cost = r["off_cost_s"]
        cells.append([
            r["label"], f"{r['s_per_step']:.3f}", f"{r['tflops']:.3g}", f"{r['pct_peak']:.0%}",
            f"{r['peak_mem_gib']:.2f}",
            "" if r["vs_torch"] is None else f"{r['vs_torch']:.2f}x",
            "" if cost is None else f"{cost:+.3f} ({cost / (r['s_per_step'] - cost):+.0%})",
            "" if r["loss_rel"] is None else f"{r['loss_rel']:.1e}",
            f"{r['first_step_s']:.1f}"])
    full = [c for c in cells if len(c) == len(cols)]
    widths = [max(len(cols[i]), *(len(c[i]) for c in full)) for i in range(len(cols))]
    widths[0] = max(widths[0], *(len(c[0]) for c in cells))

    def line(c: list[str]) -> str:
        if len(c) != len(cols):
            return f"{c[0].ljust(widths[0])}  {c[1]}"
        return "  ".join(x.ljust(w) if i == 0 else x.rjust(w)
                         for i, (x, w) in enumerate(zip(c, widths)))

    return "\n".join(line(c) for c in [cols, *cells])


def child_command(args: argparse.Namespace, argv: list[str], v: Variant
                  ) -> tuple[list[str], dict[str, str]]:
    """``variant``'s child: its command line and its environment."""
    env = side_env(args, v.side, "--no-launch-xla-flags" not in child_argv(argv, v))
    cmd = [sys.executable, os.path.relpath(os.path.abspath(__file__), REPO), "--child", v.side,
           *child_argv(argv, v)]
    return cmd, env


def ablate(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """``--ablate``: one child per variant (:func:`ablation_variants`), one table; returns the
    JSON written to ``--out``."""
    cfg = bc.model_config(args.model, args.layers, args.dtype)
    flops = model_flops(cfg, args)
    variants = ablation_variants(args)
    print(header(args, cfg, flops), flush=True)
    print(f"--ablate: {len(variants)} children, each in its own process, one after the other: "
          f"{', '.join(v.name for v in variants)}", flush=True)
    if args.dry:
        print("# --dry: the children's commands (run from the repository root; none was run)")
        for v in variants:
            cmd, env = child_command(args, argv, v)
            diff = {k: env[k] for k in ("JAX_PLATFORMS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                        "XLA_FLAGS") if env.get(k) != os.environ.get(k)}
            print(f"# {v.label}: {v.flips}")
            print(shlex.join(["env", *(f"{k}={x}" for k, x in diff.items()), *cmd]))
        return {}
    doc: dict[str, Any] = {
        "command": shlex.join(["python", "benchmarks/bench_train_step.py", *argv]),
        "header": header(args, cfg, flops), "model_tflop_per_step": flops / 1e12,
        "peak_dtype": peak_dtype(args), "gemm_n": args.gemm_n,
        "launch_xla_flags": usable_launch_flags()[0],
        "launch_xla_flags_dropped": usable_launch_flags()[1],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": []}
    rows: list[dict[str, Any]] = []
    t_start, longest = time.perf_counter(), 0.0
    for v in variants:
        row: dict[str, Any] = {"variant": v.name, "label": v.label, "flips": v.flips,
                               "side": v.side}
        left = args.budget - (time.perf_counter() - t_start) if args.budget else None
        if left is not None and rows and longest > left:
            row["status"] = (f"not run: {left:.0f} s of --budget left, the longest child took "
                             f"{longest:.0f} s")
            print(f"{v.label}: {row['status']}", flush=True)
        else:
            cmd, env = child_command(args, argv, v)
            timeout = args.timeout if left is None else max(1.0, min(args.timeout, left))
            t0 = time.perf_counter()
            r = bc.run_child(os.path.abspath(__file__), v.side, cmd[4:], env, timeout)
            row["wall_s"] = time.perf_counter() - t0
            longest = max(longest, row["wall_s"])
            if r is None:
                row["status"] = "FAILED (its reason is printed above)"
            else:
                row.update(r, status="ok")
                report_child(args, v.side, row, v.label)
        rows.append(row)
        doc["rows"], doc["gemm_peak_tflops"] = table_rows(rows, flops)
        if args.out:
            write_json(args.out, doc)
    table, peak = table_rows(rows, flops)
    print(f"\n{peak_dtype(args)} GEMM peak of this run ({args.gemm_n}^3, the largest any "
          f"child measured on its device): {peak:.3g} TFLOP/s; model FLOPs "
          f"{flops / 1e12:.4g} TFLOP/step; x torch: torch + HF's s/step / the row's (> 1: "
          f"faster); d s/step vs base: the row's s/step - the baseline's (for a change switched "
          f"off: what the change buys); memory: "
          f"{next((r['mem_what'] for r in table if r.get('status') == 'ok'), '-')}")
    print(format_table(table))
    print("what each row sets:")
    for r in table:
        print(f"  {r['label']}: {r['flips']}")
    if args.out:
        print(f"wrote {write_json(args.out, doc)}")
    return doc


def write_json(path: str, doc: dict[str, Any]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(out)
    return out


def main() -> None:
    args = parse()
    if args.child:
        child_main(args)
        return
    if args.ablate:
        ablate(args, sys.argv[1:])
        return
    cfg = bc.model_config(args.model, args.layers, args.dtype)
    flops = model_flops(cfg, args)
    print(header(args, cfg, flops), flush=True)
    res = {}
    for side in ("jax", "torch"):
        if getattr(args, f"skip_{side}"):
            continue
        r = bc.run_child(os.path.abspath(__file__), side, sys.argv[1:],
                         side_env(args, side, args.launch_xla_flags), args.timeout)
        if r is not None:
            res[side] = r
            report_child(args, side, r)
    if not res:
        return
    peak = max(r["gemm_peak_tflops"] for r in res.values())
    who = " / ".join(f"{s} {r['gemm_peak_tflops']:.3g}" for s, r in res.items())
    print(f"{peak_dtype(args)} GEMM peak ({args.gemm_n}^3, same run, same device): {who} "
          f"TFLOP/s -> peak {peak:.3g} TFLOP/s")
    if args.gemm_shapes and len(res) == 2:
        print("the step's matmul shapes [m, k] x [k, n], TFLOP/s (jnp.dot vs torch.matmul):")
        for name, (m, k, n) in step_gemm_shapes(cfg, args):
            print(f"  {name:18s} {m:6d} x {k:5d} x {n:6d}: "
                  f"xla {res['jax']['gemm_shapes'][name]:8.3g}  "
                  f"torch {res['torch']['gemm_shapes'][name]:8.3g}")
    for side, r in res.items():
        tf = flops / r["s_per_step"] / 1e12
        name = "pmd_jax" if side == "jax" else "torch+HF"
        print(f"{name}: {r['s_per_step']:.3f} s/step, {tf:.3g} model TFLOP/s = "
              f"{tf / peak:.0%} of the {peak:.3g} TFLOP/s GEMM peak; peak memory "
              f"{r['peak_mem_gib']:.1f} GiB ({r['mem_what']})", flush=True)
    if len(res) == 2:
        j, t = res["jax"], res["torch"]
        rel = abs(j["first_loss"] - t["first_loss"]) / max(abs(t["first_loss"]), 1e-12)
        print(f"same weights, same batch: first-step loss pmd_jax {j['first_loss']:.6f} vs "
              f"torch {t['first_loss']:.6f} (rel. diff {rel:.1e})")
        print(f"ratio: pmd_jax is {t['s_per_step'] / j['s_per_step']:.2f}x torch+HF's speed "
              f"(s/step {j['s_per_step']:.3f} vs {t['s_per_step']:.3f}); peak memory "
              f"{j['peak_mem_gib']:.1f} vs {t['peak_mem_gib']:.1f} GiB")


if __name__ == "__main__":
    main()
