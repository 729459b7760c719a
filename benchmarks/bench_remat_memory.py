"""Compiled memory of each remat policy of the train step, from abstract arrays (no weights,
no device): ``TrainStep.lower(abstract state, abstract batch).compile().memory_analysis()``.

The step is :mod:`benchmarks.bench_train_step`'s (its ``child_jax`` settings: EMA teacher,
generalized JSD alpha 0.5 over the student's top-100 + tail, loss chunk ``--chunk``, fp32
master weights and AdamW state, compute in ``--dtype``), one policy per subprocess (each
compile's memory is given back). ``--compiler``:

* ``cpu``: XLA:CPU compiles the step for this machine's CPU. XLA:CPU keeps no bf16 dots the
  way a GPU does and schedules differently, so its temp figure is not what a GPU needs; the
  differences between policies are the figure to read.
* ``gpu``: XLA:GPU compiles it for one compile-only H200 (or ``--gpu-target`` H100) built from
  a target description by the CUDA plugin for compiling only
  (:mod:`pmd_jax.dry_run.gpu_compile`; the plugin at ``PMD_JAX_CUDA_PLUGIN_SITE``). Traced as
  on that GPU: attention ``auto`` is cuDNN there. No autotuning (no device).

Attention: ``--attention auto`` on the CPU compile is dense for the student (T x T = 1024^2 is
not above the chunked threshold) and chunked for the teacher; ``chunked`` (the CPU default
here) keeps O(T) residuals as a flash kernel does, the closer CPU stand-in for cuDNN. The GPU
compile's default is ``auto``: cuDNN, with the padding as sequence lengths.

    python benchmarks/bench_remat_memory.py --layers 8           # the 8B-shape GPU figure's
    PMD_JAX_CUDA_PLUGIN_SITE=/tmp/cudavenv/lib/python3.11/site-packages \
        python benchmarks/bench_remat_memory.py --layers 8 --compiler gpu
    python benchmarks/bench_remat_memory.py --layers 2 --policies full,minimal --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_common as bc  # noqa: E402

GiB = 1024**3
DEFAULT_POLICIES = ("none", "full", "dots", "minimal", "save_qkv_proj", "save_out_proj",
                    "save_dot_except_mlp", "save_dot_with_context_except_mlp",
                    "save_dot_except_mlpwi", "qkv_proj_offloaded",
                    "save_dot_except_mlp_offloaded", "minimal_offloaded")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=bc.MODELS, default="llama3-8b")
    p.add_argument("--layers", type=int, default=8, help="cut the model to N layers (0: all)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--student-len", type=int, default=1024)
    p.add_argument("--teacher-len", type=int, default=1536)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--chunk", type=int, default=96, help="response tokens per loss chunk")
    p.add_argument("--attention", default="",
                   help="model.attention_impl[:chunk] (default: chunked for --compiler cpu, "
                        "auto, i.e. cuDNN, for gpu; see the module docstring)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="comma-separated remat policies (pmd_jax.models.decoder)")
    p.add_argument("--compiler", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--gpu-target", choices=("H200", "H100"), default="H200")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per policy")
    p.add_argument("--json", action="store_true", help="print one JSON line per policy")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.attention:
        args.attention = "chunked" if args.compiler == "cpu" else "auto"
    return args


def distill_config(args: argparse.Namespace, policy: str) -> Any:
    """bench_train_step.child_jax's distillation config with remat ``policy``."""
    from pmd_jax.distill.config import default_distill_config, freeze_distill_config

    c = default_distill_config()
    c.teacher.rule = "ema"
    c.optim.warmup_steps = 0
    c.loss.chunk_size = args.chunk
    c.loss.rollout_is_threshold = None
    c.precision.remat = policy != "none"
    if policy != "none":
        c.precision.remat_policy = policy
    c.precision.param_dtype = args.dtype
    c.loss.alpha, c.loss.topk, c.loss.add_tail = 0.5, 100, True
    return freeze_distill_config(c)


def _model(args: argparse.Namespace) -> Any:
    cfg = bc.model_config(args.model, args.layers, args.dtype)
    impl, _, blk = args.attention.partition(":")
    return cfg.replace(attention_impl=impl, **({"attention_chunk": int(blk)} if blk else {}))


