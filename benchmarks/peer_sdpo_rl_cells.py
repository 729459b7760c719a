"""Same-budget learning comparison: sdpo-rl's SDPOTrainer as grid cells beside our ``sdpo``.

Issue 53, part 3. For each seed, a cell ``sdpo_rl_seed<K>`` in ``--out``, in the grid's layout
(``cell.json``, ``config.json``, ``metrics.jsonl``, ``eval/step_<s>/results.jsonl``), so the
grid's paired report compares it with our cells run by ``python -m pmd_jax.grid`` into the same
folder under the same budget:

1. train: sdpo-rl on the run config's task, problems, schedule and settings
   (``sdpo_rl_peer.build_trainer``: ``train.steps`` optimizer steps of
   ``rollout.problems_per_step`` x ``rollout.n`` rollouts), in the peer's venv, saving the
   weights (HF folders) at every step our cells evaluate (``train.eval_every`` and the last);
2. evaluate: each saved folder with our evaluation (``python -m pmd_jax.main
   --config.model.source=<folder> --config.train.steps=0 --config.seed=<K>``: the held-out
   problems, samples, temperature and seeds of ``eval``; its draws do not depend on the step,
   and the run seed sets the task's option order, so each seed's evaluations run under that
   seed and the peer is scored exactly as our cell of that seed); step 0 is the initial
   model, evaluated once per seed;
3. the cell: the peer's per-step training reward as train records, our evaluations as eval
   records at their steps.

Each part is kept in ``--scratch`` and skipped when done, so a killed run resumes where it was.
After the cells, the grid report of ``--out`` is written with ``sdpo`` and ``sdpo_rl``.

Usage (after ``python -m pmd_jax.grid --config=configs/smollm2_sciq.py --modes=sdpo
--seeds=0,1,2 --out=docs/results/grid_sciq_sdpo_rl``):
  python benchmarks/peer_sdpo_rl_cells.py --seeds=0,1,2 --out=docs/results/grid_sciq_sdpo_rl
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sdpo_rl_peer as sp  # noqa: E402

MODE = "sdpo_rl"
# sdpo-rl with the task's response prefix given back to its teacher (--teacher_prefix)
MODE_PREFIX = "sdpo_rl_prefix"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/smollm2_sciq.py")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default="docs/results/grid_sciq_sdpo_rl")
    p.add_argument("--scratch", default="runs/peer_sdpo_rl")
    p.add_argument("--peer_python", default=sp.default_peer_python())
    p.add_argument("--override", action="append", default=[], help="a config override as the "
                   "grid takes it (--override=--config.train.steps=2), repeatable: the same "
                   "as the grid cells' it is compared with")
    p.add_argument("--teacher_prefix", action="store_true", help="cells sdpo_rl_prefix: the "
                   "peer's teacher context gets the task's response prefix, which sdpo-rl "
                   "drops (sdpo_rl_peer.teacher_prefix_template)")
    p.add_argument("--report_modes", default="sdpo,sdpo_rl")
    p.add_argument("--report_seeds", default="", help="the report's seeds (default: --seeds)")
    p.add_argument("--child_train", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def eval_steps(cfg) -> list[int]:
    """The steps our cells evaluate: 0 (eval_at_start), every eval_every, the last."""
    n, every = int(cfg.train.steps), int(cfg.train.eval_every)
    steps = {n}
    if cfg.train.eval_at_start:
        steps.add(0)
    if every > 0:
        steps.update(range(every, n, every))
    return sorted(steps)


def mode_of(args) -> str:
    return MODE_PREFIX if args.teacher_prefix else MODE


def work_dir(args, seed: int) -> Path:
    """A seed's scratch folder (the peer's run, its saved weights, our evaluations of them)."""
    return Path(args.scratch) / (f"{MODE_PREFIX}_seed{seed}" if args.teacher_prefix
                                 else f"seed{seed}")


def run_config(args, seed: int = 0):
    """The grid cells' config (mode sdpo, ``--override``s, the seed), frozen."""
    from pmd_jax.config import freeze
    from pmd_jax.grid.command import grid_config

    return freeze(grid_config(args.config, [*args.override, f"--config.seed={seed}"], "sdpo"))


# ------------------------------------------------------------------------------ peer side
def child_train(args) -> None:
    """In the peer's venv: train seed ``args.child_train`` and save the weights at the
    evaluated steps; the per-step records go to ``train.jsonl``."""
    from transformers import TrainerCallback

    seed = int(args.child_train)
    work = work_dir(args, seed)
    cfg = run_config(args, seed)
    data = sp.peer_data(cfg)
    save_at = [s for s in eval_steps(cfg) if s > 0]
    trainer = sp.build_trainer(data, seed=seed, max_steps=int(cfg.train.steps),
                               out_dir=work / "trl", teacher_prefix=args.teacher_prefix)
    times = sp.clock(trainer)

    class SaveAt(TrainerCallback):
        def on_step_end(self, a, state, control, **k):
            if state.global_step in save_at:
                d = work / f"step_{state.global_step}"
                trainer.model.save_pretrained(d, safe_serialization=True)
                trainer.processing_class.save_pretrained(d)

    trainer.add_callback(SaveAt())
    t0 = time.time()
    trainer.train()
    rewards = sp.step_rewards(trainer)
    with open(work / "train.jsonl.tmp", "w") as f:
        for k, st in enumerate(times["step"]):
            f.write(json.dumps({"kind": "train", "step": k, "reward_mean": rewards[k],
                                "time_step": st, "time_sample": times["generate"][k]}) + "\n")
    os.replace(work / "train.jsonl.tmp", work / "train.jsonl")
    print(f"seed {seed}: {len(times['step'])} steps in {time.time() - t0:.0f} s", flush=True)


