"""``--dry_run --config.dry_run.target=NAME``: will this config's step fit that hardware, and
how fast could it go?

On a simulated mesh with the target's chip count (fake CPU devices; ``cfg.mesh`` with its -1
axis resolved against that count), two programs are compiled on abstract arrays, no weights:

1. the REAL distillation step (:class:`pmd_jax.distill.step.TrainStep`) at the config's update
   batch (``rollout.problems_per_step x rollout.n`` rows, split into ``train.microbatch_rows``
   microbatches when set), student ``max_prompt_tokens + max_tokens``, teacher
   ``teacher_prompt.max_tokens + max_tokens`` tokens;
2. ONE DECODE STEP of the JAX sampler (``sampling.decode.decode_logits``: one token per row
   through the KV cache) at ``rollout.max_batch`` rows (at least the mesh's batch size) and a
   cache of ``max_prompt_tokens + max_tokens`` (or ``rollout.max_context``) tokens, params in
   the compute dtype (memory from the stacked-layer program, costs from the per-layer one).

For the GPU targets (8xH100, 8xH200) also the train step's GPU program
(:mod:`pmd_jax.dry_run.gpu_compile`): compiled by XLA:GPU without a GPU when the CUDA plugin
is installed (its ``memory_analysis()`` then decides the train step's verdict), else lowered
to CUDA StableHLO; either way the facts read from it (:mod:`pmd_jax.dry_run.gpu_facts`):
vocabulary sorts, cuDNN attention with or without ``dbias``, GEMM dtypes, per-layer saved
tensors. The output says which of the two ran.

For each: per-device bytes from ``compiled.memory_analysis()`` (arguments, outputs, aliased,
temporaries; total = arguments + outputs - aliased + temporaries) against the chip's HBM:
FITS / DOES NOT FIT and the headroom (:func:`pmd_jax.dry_run.hardware.verdict`). And a roofline step
time ``max(flops / peak, bytes / bandwidth)`` per device from ``compiled.cost_analysis()``:
a LOWER BOUND (perfect overlap, no communication, no launch or host time), with the MFU that
bound allows (model FLOPs: 3 x student forward + teacher forward(s), ``flops_per_token``
with the LM head on the response tokens only).

Two times are printed. The roofline with XLA's own counts (FLOPs and "bytes accessed"), and
the floor: the same FLOPs with each argument read and each output written once (params,
optimizer state, KV cache). XLA:CPU fuses far less than TPU/GPU backends and the cost
compiles keep dense T x S attention scores, so its bytes accessed are much higher than a TPU
or GPU program's: the roofline is pessimistic on the memory side, the floor optimistic; the
real step time lies above the floor.

XLA's cost analysis counts a loop body once, so the FLOPs and bytes come from extra compiles
without loops: one microbatch, the layers unrolled at depth 1 and 2 and extrapolated linearly
to the full depth (as ``dry_run.forward_backward`` does), the loss in one chunk, dense attention
(which counts the whole T x S score matrix: about 2x the causal attention FLOPs), times the
number of microbatches (the optimizer update is then counted once per microbatch: a few GB
of traffic per step, small against the forward/backward).

Caveats (as ``dry_run.forward_backward``): these are XLA:CPU compiles. XLA:CPU does not keep bf16
dots in bf16 the way TPU/GPU backends do, fuses and schedules differently, and its "bytes
accessed" counts every fusion's operands: the temporaries and the bytes are estimates of
what a TPU/GPU compile would need, not measurements. Params, optimizer state and KV cache
bytes (the arguments) follow from shapes and shardings and are exact. A GPU runtime also
keeps part of the HBM for itself (XLA_PYTHON_CLIENT_MEM_FRACTION, 75% by default).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from pmd_jax.distill.batch import BatchError
from pmd_jax.distill.registry import get_loss
from pmd_jax.distill.step import TrainStep
from pmd_jax.dry_run import gpu_compile
from pmd_jax.dry_run import hardware as tg
from pmd_jax.dry_run.distill_step import (
    abstract_batch,
    lesson_shape,
    mesh_shape,
    model_config,
    model_name,
)
from pmd_jax.dry_run.gpu_compile import format_gpu_report
from pmd_jax.models import decoder
from pmd_jax.run.sharding import ShardingRules, make_mesh
from pmd_jax.sampling.decode import decode_logits

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig
    from pmd_jax.models.config import ModelConfig

log = logging.getLogger("pmd_jax")
GiB = 1024**3


def _depth(mc: Any, n: int) -> Any:
    over: dict[str, Any] = {"num_layers": n}
    if mc.layer_types is not None:
        over["layer_types"] = tuple(mc.layer_types[-n:])
    return mc.replace(**over)


def _cost(compiled: Any) -> tuple[float, float]:
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    cost = dict(cost or {})
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def _extrapolate(f1: tuple[float, float], f2: tuple[float, float], layers: int
                 ) -> tuple[float, float]:
    return tuple(a + (layers - 1) * (b - a) for a, b in zip(f1, f2, strict=True))  # type: ignore


def _memory(compiled: Any, hbm: int) -> dict[str, Any]:
    need = tg.memory_need(compiled.memory_analysis())
    v = tg.verdict(need["total"], hbm)
    return {**need, "fits": v.fits, "verdict": v.word, "headroom": v.headroom_bytes,
            "headroom_frac": round(v.headroom_frac, 4)}


def _timing(flops: float, nbytes: float, t: tg.Target, model_flops: float,
            mem: dict[str, Any]) -> dict[str, Any]:
    r = tg.roofline(flops, nbytes, t, model_flops)
    # the floor: the same FLOPs, and each argument read / each output written once
    f = tg.roofline(flops, mem["arguments"] + mem["outputs"] - mem["aliased"], t, model_flops)
    return {"flops_per_device": flops, "bytes_per_device": nbytes,
            "model_flops_per_device": model_flops, "roofline_s": r.seconds,
            "compute_s": r.compute_s, "memory_s": r.memory_s, "bound": r.bound, "mfu": r.mfu,
            "floor_s": f.seconds, "floor_bound": f.bound, "floor_mfu": f.mfu}


def _batch(ts: Any, rows: int, s: int, t: int, r: int,
           lessons: tuple[int, int, int] | None = None) -> dict[str, Any]:
    b = abstract_batch(ts, rows, s, t, r, lessons)
    b.pop("old_logp", None)  # one update per rollout batch: the trainer passes no old_logp
    return b


def _lengths(cfg: RunConfig) -> tuple[int, int, int, int]:
    """(update rows, student, teacher and response lengths) of the config's step."""
    resp = int(cfg.rollout.max_tokens)
    return (int(cfg.rollout.problems_per_step) * int(cfg.rollout.n),
            int(cfg.rollout.max_prompt_tokens) + resp,
            int(cfg.teacher_prompt.max_tokens) + resp, resp)