def _compile(args: argparse.Namespace, policy: str, mesh: Any = None, rules: Any = None
             ) -> dict[str, Any]:
    from pmd_jax.distill.step import TrainStep
    from pmd_jax.dry_run.distill_step import abstract_batch

    ts = TrainStep(_model(args), distill_config(args, policy), mesh=mesh, rules=rules)
    batch = abstract_batch(ts, args.batch, args.student_len, args.teacher_len,
                           args.response_len)
    batch = {k: v for k, v in batch.items() if k not in ("sampler_logp", "old_logp",
                                                          "rewards")}
    t0 = time.perf_counter()
    compiled = ts.lower(ts.abstract_state(), batch).compile()
    ma = compiled.memory_analysis()
    get = lambda k: int(getattr(ma, k, 0) or 0)  # noqa: E731
    return {"policy": policy, "compile_s": round(time.perf_counter() - t0, 1),
            **{k: get(f"{k}_size_in_bytes") for k in (
                "temp", "argument", "output", "alias", "host_temp", "host_argument",
                "host_output")}}


def child(args: argparse.Namespace) -> dict[str, Any]:
    policy = args.child
    if args.compiler == "cpu":
        import jax

        out = _compile(args, policy)
        out["device"] = f"XLA:CPU ({jax.devices()[0].device_kind})"
        return out
    from pmd_jax.dry_run import gpu_compile as gc
    from pmd_jax.run.sharding import ShardingRules, make_mesh

    why = gc.plugin_missing()
    if why:
        raise SystemExit(f"--compiler gpu: {why}")
    m = gc.GPU_MODELS[f"8x{args.gpu_target}"]
    with gc.gpu_tracing(m):
        mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1},
                         devices=gc.compile_only_devices(m, 1))
        out = _compile(args, policy, mesh, ShardingRules.from_mapping(None))
    out["device"] = f"XLA:GPU, one compile-only {m.device}"
    return out


def command(args: argparse.Namespace) -> str:
    return (f"python benchmarks/bench_remat_memory.py --model {args.model} --layers "
            f"{args.layers} --batch {args.batch} --student-len {args.student_len} "
            f"--teacher-len {args.teacher_len} --response-len {args.response_len} --dtype "
            f"{args.dtype} --chunk {args.chunk} --attention {args.attention} --compiler "
            f"{args.compiler}" + (f" --gpu-target {args.gpu_target}" if args.compiler == "gpu"
                                  else ""))


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    cfg = _model(args)
    print(f"{args.model} ({cfg.num_layers} layers), B={args.batch} student {args.student_len} "
          f"teacher {args.teacher_len} response {args.response_len}, {args.dtype}, attention "
          f"{args.attention}, compiler {args.compiler}; {command(args)}", flush=True)
    print(f"{'policy':34s} {'temp GiB':>9s} {'args GiB':>9s} {'out GiB':>8s} "
          f"{'host temp GiB':>13s} {'compile s':>9s}", flush=True)
    for policy in args.policies.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:]),
               "--child", policy]
        env = dict(os.environ)
        if args.compiler == "gpu":  # compile-only GPUs: jax itself must not start CUDA
            env.setdefault("JAX_PLATFORMS", "cpu")
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                               env=env)
        except subprocess.TimeoutExpired:
            print(f"{policy:34s} timed out after {args.timeout:.0f} s", flush=True)
            continue
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            err = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"{policy:34s} failed after {time.perf_counter() - t0:.0f} s: {err[:200]}",
                  flush=True)
            continue
        res = json.loads(line[len("RESULT "):])
        if args.json:
            print(json.dumps(res), flush=True)
        else:
            print(f"{policy:34s} {res['temp'] / GiB:9.2f} {res['argument'] / GiB:9.2f} "
                  f"{res['output'] / GiB:8.2f} {res['host_temp'] / GiB:13.2f} "
                  f"{res['compile_s']:9.1f}  ({res['device']})", flush=True)


if __name__ == "__main__":
    main()