# ------------------------------------------------------------------------------ our side
def evaluate(args, source: str, seed: int, run_dir: Path) -> dict:
    """Our evaluation of the weights in ``source`` (a run of 0 steps); its eval record."""
    from pmd_jax.run.metrics import read_metrics

    metrics = run_dir / "metrics.jsonl"
    if not (run_dir / "eval" / "step_000000" / "results.jsonl").is_file():
        if run_dir.exists():
            shutil.rmtree(run_dir)
        cmd = [sys.executable, "-m", "pmd_jax.main", f"--config={args.config}",
               f"--config.model.source={source}", "--config.mode=sdpo",
               f"--config.seed={seed}", *args.override, "--config.train.steps=0",
               f"--config.run_dir={run_dir}"]
        print("evaluate: " + " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, cwd=sp.ROOT)
    return next(r for r in read_metrics(metrics) if r.get("kind") == "eval")


def _same_start(our_cell: Path, base_run: Path) -> tuple[int, int] | None:
    """(equal, all) step-0 evaluation records of our cell and the initial model's evaluation
    here (the name field aside); None without our cell. They must be equal: the same weights,
    prompts and draws."""
    ours = our_cell / "eval" / "step_000000" / "results.jsonl"
    if not ours.is_file():
        return None

    def recs(p: Path) -> list[dict]:
        return [{k: v for k, v in json.loads(x).items() if k != "name"}
                for x in p.read_text().splitlines()]

    a, b = recs(ours), recs(base_run / "eval" / "step_000000" / "results.jsonl")
    return sum(x == y for x, y in zip(a, b, strict=False)), max(len(a), len(b))


def make_cell(args, cfg, seed: int, base: Path) -> None:
    from pmd_jax.grid.cells import cell_state

    mode = mode_of(args)
    out = Path(args.out) / f"{mode}_seed{seed}"
    steps = int(cfg.train.steps)
    if (out / "cell.json").is_file() and cell_state(out, steps)[0]:
        print(f"{out.name}: finished", flush=True)
        return
    work = work_dir(args, seed)
    t0 = time.time()
    if not (work / "train.jsonl").is_file():
        if not os.path.exists(args.peer_python):
            raise SystemExit(f"no peer interpreter at {args.peer_python}: {sp.SETUP_HINT}")
        work.mkdir(parents=True, exist_ok=True)
        subprocess.run([args.peer_python, os.path.abspath(__file__),
                        f"--child_train={seed}", f"--config={args.config}",
                        f"--scratch={args.scratch}",
                        *(["--teacher_prefix"] if args.teacher_prefix else []),
                        *(f"--override={o}" for o in args.override)], check=True, cwd=sp.ROOT)
    evals = {}
    for s in eval_steps(cfg):
        if s == 0:
            evals[0] = (evaluate(args, str(cfg.model.source), seed, base), base)
        else:
            d = work / f"eval_step_{s}"
            evals[s] = (evaluate(args, str((work / f"step_{s}").resolve()), seed, d), d)
    same = _same_start(Path(args.out) / f"sdpo_seed{seed}", evals[0][1])
    if same is not None:
        print(f"{out.name}: step-0 evaluation equal to our sdpo_seed{seed}'s on {same[0]} of "
              f"{same[1]} records", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "eval").mkdir(parents=True)
    records = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    for s, (rec, d) in sorted(evals.items()):
        shutil.copytree(d / "eval" / "step_000000", tmp / "eval" / f"step_{s:06d}")
        records.append({**rec, "step": s, "evaluated_weights": "initial" if s == 0
                        else f"sdpo-rl step {s}"})
    records.sort(key=lambda r: (int(r["step"]), r["kind"] != "eval"))
    (tmp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    shutil.copy(evals[steps][1] / "config.json", tmp / "config.json")
    (tmp / "cell.json").write_text(json.dumps({
        "config": args.config, "overrides": list(args.override), "train_steps": steps, "mode": mode,
        "seed": seed, "command": ["benchmarks/peer_sdpo_rl_cells.py", f"--seeds={seed}",
                                  f"--config={args.config}"],
        "peer": "sdpo-rl 0.0.3 (trl 1.16.0) SDPOTrainer, benchmarks/sdpo_rl_peer.py"
                + (", its teacher given the task's response prefix" if args.teacher_prefix
                   else ""),
        "run_dir": str(work), "wall_seconds": time.time() - t0,
        "step0_records_equal_to_our_cell": same}, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    print(f"{out.name}: written", flush=True)


def main() -> None:
    args = parse()
    if args.child_train is not None:
        child_train(args)
        return
    from pmd_jax.grid.cells import Cell
    from pmd_jax.grid.report import write_report

    seeds = [int(s) for s in args.seeds.split(",")]
    cfg = run_config(args)
    for seed in seeds:  # the initial model's evaluation: one per seed, shared by the modes
        make_cell(args, cfg, seed, Path(args.scratch) / f"eval_initial_seed{seed}")
    modes = args.report_modes.split(",")
    rseeds = [int(s) for s in args.report_seeds.split(",")] if args.report_seeds else seeds
    cells = [Cell(m, s) for m in modes for s in rseeds]
    write_report(Path(args.out), cells, modes, rseeds)
    print(f"report: {Path(args.out) / 'comparison.md'}", flush=True)


if __name__ == "__main__":
    main()