def train_step_program(cfg: RunConfig, mc: Any, mesh: Any, rules: Any, t: tg.Target
                       ) -> tuple[Any, Any, dict[str, Any]]:
    """The config's real TrainStep on ``mesh``, its abstract state and its abstract batch."""

    rows, s_len, t_len, resp = _lengths(cfg)
    ts = TrainStep(mc, cfg.distill, mesh=mesh, rules=rules,
                   microbatch_rows=int(cfg.train.microbatch_rows),
                   lesson_nll_weight=float(cfg.mel.nll_weight))
    if rows % ts.batch_divisor():
        raise BatchError(f"the update batch of {rows} rows does not split over the mesh's "
                         f"batch axes ({ts.batch_divisor()} devices) of target {t.name}")
    lessons = lesson_shape(cfg, ts.batch_divisor())
    return ts, ts.abstract_state(), _batch(ts, rows, s_len, t_len, resp, lessons)


def train_step_report(cfg: RunConfig, mc: Any, mesh: Any, rules: Any, t: tg.Target,
                      count_cost: bool = True) -> dict[str, Any]:
    rows, s_len, t_len, resp = _lengths(cfg)
    ts, state, batch = train_step_program(cfg, mc, mesh, rules, t)
    n_micro = ts.num_microbatches(rows)
    lessons = lesson_shape(cfg, ts.batch_divisor())
    t0 = time.perf_counter()
    compiled = ts.lower(state, batch).compile()
    out: dict[str, Any] = {
        "rows": rows, "microbatch_rows": rows // n_micro, "microbatches": n_micro,
        "student_len": s_len, "teacher_len": t_len, "response_len": resp,
        "loss_name": cfg.distill.loss.name, "teacher_rule": cfg.distill.teacher.rule,
        "compile_s": round(time.perf_counter() - t0, 1),
        **_memory(compiled, t.hbm_bytes),
    }
    del compiled

    n_teacher = (0 if not get_loss(cfg.distill.loss.name).needs_teacher
                 else 2 if cfg.distill.teacher.rule == "trust_region" else 1)
    head = 2.0 * mc.vocab_size * mc.hidden_size  # LM head FLOPs per token: response only

    def fwd(n: int) -> float:
        return (mc.flops_per_token(n) - head) * n + head * resp

    model_flops = rows * (3 * fwd(s_len) + n_teacher * fwd(t_len)) / mesh.size
    if count_cost:
        dc = cfg.distill.replace(precision=cfg.distill.precision.replace(layer_loop="unrolled"),
                                 loss=cfg.distill.loss.replace(chunk_size=resp))
        costs = []
        for depth in (1, 2):
            m = _depth(mc, depth).replace(attention_impl="dense")
            small = TrainStep(m, dc, mesh=mesh, rules=rules)
            c = small.lower(small.abstract_state(),
                            _batch(small, rows // n_micro, s_len, t_len, resp,
                                   lessons)).compile()
            costs.append(_cost(c))
        flops, nbytes = _extrapolate(costs[0], costs[1], mc.num_layers)
        out.update(_timing(n_micro * flops, n_micro * nbytes, t, model_flops, out))
    return out


