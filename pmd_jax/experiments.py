"""Run a grid of modes x seeds with identical budgets and write one comparison.

    python -m pmd_jax.experiments --config=configs/smollm2_sciq.py \
        --modes=grpo,sdpo,pmd,pmd_random_memory --seeds=0,1,2 --out=docs/results/grid_sciq \
        [--scratch=runs/grid/grid_sciq] [--cells=grpo:0,sdpo:1] [--report_only] \
        [--config.train.steps=12 ...]

Each cell (mode, seed) is a normal run (``python -m pmd_jax.main``) launched as a subprocess,
with the same ``--config.*`` overrides for every cell (only ``mode``, ``seed`` and ``run_dir``
differ, set by the grid; overriding them is refused).

Where things go:
- a cell's run directory (checkpoints, HF export, TensorBoard, plots, memory) is
  ``<scratch>/<mode>_seed<seed>``; ``--scratch`` defaults to ``runs/grid/<name of --out>``
  (``runs/`` is git-ignored) and must not lie inside ``--out``;
- when a cell has finished, its small files are copied to ``<out>/<mode>_seed<seed>/``:
  ``metrics.jsonl``, ``config.json``, ``eval/step_*/*.jsonl`` (per (problem, seed) evaluation
  records), plus ``cell.json`` (command, config, overrides, final step, wall time);
- ``<out>/comparison.md``, ``<out>/comparison.json`` and ``<out>/accuracy_vs_step.png``.
  Everything under ``--out`` is small and meant to be committed.

Resuming in pieces: a cell is finished when its metrics hold a train record for every step
and an evaluation at the configured last step (``train.steps``), and that step's
``results.jsonl`` exists. A finished cell (in ``--out``, or in the scratch folder and then
only copied) starts no process; an unfinished one is run again with the same command, and the
trainer resumes from its last checkpoint. A cell recorded with other overrides than the
current ones is refused (identical budgets). ``--cells=mode:seed,...`` runs only those cells;
``--report_only`` runs nothing and builds the comparison from the finished cells, listing the
missing ones.

Statistics (final evaluation of each cell, memory-free): the unit is a (problem, training
seed) pair, scored as the mean reward over its evaluation samples and evaluation seeds.
Per mode: mean over pairs (= mean over seeds of the per-seed accuracies when every seed has
the same problems), 95% percentile bootstrap CI resampling the pairs, and, for reference, a
95% CI resampling problems (each problem's mean over seeds). Per mode against SDPO and GRPO
(those in the grid): the paired difference over matched (problem, seed) pairs, its 95% paired
bootstrap CI and p-value, and the exact two-sided sign test (ties dropped).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from absl import app, flags

_CONFIG = flags.DEFINE_string("config", None, "Config file (as for pmd_jax.main).")
_MODES = flags.DEFINE_list("modes", ["grpo", "sdpo", "pmd"], "Modes to compare.")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Training seeds per mode.")
_OUT = flags.DEFINE_string("out", "runs/compare", "Folder of the committed results.")
_SCRATCH = flags.DEFINE_string(
    "scratch", None, "Folder of the cells' run directories (checkpoints etc.); default "
    "runs/grid/<name of --out>.")
_CELLS = flags.DEFINE_list("cells", [], "Run only these cells: mode:seed,mode:seed.")
_REPORT_ONLY = flags.DEFINE_bool(
    "report_only", False, "Run nothing: build the comparison from the finished cells.")
_DRY = flags.DEFINE_bool("print_only", False, "Print the commands, run nothing.")

log = logging.getLogger("pmd_jax")

# Set per cell by the grid; an override of them would break the grid's identical budgets.
GRID_KEYS: tuple[str, ...] = ("mode", "seed", "run_dir")
REFERENCE_MODES: tuple[str, ...] = ("sdpo", "grpo")
N_BOOT = 10_000
CI = 0.95
PLOT_FILE = "accuracy_vs_step.png"


class GridError(ValueError):
    """A problem with the grid's command line or its cells' folders."""


class CellFailed(GridError):
    """A cell's process failed (the grid stops; running it again resumes the cell)."""


