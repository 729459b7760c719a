"""One training step with full fine-tuning and with LoRA, side by side (issue 51, part 5).

Each variant is ``python -m pmd_jax.main`` on the same config, mode and seed, in its own
process (so its peak resident memory is its own), for ``--steps`` steps with no evaluation:

* ``full``: the config as it is (full fine-tuning: params, AdamW moments, the EMA teacher and
  the initial policy, with whatever offloading the config sets);
* ``lora``: the same config with ``lora.enabled=True`` (``--r``, ``--alpha``, all seven
  projections by default): the optimizer and the teacher hold adapters, the frozen base is
  also the initial policy;
* ``lora_bf16``: ``lora`` with the frozen base stored in bfloat16 (``lora.base_dtype``) and the
  config's offloading knobs off (with adapters there is little left to offload).

Printed per variant and step: the step's wall time and its phases (``time_sample``,
``time_train``, ``time_kl_initial``), the loss, the training reward, the gradient norm, the KL
to the initial policy, and the process's peak RSS (``ru_maxrss`` of the child, which is what
GNU ``time`` reports) beside the run's own ``rss_peak_gib_after_*`` metrics. Ratios are
variant / full. At step 0 the adapters' B is zero, so every variant samples the same rollouts
and its loss is full fine-tuning's (the tests hold the bits); from step 1 on they differ.

    python benchmarks/bench_lora_step.py --config configs/qwen25coder05b_mbpp.py --mode sdpo
    python benchmarks/bench_lora_step.py --config configs/smollm2_sciq.py --steps 2   # minutes
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

VARIANTS = ("full", "lora", "lora_bf16")
# The config knobs that move state to files between phases: with adapters the moments and
# the teacher are a few MiB and the initial policy is the base, so lora_bf16 turns them off.
OFFLOAD_KNOBS = ("train.offload_initial_policy", "train.offload_optimizer_during_kl",
                 "train.offload_optimizer_during_grads")
FIELDS = ("time_step", "time_sample", "time_train", "time_kl_initial", "loss", "reward_mean",
          "grad_norm", "kl", "kl_policy_initial", "num_loss_tokens")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/qwen25coder05b_mbpp.py")
    p.add_argument("--mode", default="sdpo")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--targets", default="q,k,v,o,gate,up,down")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, from {VARIANTS}")
    p.add_argument("--override", action="append", default=[],
                   help="key=value for every variant, e.g. rollout.max_tokens=64")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per variant")
    p.add_argument("--json", default="", help="write every record here")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [v for v in args.variants.split(",") if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}; choose from {VARIANTS}")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    for o in args.override:
        if "=" not in o:
            p.error(f"--override {o!r}: expected key=value")
    return args


def overrides(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """The command-line overrides of ``variant`` (the same run otherwise)."""
    o: dict[str, Any] = {"mode": args.mode, "seed": args.seed, "train.steps": args.steps,
                         "train.eval_every": -1, "train.eval_at_start": False,
                         "eval.retention": False, "train.checkpoint_every": 10_000}
    o.update(dict(kv.split("=", 1) for kv in args.override))
    if variant != "full":
        o.update({"lora.enabled": True, "lora.r": args.r, "lora.alpha": args.alpha,
                  "lora.target_modules": args.targets})
    if variant == "lora_bf16":
        o["lora.base_dtype"] = "bfloat16"
        o.update({k: False for k in OFFLOAD_KNOBS})
    return o


def child(args: argparse.Namespace) -> dict[str, Any]:
    """Run the trainer for ``args.child``'s variant; its step records and peak RSS."""
    run_dir, wall = bc.run_trainer(args.config, f"bench_lora_{args.child}_",
                                   overrides(args, args.child))
    steps = []
    for rec in bc.train_records(run_dir):
        rss = [v for k, v in rec.items() if k.startswith("rss_peak_gib_after_")]
        steps.append({**{f: rec.get(f) for f in FIELDS},
                      "rss_metric_gib": max(rss) if rss else None})
    if len(steps) != args.steps:
        raise RuntimeError(f"{args.child}: {len(steps)} step records in {run_dir}, "
                           f"expected {args.steps}")
    return {"steps": steps, "wall_s": wall, "run_dir": str(run_dir),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20}


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def report(res: dict[str, dict[str, Any]], steps: int) -> list[str]:
    """The side-by-side table (one block per step) and the ratios against ``full``."""
    names = list(res)
    out = []
    for s in range(steps):
        out.append(f"\nstep {s}")
        out.append(f"{'':22s}" + "".join(f"{n:>14s}" for n in names))
        for f in (*FIELDS, "rss_metric_gib"):
            out.append(f"{f:22s}" + "".join(f"{_fmt(res[n]['steps'][s][f]):>14s}"
                                            for n in names))
    out.append("\nwhole process")
    out.append(f"{'peak RSS (GiB)':22s}" + "".join(f"{res[n]['peak_rss_gib']:14.2f}"
                                                    for n in names))
    out.append(f"{'wall (s)':22s}" + "".join(f"{res[n]['wall_s']:14.0f}" for n in names))
    if "full" in res:
        full = res["full"]
        step_s = [sum(st["time_step"] for st in res[n]["steps"]) for n in names]
        out.append(f"{'step s / full':22s}" + "".join(
            f"{t / step_s[names.index('full')]:14.2f}" for t in step_s))
        out.append(f"{'peak RSS / full':22s}" + "".join(
            f"{res[n]['peak_rss_gib'] / full['peak_rss_gib']:14.2f}" for n in names))
    return out


def main() -> None:
    args = parse()
    if args.child:
        bc.child_job(args, {v: child for v in VARIANTS})
        return
    variants = args.variants.split(",")
    print(f"{args.config}, mode {args.mode}, {args.steps} step(s), seed {args.seed}; LoRA r="
          f"{args.r} alpha={args.alpha} on {args.targets}; variants {variants}; {bc.load()}",
          flush=True)
    res: dict[str, dict[str, Any]] = {}
    for v in variants:
        r = bc.run_child(os.path.abspath(__file__), v, sys.argv[1:], dict(os.environ),
                         args.timeout)
        if r is not None:
            res[v] = r
            print(f"{v}: {args.steps} step(s) in {r['wall_s']:.0f} s, peak RSS "
                  f"{r['peak_rss_gib']:.2f} GiB ({r['load']})", flush=True)
    if res:
        print("\n".join(report(res, args.steps)), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": res}, indent=1))


if __name__ == "__main__":
    main()