def decode_step_report(cfg: RunConfig, mc: Any, mesh: Any, rules: Any, t: tg.Target,
                       count_cost: bool = True) -> dict[str, Any]:
    """One cached decode forward of the JAX sampler (``sampling.decode.decode_logits``)."""

    batch_div = math.prod(mesh.shape[a] for a in rules.mesh_axes("batch"))
    rows = max(int(cfg.rollout.max_batch), batch_div)
    rows = -(-rows // batch_div) * batch_div
    ctx = int(cfg.rollout.max_context) or (int(cfg.rollout.max_prompt_tokens)
                                           + int(cfg.rollout.max_tokens))

    def sds(shape: Any, dtype: Any, axes: Any) -> Any:
        return jax.ShapeDtypeStruct(shape, dtype,
                                    sharding=NamedSharding(mesh, rules.spec(tuple(axes))))

    def compile_for(m: ModelConfig, per_layer: bool) -> Any:
        shapes = decoder.param_shapes(m)
        axes = decoder.param_axes(m)
        dt = jnp.dtype(m.dtype)
        params = {k: sds(shapes[k].shape, dt, axes[k]) for k in shapes if k != "layers"}
        if per_layer:
            params["layers"] = tuple(
                {k: sds(shapes["layers"][k].shape[1:], dt, axes["layers"][k][1:])
                 for k in shapes["layers"]} for _ in range(m.num_layers))
        else:
            params["layers"] = {k: sds(v.shape, dt, axes["layers"][k])
                                for k, v in shapes["layers"].items()}
        cache_sh = jax.eval_shape(functools.partial(decoder.init_cache, m, rows, ctx,
                                                    jnp.dtype(m.dtype), per_layer=per_layer))
        cache_ax = decoder.cache_axes(m, per_layer=per_layer)
        cache = jax.tree.map(lambda a, ax: sds(a.shape, a.dtype, ax), cache_sh, cache_ax)
        last = sds((rows,), jnp.int32, ("batch",))
        pos = sds((rows, 1), jnp.int32, ("batch", None))
        idx = jax.ShapeDtypeStruct((), jnp.int32)
        fn = jax.jit(functools.partial(decode_logits, cfg=m, shard_ctx=(mesh, rules)),
                     donate_argnames=("cache",))
        return fn.lower(params, cache, last, pos, idx).compile()

    t0 = time.perf_counter()
    # memory: stacked layers (a scan, as JaxSampler(unstack_layers=False)): with per-layer
    # arrays XLA:CPU hoists every layer's weight all-gather (and its f32 copy) to the start
    # of the unrolled program, all live at once, which a TPU/GPU schedule does not do
    compiled = compile_for(mc, per_layer=False)
    out: dict[str, Any] = {"rows": rows, "context": ctx,
                           "compile_s": round(time.perf_counter() - t0, 1),
                           **_memory(compiled, t.hbm_bytes)}
    del compiled
    if count_cost:
        # cost: per-layer arrays (no loop over layers, the sampler's default) and dense
        # attention (no loop over cache blocks), so the cost analysis sees every layer
        flops, nbytes = _cost(compile_for(mc.replace(attention_impl="dense"), per_layer=True))
        out.update(_timing(flops, nbytes, t, rows * mc.flops_per_token(ctx) / mesh.size, out))
        out["tokens_per_s"] = rows / out["roofline_s"] if out["roofline_s"] > 0 else 0.0
        out["floor_tokens_per_s"] = rows / out["floor_s"] if out["floor_s"] > 0 else 0.0
    return out


def gpu_report(cfg: RunConfig, mc: Any, shape: dict[str, int], rules: Any, t: tg.Target
               ) -> dict[str, Any] | None:
    """A GPU target's train step as XLA:GPU compiles it without a device, or its CUDA
    StableHLO (:mod:`pmd_jax.dry_run.gpu_compile`); None for other targets or with
    ``PMD_JAX_DRY_RUN_GPU=off``. A failure is reported, not raised (the XLA:CPU report
    stands)."""

    if t.name not in gpu_compile.GPU_MODELS or gpu_compile.gpu_mode() == "off":
        return None
    try:
        return gpu_compile.gpu_step_report(
            t.name, shape, lambda mesh: train_step_program(cfg, mc, mesh, rules, t),
            mc.vocab_size, mc.num_layers)
    except Exception as e:  # noqa: BLE001 - reported in the output, the CPU report stands
        log.warning("GPU program for %s failed", t.name, exc_info=True)
        return {"path": "failed", "target": t.name, "error": f"{type(e).__name__}: {e}"}


def format_target_report(r: dict[str, Any]) -> str:
    t = tg.get_target(r["target"])

    def g(b: float) -> str:
        return f"{b / GiB:7.2f}"

    lines = [
        f"dry run {r['model']} on {t.name}: {t.chips} chips x {t.hbm_bytes / 1e9:.0f} GB HBM "
        f"({t.hbm_bytes / GiB:.1f} GiB), {t.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16, "
        f"{t.hbm_bytes_per_s / 1e9:.0f} GB/s ({t.source}); mesh {r['mesh']}",
        "per device, GiB    args    outs aliased    temp   total     HBM headroom  verdict",
    ]
    for key, label in (("train_step", "train step "), ("decode_step", "decode step")):
        x = r[key]
        lines.append(
            f"{label}     {g(x['arguments'])} {g(x['outputs'])} {g(x['aliased'])} "
            f"{g(x['temporaries'])} {g(x['total'])} {g(t.hbm_bytes)} "
            f"{100 * x['headroom_frac']:7.1f}%  {x['verdict']}")
    tr, de = r["train_step"], r["decode_step"]
    lines.append(
        f"train step: {tr['rows']} rows = {tr['microbatches']} microbatch(es) of "
        f"{tr['microbatch_rows']}, student {tr['student_len']} / teacher {tr['teacher_len']} "
        f"tokens ({tr['loss_name']}, teacher {tr['teacher_rule']})")
    if "roofline_s" in tr:
        lines.append(
            f"  roofline {tr['roofline_s']:.2f} s/step, {tr['bound']}-bound (compute "
            f"{tr['compute_s']:.2f} s, HBM {tr['memory_s']:.2f} s), MFU <= "
            f"{100 * tr['mfu']:.0f}%; {tr['flops_per_device'] / 1e12:.1f} TFLOP and "
            f"{tr['bytes_per_device'] / 1e9:.0f} GB accessed per device (XLA:CPU counts)")
        lines.append(
            f"  floor (each argument read once) {tr['floor_s']:.2f} s/step, "
            f"{tr['floor_bound']}-bound, MFU <= {100 * tr['floor_mfu']:.0f}%")
    lines.append(f"decode step: {de['rows']} rows, KV cache of {de['context']} tokens")
    if "roofline_s" in de:
        lines.append(
            f"  roofline {1e3 * de['roofline_s']:.2f} ms/token, {de['bound']}-bound, <= "
            f"{de['tokens_per_s']:.0f} tokens/s for the whole mesh; "
            f"{de['flops_per_device'] / 1e9:.1f} GFLOP and {de['bytes_per_device'] / 1e9:.2f} "
            "GB accessed per device (XLA:CPU counts)")
        lines.append(
            f"  floor (params + KV cache read once) {1e3 * de['floor_s']:.2f} ms/token, <= "
            f"{de['floor_tokens_per_s']:.0f} tokens/s")
    gpu = r.get("gpu")
    if gpu is not None:
        if gpu["path"] == "failed":
            lines.append(f"GPU program for {t.name}: FAILED ({gpu['error'][:500]})")
        else:
            lines.extend(format_gpu_report(gpu))
    lines.append("roofline = max(FLOPs / peak, bytes / HBM bandwidth): a lower bound on the time "
                 "for those counts; XLA:CPU compile on simulated devices: temporaries and bytes "
                 "accessed are estimates (see pmd_jax/dry_run/target.py)")
    by = " (train step from the XLA:GPU compile)" if gpu is not None and "fits" in gpu else ""
    lines.append(f"verdict: {'FITS' if r['fits'] else 'DOES NOT FIT'} on {t.name}{by}")
    return "\n".join(lines)


def target_report(cfg: RunConfig, target: str, count_cost: bool = True) -> dict[str, Any]:
    t = tg.get_target(target)
    n = jax.device_count()
    if n != t.chips:
        raise RuntimeError(f"target {t.name} needs {t.chips} simulated devices, jax has {n}; "
                           f"run through `python -m pmd_jax.main --dry_run`, which sets "
                           "XLA_FLAGS=--xla_force_host_platform_device_count before jax starts")
    mc = model_config(cfg)
    shape = mesh_shape(cfg, n)
    if math.prod(shape.values()) != n:
        raise ValueError(f"mesh {shape} (cfg.mesh) does not use the {n} chips of {t.name}")
    mesh = make_mesh(shape)
    rules = ShardingRules.from_mapping(cfg.mesh.rules.to_dict() if cfg.mesh.rules else None)
    log.info("dry run: %s on %s (%d simulated devices, mesh %s)", model_name(cfg), t.name,
             n, shape)
    report: dict[str, Any] = {"model": model_name(cfg), "target": t.name, "mesh": shape,
                              "params": mc.num_params()}
    report["train_step"] = train_step_report(cfg, mc, mesh, rules, t, count_cost)
    report["decode_step"] = decode_step_report(cfg, mc, mesh, rules, t, count_cost)
    report["fits"] = bool(report["train_step"]["fits"] and report["decode_step"]["fits"])
    gpu = gpu_report(cfg, mc, shape, rules, t)
    if gpu is not None:
        report["gpu"] = gpu
        if "fits" in gpu:  # XLA:GPU's own figure for the train step replaces XLA:CPU's
            report["fits"] = bool(gpu["fits"] and report["decode_step"]["fits"])
    print(json.dumps(report, default=str))
    print(format_target_report(report), flush=True)
    return report