@dataclass(frozen=True, order=True)
class Cell:
    mode: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.mode}_seed{self.seed}"

    @property
    def key(self) -> str:
        return f"{self.mode}:{self.seed}"


# ----------------------------------------------------------------------------- command line


def _override_key(arg: str) -> str | None:
    for pre in ("--config.", "--noconfig.", "-config.", "-noconfig."):
        if arg.startswith(pre):
            return arg[len(pre):].split("=", 1)[0]
    return None


def check_overrides(overrides: Sequence[str]) -> list[str]:
    """The passthrough ``--config.*`` overrides, checked: ``mode`` / ``seed`` / ``run_dir``
    are the grid's (refused), and every override must carry its value (``--config.k=v``,
    or a bare boolean)."""
    out = []
    for a in overrides:
        key = _override_key(a)
        if key is None:
            raise GridError(f"{a!r} is not a --config.* override")
        if key in GRID_KEYS:
            raise GridError(
                f"{a!r}: the grid sets {key} per cell (--modes / --seeds / --scratch); every "
                "cell must get the same overrides, so --config.mode, --config.seed and "
                "--config.run_dir are refused")
        out.append(a)
    return out


def parse_cells(spec: Sequence[str], modes: Sequence[str], seeds: Sequence[int]) -> list[Cell]:
    """``["grpo:0", "sdpo:1"]`` -> cells, each of which must be in the grid."""
    grid = [Cell(m, s) for m in modes for s in seeds]
    if not spec:
        return grid
    out = []
    for item in spec:
        mode, sep, seed = item.strip().rpartition(":")
        try:
            cell = Cell(mode, int(seed))
        except ValueError:
            cell = None
        if not sep or cell is None:
            raise GridError(f"--cells entry {item!r} is not mode:seed (e.g. grpo:0)")
        if cell not in grid:
            raise GridError(f"--cells entry {item!r} is not in the grid (--modes="
                            f"{','.join(modes)} --seeds={','.join(map(str, seeds))})")
        if cell not in out:
            out.append(cell)
    return out


def cell_command(
    config: str, mode: str, seed: int, run_dir: Path, overrides: list[str]
) -> list[str]:
    return [
        sys.executable, "-m", "pmd_jax.main", f"--config={config}", f"--config.mode={mode}",
        f"--config.seed={seed}", f"--config.run_dir={run_dir}", *overrides,
    ]


def grid_config(config: str, overrides: Sequence[str], mode: str | None = None) -> Any:
    """The cells' config (``mode`` set, ``apply_mode`` applied) with the overrides, as
    ``pmd_jax.main`` builds it; every problem of the command line or of the config raises
    GridError before any cell runs."""
    from absl import flags as absl_flags
    from ml_collections import config_flags

    from pmd_jax.config import apply_mode, config_errors
    from pmd_jax.config_cli import check_command_line, set_none

    argv = ["pmd_jax.experiments", f"--config={config}", *overrides]
    if mode is not None:
        argv.append(f"--config.mode={mode}")
    line = check_command_line(argv)
    if line.errors:
        raise GridError("invalid grid config:\n  " + "\n  ".join(line.errors))
    fv = absl_flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True,
                                    sys_argv=line.argv)
    fv(line.argv)
    cfg = fv.config
    set_none(cfg, line.none_keys)
    cfg = apply_mode(cfg)
    errs = config_errors(cfg)
    if cfg.train.eval_every < 0:
        errs.append("train.eval_every is < 0: the cells would never evaluate; the grid "
                    "compares the evaluation at the last step (train.eval_every >= 0)")
    if errs:
        raise GridError(f"invalid grid config (mode {cfg.mode}):\n  " + "\n  ".join(errs))
    return cfg


# ----------------------------------------------------------------------------- cells on disk

