"""SDPO steps end to end: pmd_jax against sdpo-rl (SDPO for TRL), same prompts and settings.

The peer a Hugging Face user would pick instead of us is ``sdpo-rl`` (PyPI 0.0.3,
``SDPOTrainer``: TRL's ``GRPOTrainer`` with the SDPO loss, an EMA teacher and verl's
reprompting). Both sides run the same SDPO step (issue 53, part 2):

* the same P training problems of the embedded default's task (SmolLM2-135M-Instruct, SciQ,
  ``configs/smollm2_sciq.py``), every step all P of them, G rollouts each, the same prompt
  tokens (ours, rendered by our chat format with the task's response prefix; the peer gets them
  as a plain-text prompt, and the child checks that the HF tokenizer gives back the same ids);
* sampling at the config's temperature / top-p, <= max_tokens new tokens;
* grading by our task's verifier (the peer's reward function calls it);
* the teacher prompt: a successful sibling as the demonstration (never a rollout's own), the
  verifier's feedback as our config says; the EMA teacher (rate from the config);
* the loss: top-K (K) + tail, alpha, the IS clip; AdamW with the config's lr, warmup, weight
  decay and clip.

Each side runs in its own process, ``--steps`` steps (the first, which compiles on our side,
is reported apart), and prints s/step per phase where both expose it:

* generate: ours ``time_sample`` (the in-process JAX sampler); the peer's ``_generate``
  (TRL's HF ``generate``, as its README sets it up on CPU: no vLLM);
* grade + teacher prompts: ours ``time_verify + time_teacher_prompts``; the peer's
  ``_generate_and_score_completions`` less its ``_generate`` (rewards, demonstrations,
  reprompting, tokenizing);
* update: the rest of the step (teacher forward, loss, backward, optimizer, EMA; ours also
  publishes the new weights to the sampler);
* step: ours ``time_step``; the peer's ``on_step_begin`` -> ``on_step_end`` (after the EMA).

Peak memory is each process's peak RSS. The ratio column is peer s / ours s (> 1: ours is
faster). Our side runs ``python -m pmd_jax.main`` (``--config.mode=sdpo``, no evaluation, no
KL to the initial policy, which the peer does not measure). The peer runs in the venv that
``launch/setup_peer_venv.sh`` makes (``--peer_python``, default ``$PMD_PEER_VENV/bin/python``).

Usage: python benchmarks/bench_sdpo_peer.py [--problems 4 --n 4 --max_tokens 24 --steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import sdpo_rl_peer as sp  # noqa: E402

ROOT = sp.ROOT
PHASES = ("generate", "grade + teacher prompts", "update", "step")
SETUP_HINT = sp.SETUP_HINT


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/smollm2_sciq.py")
    p.add_argument("--problems", type=int, default=4, help="P: problems a step (all of them "
                   "every step)")
    p.add_argument("--n", type=int, default=4, help="G: rollouts a problem")
    p.add_argument("--max_tokens", type=int, default=24)
    p.add_argument("--topk", type=int, default=100)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--steps", type=int, default=4, help="steps a side (the first reported "
                   "apart)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--peer_python", default=sp.default_peer_python())
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--skip_ours", action="store_true")
    p.add_argument("--skip_peer", action="store_true")
    p.add_argument("--ours_flag", action="append", default=[], help="an extra override of our "
                   "run, e.g. --ours_flag=train.clear_compiled_every=0 (repeatable)")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--child", choices=("ours", "peer"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.problems < 1 or args.n < 2 or args.steps < 2 or args.max_tokens < 1:
        p.error("need --problems >= 1, --n >= 2 (a sibling to learn from), --steps >= 2 "
                "(the first is reported apart), --max_tokens >= 1")
    return args


def run_config(args):
    """The frozen run config both sides take their settings from."""
    return sp.load_run_config(args.config, overrides(args))


def overrides(args) -> dict:
    return {
        "mode": "sdpo", "seed": args.seed,
        "task.max_train_problems": args.problems, "rollout.problems_per_step": args.problems,
        "rollout.n": args.n, "rollout.max_tokens": args.max_tokens,
        "distill.loss.topk": args.topk, "distill.loss.alpha": args.alpha,
        "distill.optim.lr": args.lr, "train.steps": args.steps,
        "train.eval_every": -1, "train.eval_at_start": False,
        "train.kl_initial_every": 0, "train.checkpoint_every": 10_000,
    }


# ------------------------------------------------------------------------------ ours
def child_ours(args) -> dict:
    """``python -m pmd_jax.main`` for ``--steps`` steps; its per-step phase times."""
    run_dir, wall = bc.run_trainer(args.config, "bench_sdpo_ours_", overrides(args),
                                   args.ours_flag)
    steps = []
    for rec in bc.train_records(run_dir):
        if "time_step" in rec:
            steps.append({
                "generate": rec["time_sample"],
                "grade + teacher prompts": rec["time_verify"] + rec["time_teacher_prompts"],
                "update": rec["time_step"] - rec["time_sample"] - rec["time_verify"]
                - rec["time_teacher_prompts"],
                "step": rec["time_step"], "reward": rec.get("reward_mean")})
    if len(steps) != args.steps:
        raise RuntimeError(f"ours: {len(steps)} step records in {run_dir}, expected {args.steps}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    return {"steps": steps, "peak_rss_gib": peak, "wall_s": wall, "run_dir": str(run_dir),
            "device": bc.device_name("jax", args.device)}


# ------------------------------------------------------------------------------ peer
def child_peer(args) -> dict:
    import torch
    import trl

    data = sp.peer_data(run_config(args))
    trainer = sp.build_trainer(data, seed=args.seed, max_steps=args.steps,
                               out_dir=tempfile.mkdtemp(prefix="bench_sdpo_peer_"),
                               device=args.device)
    times = sp.clock(trainer)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    rewards = sp.step_rewards(trainer)
    steps = []
    for k in range(len(times["step"])):
        g, s, st = times["generate"][k], times["score"][k], times["step"][k]
        steps.append({"generate": g, "grade + teacher prompts": s - g, "update": st - s,
                      "step": st, "reward": rewards[k] if k < len(rewards) else None})
    if len(steps) != args.steps:
        raise RuntimeError(f"peer: {len(steps)} steps timed, expected {args.steps}")
    return {"steps": steps, "peak_rss_gib": bc.rss_gib(), "wall_s": wall,
            "versions": {"trl": trl.__version__, "torch": torch.__version__},
            "threads": torch.get_num_threads(), "device": args.device}


# ------------------------------------------------------------------------------ parent
def summarize(res: dict) -> dict:
    later = res["steps"][1:]
    return {ph: {"first": res["steps"][0][ph], "median": float(np.median([s[ph] for s in later]))}
            for ph in PHASES}


def main() -> None:
    args = parse()
    if args.child:
        bc.child_job(args, {"ours": child_ours, "peer": child_peer})
        return
    print(f"SDPO steps on {args.device}, {args.config} (mode sdpo): P={args.problems} problems "
          f"x G={args.n} rollouts, <= {args.max_tokens} new tokens, top-K {args.topk}, alpha "
          f"{args.alpha}, lr {args.lr}, {args.steps} steps a side, seed {args.seed}; "
          f"{bc.load()}", flush=True)
    res: dict[str, dict] = {}
    script = os.path.abspath(__file__)
    for side in ("ours", "peer"):
        if getattr(args, f"skip_{side}"):
            continue
        python = sys.executable if side == "ours" else args.peer_python
        if not os.path.exists(python):
            print(f"peer: FAILED, no interpreter at {python}: {SETUP_HINT}", flush=True)
            continue
        env = bc.child_env("jax" if side == "ours" else "torch", args.device)
        r = bc.run_child(script, side, sys.argv[1:], env, args.timeout, python=python)
        if r is not None:
            res[side] = r
            rew = [s["reward"] for s in r["steps"]]
            print(f"{side}: {args.steps} steps in {r['wall_s']:.0f} s; rewards {rew}; peak RSS "
                  f"{r['peak_rss_gib']:.2f} GiB ({r['load']})", flush=True)
    if not res:
        return
    sums = {side: summarize(r) for side, r in res.items()}
    print("\ns/step (the first step apart; later: median of steps 2..N)")
    print(f"{'phase':26s} {'ours first':>11s} {'ours':>8s} {'sdpo-rl first':>14s} "
          f"{'sdpo-rl':>8s} {'ratio':>7s}")
    for ph in PHASES:
        o, p = sums.get("ours", {}).get(ph), sums.get("peer", {}).get(ph)
        ratio = p["median"] / o["median"] if o and p and o["median"] > 0 else float("nan")
        print(f"{ph:26s} {o['first'] if o else float('nan'):11.2f} "
              f"{o['median'] if o else float('nan'):8.2f} "
              f"{p['first'] if p else float('nan'):14.2f} "
              f"{p['median'] if p else float('nan'):8.2f} {ratio:7.2f}x")
    if len(res) == 2:
        print(f"peak RSS: ours {res['ours']['peak_rss_gib']:.2f} GiB, sdpo-rl "
              f"{res['peer']['peak_rss_gib']:.2f} GiB; ratio = sdpo-rl s / ours s (> 1: ours "
              "is faster)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": res,
                                               "summary": sums}, indent=1))


if __name__ == "__main__":
    main()