SMALL_FILES: tuple[str, ...] = ("metrics.jsonl", "config.json")
CELL_INFO = "cell.json"


def _eval_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "eval" / f"step_{step:06d}"


def cell_state(run_dir: Path, steps: int) -> tuple[bool, str]:
    """(finished, why not): finished = a train record for every step 0..steps-1, an eval
    record at ``steps`` and ``eval/step_<steps>/results.jsonl``."""
    from pmd_jax.metrics import read_metrics

    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return False, "not started" if not run_dir.exists() else "no metrics.jsonl"
    recs = read_metrics(metrics)
    train = {int(r["step"]) for r in recs if r.get("kind") == "train"}
    evals = {int(r["step"]) for r in recs if r.get("kind") == "eval"}
    last = max(train | evals, default=-1)
    if last > steps or (train and max(train) >= steps):
        raise GridError(
            f"{run_dir} holds records up to step {last}, past train.steps={steps}: it was run "
            "with a longer budget; use another --out / --scratch for this budget")
    if steps not in evals:
        done = f"train records up to step {max(train)}" if train else "no train record"
        return False, f"no evaluation at step {steps} yet ({done})"
    gaps = sorted(set(range(steps)) - train)
    if gaps:
        return False, f"metrics lack train steps {gaps[:5]}{'...' if len(gaps) > 5 else ''}"
    if not (_eval_dir(run_dir, steps) / "results.jsonl").is_file():
        return False, f"no eval/step_{steps:06d}/results.jsonl"
    return True, "finished"


def copy_small_files(run_dir: Path, dest: Path) -> list[Path]:
    """Copies a run's committed files (metrics, config, evaluation records) to ``dest``."""
    written = []
    files = [run_dir / f for f in SMALL_FILES if (run_dir / f).is_file()]
    files += sorted((run_dir / "eval").glob("step_*/*.jsonl"))
    for f in files:
        target = dest / f.relative_to(run_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
        written.append(target)
    return written


def _read_info(folder: Path) -> dict | None:
    p = folder / CELL_INFO
    return json.loads(p.read_text()) if p.is_file() else None


def _check_budget(info: dict | None, budget: dict, where: Path) -> None:
    if info is None:
        return
    theirs = {k: info.get(k) for k in budget}
    if ({**theirs, "overrides": sorted(theirs["overrides"] or [])}
            != {**budget, "overrides": sorted(budget["overrides"])}):
        raise GridError(
            f"{where} was run with {theirs}, this grid has {budget}: every cell must have the "
            "same budget; use the same config and overrides, or another --out / --scratch")


# ----------------------------------------------------------------------------- statistics


@dataclass
class CellResult:
    cell: Cell
    step: int
    scores: dict[str, float]  # problem_id -> mean reward (eval samples x eval seeds)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, accuracy)
    in_sample: bool = False


def load_cell(folder: Path, cell: Cell, step: int) -> CellResult:
    from pmd_jax.metrics import read_metrics
    from pmd_jax.tasks import evaluation

    res = evaluation.load_results(_eval_dir(folder, step) / "results.jsonl", name=cell.name)
    curve = sorted(
        (int(r["step"]), float(r["accuracy"])) for r in read_metrics(folder / "metrics.jsonl")
        if r.get("kind") == "eval" and isinstance(r.get("accuracy"), int | float))
    return CellResult(cell, step, res.problem_scores(), curve, res.in_sample)


def _units(results: Sequence[CellResult]) -> dict[tuple[str, int], float]:
    return {(pid, r.cell.seed): v for r in results for pid, v in r.scores.items()}


def summarize_mode(mode: str, results: Sequence[CellResult]) -> dict:
    """Accuracy of one mode at the last step over its (problem, seed) pairs."""
    from pmd_jax.tasks.evaluation import bootstrap_ci

    units = _units(results)
    x = np.array(list(units.values()), dtype=np.float64)
    lo, hi = bootstrap_ci(x, ci=CI, n_boot=N_BOOT, seed=0)
    by_problem: dict[str, list[float]] = {}
    for (pid, _), v in units.items():
        by_problem.setdefault(pid, []).append(v)
    px = np.array([np.mean(v) for v in by_problem.values()], dtype=np.float64)
    plo, phi = bootstrap_ci(px, ci=CI, n_boot=N_BOOT, seed=0)
    per_seed = {
        str(r.cell.seed): {"accuracy": float(np.mean(list(r.scores.values()))),
                           "n_problems": len(r.scores)}
        for r in sorted(results, key=lambda r: r.cell.seed)}
    accs = [v["accuracy"] for v in per_seed.values()]
    return {
        "mode": mode,
        "step": results[0].step,
        "accuracy": float(x.mean()),
        "ci_low": lo, "ci_high": hi,
        "ci_problems_low": plo, "ci_problems_high": phi,
        "n_pairs": int(x.size),
        "n_problems": len(by_problem),
        "seeds": [r.cell.seed for r in sorted(results, key=lambda r: r.cell.seed)],
        "per_seed": per_seed,
        "seed_std": float(np.std(accs, ddof=1)) if len(accs) > 1 else float("nan"),
        "in_sample": any(r.in_sample for r in results),
    }


def compare_modes(ref: str, ref_res: Sequence[CellResult], mode: str,
                  res: Sequence[CellResult]) -> dict:
    """``mode - ref`` over their matched (problem, seed) pairs."""
    from pmd_jax.tasks.evaluation import paired_bootstrap, sign_test

    a, b = _units(ref_res), _units(res)
    common = sorted(set(a) & set(b))
    if not common:
        raise GridError(f"modes {mode} and {ref} share no (problem, seed) pair")
    d = np.array([b[k] - a[k] for k in common], dtype=np.float64)
    lo, hi, p_boot = paired_bootstrap(d, ci=CI, n_boot=N_BOOT, seed=0)
    pos, neg, p_sign = sign_test(d)
    return {
        "mode": mode, "reference": ref,
        "n_pairs": len(common),
        "n_problems": len({p for p, _ in common}),
        "seeds": sorted({s for _, s in common}),
        "accuracy_mode": float(np.mean([b[k] for k in common])),
        "accuracy_reference": float(np.mean([a[k] for k in common])),
        "diff": float(d.mean()), "ci_low": lo, "ci_high": hi, "p_bootstrap": p_boot,
        "mode_better": pos, "reference_better": neg, "ties": len(common) - pos - neg,
        "p_sign": p_sign,
    }


def build_comparison(results: Sequence[CellResult], modes: Sequence[str]) -> dict:
    by_mode: dict[str, list[CellResult]] = {}
    for r in results:
        by_mode.setdefault(r.cell.mode, []).append(r)
    present = [m for m in modes if m in by_mode]
    summaries = [summarize_mode(m, by_mode[m]) for m in present]
    comps, done = [], set()
    for ref in REFERENCE_MODES:
        if ref not in by_mode:
            continue
        for m in present:
            if m == ref or frozenset((m, ref)) in done:
                continue
            done.add(frozenset((m, ref)))
            comps.append(compare_modes(ref, by_mode[ref], m, by_mode[m]))
    return {"summaries": summaries, "comparisons": comps}


def _f(x: float, fmt: str = ".3f") -> str:
    if fmt == ".4f" and x == 0.0:  # a p-value: no bootstrap draw on the other side of 0
        return f"<{1 / N_BOOT:g}"
    return format(x, fmt) if isinstance(x, int | float) and math.isfinite(x) else "n/a"


def report_markdown(comp: dict, header: Sequence[str], seeds: Sequence[int]) -> str:
    lines = [*header, ""]
    lab = " (in-sample)" if any(s["in_sample"] for s in comp["summaries"]) else ""
    lines += [
        "Accuracy at the last step (memory-free held-out evaluation; a unit is a (problem, "
        "training seed) pair scored as its mean reward). Mean over the pairs; 95% CI: "
        "percentile bootstrap resampling the pairs (10,000 draws); 95% CI (problems): "
        "resampling problems, each the mean over its seeds. Per-seed columns: accuracy (n "
        "problems)." + lab, "",
        "| mode | step | accuracy | 95% CI (pairs) | 95% CI (problems) | pairs | problems | "
        "seeds | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(seeds),
    ]
    for s in comp["summaries"]:
        per = [
            f"{_f(s['per_seed'][str(k)]['accuracy'])} (n={s['per_seed'][str(k)]['n_problems']})"
            if str(k) in s["per_seed"] else "missing" for k in seeds]
        lines.append(
            f"| {s['mode']} | {s['step']} | {_f(s['accuracy'])} | [{_f(s['ci_low'])}, "
            f"{_f(s['ci_high'])}] | [{_f(s['ci_problems_low'])}, {_f(s['ci_problems_high'])}] "
            f"| {s['n_pairs']} | {s['n_problems']} | {len(s['seeds'])} | " + " | ".join(per)
            + " |")
    if comp["comparisons"]:
        lines += [
            "", "Paired differences (mode - reference) over matched (problem, seed) pairs: mean, "
            "95% paired bootstrap CI and p-value (10,000 draws), exact two-sided sign test "
            "(ties dropped).", "",
            "| mode - reference | pairs | problems | seeds | mode | reference | diff | 95% CI | "
            "p (bootstrap) | mode better / reference better / ties | p (sign test) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in comp["comparisons"]:
            lines.append(
                f"| {c['mode']} - {c['reference']} | {c['n_pairs']} | {c['n_problems']} | "
                f"{len(c['seeds'])} | {_f(c['accuracy_mode'])} | {_f(c['accuracy_reference'])} "
                f"| {_f(c['diff'], '+.3f')} | [{_f(c['ci_low'], '+.3f')}, "
                f"{_f(c['ci_high'], '+.3f')}] | {_f(c['p_bootstrap'], '.4f')} | "
                f"{c['mode_better']} / {c['reference_better']} / {c['ties']} | "
                f"{_f(c['p_sign'], '.4g')} |")
    return "\n".join(lines) + "\n"


def accuracy_curves(results: Sequence[CellResult], modes: Sequence[str]) -> dict:
    """Per mode: the steps every seed of the mode evaluated at, and the mean / min / max
    over seeds of the held-out accuracy there (from the cells' metrics.jsonl)."""
    curves = {}
    for mode in modes:
        cs = [dict(r.curve) for r in results if r.cell.mode == mode]
        if not cs:
            continue
        steps = sorted(set.intersection(*(set(c) for c in cs)))
        ys = np.array([[c[s] for s in steps] for c in cs], dtype=np.float64).reshape(
            len(cs), len(steps))
        curves[mode] = {
            "steps": steps, "n_seeds": len(cs),
            "mean": ys.mean(axis=0).tolist(), "min": ys.min(axis=0).tolist(),
            "max": ys.max(axis=0).tolist(),
            "per_seed": {str(r.cell.seed): [list(x) for x in r.curve]
                         for r in results if r.cell.mode == mode},
        }
    return curves


def plot_curves(curves: dict, path: Path) -> Path:
    """Held-out accuracy vs step: per mode the mean over seeds (at the steps every seed of
    the mode evaluated), a min-max band over seeds, and thin per-seed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from pmd_jax import paths

    fig, ax = plt.subplots(figsize=(7.0, 4.4), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (mode, c) in enumerate(curves.items()):
        color = colors[i % len(colors)]
        for pts in c["per_seed"].values():
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, color=color, lw=0.7, alpha=0.35)
        if not c["steps"]:
            continue
        ax.plot(c["steps"], c["mean"], color=color, lw=2.0, marker="o", ms=3,
                label=f"{mode} (mean of {c['n_seeds']} seeds)")
        if c["n_seeds"] > 1:
            ax.fill_between(c["steps"], c["min"], c["max"], color=color, alpha=0.15)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy (memory-free)")
    ax.set_title("Held-out accuracy vs step (band: min-max over seeds; thin: each seed)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.save_figure(fig, path)
    plt.close(fig)
    return path


def write_report(out: Path, cells: Sequence[Cell], modes: Sequence[str],
                 seeds: Sequence[int]) -> dict:
    """Builds comparison.md / comparison.json / the plot from the finished cells in ``out``
    (each with its cell.json); the others are listed as missing."""
    finished, missing, infos = [], [], []
    for cell in cells:
        folder = out / cell.name
        info = _read_info(folder)
        ok, why = (cell_state(folder, int(info["train_steps"])) if info
                   else (False, "not in --out"))
        if ok:
            finished.append(load_cell(folder, cell, int(info["train_steps"])))
            infos.append(info)
        else:
            missing.append((cell, why))
    for cell, why in missing:
        log.warning("cell %s missing from the comparison: %s", cell.key, why)
    if not finished:
        raise GridError(f"no finished cell in {out}: nothing to compare")
    budgets = {json.dumps({k: i[k] for k in ("config", "overrides", "train_steps")})
               for i in infos}
    if len(budgets) > 1:
        raise GridError(f"the finished cells in {out} have different budgets: {sorted(budgets)}")
    budget = infos[0]
    comp = build_comparison(finished, modes)
    comp["missing"] = [{"cell": c.key, "why": why} for c, why in missing]
    comp["budget"] = {k: budget[k] for k in ("config", "overrides", "train_steps")}
    comp["cells"] = [r.cell.key for r in finished]
    comp["curves"] = accuracy_curves(finished, modes)
    header = [
        "# Comparison grid", "",
        f"Config `{budget['config']}`, overrides (every cell): "
        f"`{' '.join(budget['overrides']) or 'none'}`; last step {budget['train_steps']}. "
        f"Cells finished: {len(finished)}/{len(cells)}"
        + (". Missing: " + "; ".join(f"{c.key} ({why})" for c, why in missing)
           if missing else "."),
        f"Plot: `{PLOT_FILE}` (mean over seeds, band min-max over seeds).",
    ]
    table = report_markdown(comp, header, seeds)
    (out / "comparison.md").write_text(table)
    (out / "comparison.json").write_text(json.dumps(comp, indent=2, default=str) + "\n")
    plot_curves(comp["curves"], out / PLOT_FILE)
    comp["markdown"] = table
    return comp


# ----------------------------------------------------------------------------- running


def _fmt(seconds: float) -> str:
    from pmd_jax.metrics import _fmt as fmt

    return fmt(seconds)


def run_grid(config: str, modes: Sequence[str], seeds: Sequence[int], out: Path,
             scratch: Path, overrides: Sequence[str], cells: Sequence[Cell] | None = None,
             print_only: bool = False, runner: Any = subprocess.call) -> list[Cell]:
    """Runs the unfinished cells of ``cells`` (default: the whole grid), one process each;
    copies each finished cell's small files to ``out``. Returns the cells it launched."""
    overrides = check_overrides(overrides)
    out, scratch = Path(out), Path(scratch)
    ro, rs = out.resolve(), scratch.resolve()
    if rs == ro or ro in rs.parents:
        raise GridError(f"--scratch {scratch} lies inside --out {out}: the run directories "
                        "(checkpoints, HF export) must stay out of the committed folder")
    cells = list(cells) if cells else [Cell(m, s) for m in modes for s in seeds]
    from pmd_jax.config import MODES

    bad = [m for m in modes if m not in MODES]
    if bad:
        raise GridError(f"unknown mode(s) {bad}; modes: {MODES}")
    cfgs = {m: grid_config(config, overrides, m) for m in dict.fromkeys(c.mode for c in cells)}
    steps = int(next(iter(cfgs.values())).train.steps)
    budget = {"config": config, "overrides": list(overrides), "train_steps": steps}
    n = len(cells)
    t0, durations, launched = time.time(), [], []
    for k, cell in enumerate(cells, 1):
        dest, run_dir = out / cell.name, scratch / cell.name
        _check_budget(_read_info(dest), budget, dest)
        if cell_state(dest, steps)[0]:
            log.info("cell %d/%d %s: finished (%s), skipped", k, n, cell.key, dest)
            continue
        _check_budget(_read_info(run_dir), budget, run_dir)
        cmd = cell_command(config, cell.mode, cell.seed, run_dir, list(overrides))
        info = {**budget, "mode": cell.mode, "seed": cell.seed, "command": cmd[1:],
                "run_dir": str(run_dir)}
        done, why = cell_state(run_dir, steps)
        if not done:
            if print_only:
                print(" ".join(cmd))
                continue
            left = sum(1 for c in cells[k - 1:] if not cell_state(out / c.name, steps)[0])
            eta = np.mean(durations) * left if durations else float("nan")
            log.info("cell %d/%d %s: running (%s) | elapsed %s | ETA %s for %d cells | %s",
                     k, n, cell.key, why, _fmt(time.time() - t0), _fmt(eta), left,
                     " ".join(cmd))
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / CELL_INFO).write_text(json.dumps(info, indent=2) + "\n")
            t = time.time()
            rc = runner(cmd)
            durations.append(time.time() - t)
            launched.append(cell)
            if rc != 0:
                raise CellFailed(f"cell {cell.key} failed with exit code {rc} (run dir "
                                f"{run_dir}); run the same command again to resume it")
            done, why = cell_state(run_dir, steps)
            if not done:
                raise GridError(f"cell {cell.key} exited 0 but is not finished: {why}")
        if print_only:
            continue
        copy_small_files(run_dir, dest)
        info["wall_seconds"] = durations[-1] if launched and launched[-1] == cell else None
        (dest / CELL_INFO).write_text(json.dumps(info, indent=2) + "\n")
        left = sum(1 for c in cells[k:] if not cell_state(out / c.name, steps)[0])
        eta = np.mean(durations) * left if durations else float("nan")
        log.info("cell %d/%d %s: done, results in %s | elapsed %s | ETA %s for %d cells",
                 k, n, cell.key, dest, _fmt(time.time() - t0), _fmt(eta), left)
    return launched


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    overrides = [a for a in argv[1:] if _override_key(a) is not None]
    extra = [a for a in argv[1:] if _override_key(a) is None]
    if extra:
        raise app.UsageError(f"unexpected arguments {extra} (overrides are --config.key=value)")
    if not _CONFIG.value:
        raise app.UsageError("--config is required")
    out = Path(_OUT.value)
    scratch = Path(_SCRATCH.value or f"runs/grid/{out.name}")
    modes = [m.strip() for m in _MODES.value]
    try:
        seeds = [int(s) for s in _SEEDS.value]
    except ValueError as e:
        raise app.UsageError(f"--seeds must be integers: {e}") from None
    try:
        check_overrides(overrides)
        cells = parse_cells(_CELLS.value, modes, seeds)
        if not _REPORT_ONLY.value:
            run_grid(_CONFIG.value, modes, seeds, out, scratch, overrides, cells,
                     print_only=_DRY.value)
        if not _DRY.value:
            comp = write_report(out, [Cell(m, s) for m in modes for s in seeds], modes, seeds)
            print(comp["markdown"])
    except CellFailed as e:
        try:  # what has finished is still worth a table
            write_report(out, [Cell(m, s) for m in modes for s in seeds], modes, seeds)
        except GridError:
            pass
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except GridError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    # Overrides for the cells (--config.x=y) are passed through, not parsed here.
    argv = [a for a in sys.argv if _override_key(a) is None]
    passthrough = [a for a in sys.argv if _override_key(a) is not None]
    app.run(lambda av: main(av[:1] + passthrough + av[1:]), argv=argv)
