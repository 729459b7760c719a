"""Run a grid of modes x seeds with identical budgets and write one comparison.

    python -m pmd_jax.experiments --config=configs/smollm2_sciq.py \
        --modes=grpo,sdpo,pmd,pmd_random_memory --seeds=0,1,2 --out=docs/results/grid_sciq \
        [--scratch=runs/grid/grid_sciq] [--cells=grpo:0,sdpo:1] [--report_only] \
        [--config.train.steps=12 ...]

Each cell (mode, seed) is a normal run (``python -m pmd_jax.main``) launched as a subprocess,
with the same ``--config.*`` overrides for every cell (only ``mode``, ``seed`` and ``run_dir``
differ, set by the grid; overriding them is refused). Every cell evaluates the initial weights
first; with ``--share_start_eval`` (the default) a cell takes that evaluation from another cell
of the scratch folder when their evaluation keys match (the same weights, settings and
evaluated prompts: ``pmd_jax.loop.eval_reuse``), so a grid whose cells share their problems
evaluates the initial model once.

Where things go:
- a cell's run directory (checkpoints, HF export, TensorBoard, plots, memory) is
  ``<scratch>/<mode>_seed<seed>``; ``--scratch`` defaults to ``runs/grid/<name of --out>``
  (``runs/`` is git-ignored) and must not lie inside ``--out``;
- when a cell has finished, its small files are copied to ``<out>/<mode>_seed<seed>/``:
  ``metrics.jsonl``, ``config.json``, ``eval/step_*/*.jsonl`` (per (problem, seed) evaluation
  records), plus ``cell.json`` (command, config, overrides, final step, wall time);
- ``<out>/comparison.md``, ``<out>/comparison.json`` and the plots
  (``accuracy_vs_step.png``, ``accuracy_vs_kl.png``, ``train_reward_vs_step.png``).
  Everything under ``--out`` is small and meant to be committed.

Resuming in pieces: a cell is finished when its metrics hold a train record for every step
and an evaluation at the configured last step (``train.steps``), and that step's
``results.jsonl`` exists. A finished cell (in ``--out``, or in the scratch folder and then
only copied) starts no process; an unfinished one is run again with the same command, and the
trainer resumes from its last checkpoint. A cell recorded with other overrides than the
current ones is refused (identical budgets). ``--cells=mode:seed,...`` runs only those cells;
``--report_only`` runs nothing and builds the comparison from the finished cells, listing the
missing ones. ``--against=<out of another grid>`` adds each mode against the same mode's cells
of that grid (same config and last step, other overrides: LoRA against full fine-tuning, say),
pair by pair.

Statistics (final evaluation of each cell, memory-free): the unit is a (problem, training
seed) pair, scored as the mean reward over its evaluation samples and evaluation seeds.
Per mode: mean over pairs (= mean over seeds of the per-seed accuracies when every seed has
the same problems), 95% percentile bootstrap CI resampling the pairs, and, for reference, a
95% CI resampling problems (each problem's mean over seeds). Per mode against each reference
of ``pmd_jax.grid.report.REFERENCE_MODES`` in the grid (SDPO, GRPO, sdpo_matched_sampling,
PMD, pmd_verified_random_memory; each pair once): the paired difference over matched
(problem, seed) pairs, its 95% paired bootstrap CI and p-value, and the exact two-sided sign
test (ties dropped). The same statistics at every evaluated step, with each (problem, seed)
pair's change from step 0 (``pmd_jax.grid.per_step``), for the task and the retention set;
the training reward per step (table and plot). Besides accuracy, the report tabulates drift
and retention, generated tokens by purpose, the answers that are not an option (tasks with
options), and the memory's check before use (``pmd_jax.grid.diagnostics``).

This module is the command line and the runner; a cell on disk is `pmd_jax.grid.cells`, the
statistics, table and plot are `pmd_jax.grid.report`.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from absl import app, flags
from absl import flags as absl_flags
from ml_collections import config_flags

from pmd_jax.config.cli import apply_taken, check_command_line
from pmd_jax.config.modes import apply_mode
from pmd_jax.config.validate import config_errors
from pmd_jax.grid.cells import (
    CELL_INFO,
    Cell,
    CellFailed,
    GridError,
    cell_state,
    check_budget,
    copy_small_files,
    read_info,
)
from pmd_jax.grid.report import REFERENCE_MODES, write_report
from pmd_jax.modes import aliases, canonical, mode_names
from pmd_jax.run.metrics import _fmt as fmt

_CONFIG = flags.DEFINE_string("config", None, "Config file (as for pmd_jax.main).")
_MODES = flags.DEFINE_list(
    "modes", ["grpo", "sdpo", "pmd"],
    f"Modes to compare; each is compared with those of {', '.join(REFERENCE_MODES)} in the grid.")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Training seeds per mode.")
_OUT = flags.DEFINE_string("out", "runs/compare", "Folder of the committed results.")
_SCRATCH = flags.DEFINE_string(
    "scratch", None, "Folder of the cells' run directories (checkpoints etc.); default "
    "runs/grid/<name of --out>.")
_CELLS = flags.DEFINE_list("cells", [], "Run only these cells: mode:seed,mode:seed.")
_REPORT_ONLY = flags.DEFINE_bool(
    "report_only", False, "Run nothing: build the comparison from the finished cells.")
_DRY = flags.DEFINE_bool("print_only", False, "Print the commands, run nothing.")
_SHARE = flags.DEFINE_bool(
    "share_start_eval", True,
    "A cell takes its step-0 evaluation from another cell of the scratch folder whose "
    "evaluation key matches (the same initial weights, settings and evaluated prompts: "
    "pmd_jax.loop.eval_reuse) instead of running it again; on the Qwen2.5-Coder MBPP grid "
    "that saves 16 minutes a cell. Memory-free evaluation only. --noshare_start_eval: every "
    "cell evaluates its own.")
_AGAINST = flags.DEFINE_list(
    "against", [],
    "Other grids' --out folders (same config and last step, other overrides: a variant such as "
    "--config.lora.enabled=True against full fine-tuning): the report compares each mode with "
    "the same mode's cells there, pair by pair.")
_PRUNE = flags.DEFINE_bool(
    "prune_checkpoints", True,
    "Delete a finished cell's checkpoints/ folder from its run directory once its results are "
    "copied to --out (the HF export and the plots stay). A cell of the SciQ grid keeps three "
    "1.9 GB checkpoints, so 12 cells need 67 GB without pruning; --noprune_checkpoints keeps "
    "them (to train a cell further, or to evaluate an intermediate step).")

log = logging.getLogger("pmd_jax")

# Set per cell by the grid; an override of them would break the grid's identical budgets.
GRID_KEYS: tuple[str, ...] = ("mode", "seed", "run_dir", "eval.reuse_from")


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
                "--config.run_dir are refused (and --config.eval.reuse_from: the grid's "
                "--share_start_eval sets it)")
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
    config: str, mode: str, seed: int, run_dir: Path, overrides: list[str],
    share_start_eval: bool = False,
) -> list[str]:
    """A cell's command; with ``share_start_eval`` the cell may take its step-0 evaluation
    from another cell in the scratch folder (``eval.reuse_from``, pmd_jax.loop.eval_reuse)."""
    share = [f"--config.eval.reuse_from={run_dir.parent}"] if share_start_eval else []
    return [
        sys.executable, "-m", "pmd_jax.main", f"--config={config}", f"--config.mode={mode}",
        f"--config.seed={seed}", f"--config.run_dir={run_dir}", *share, *overrides,
    ]


def grid_config(config: str, overrides: Sequence[str], mode: str | None = None) -> Any:
    """The cells' config (``mode`` set, ``apply_mode`` applied) with the overrides, as
    ``pmd_jax.main`` builds it; every problem of the command line or of the config raises
    GridError before any cell runs."""

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
    apply_taken(cfg, line)
    cfg = apply_mode(cfg)
    errs = config_errors(cfg)
    if cfg.train.eval_every < 0:
        errs.append("train.eval_every is < 0: the cells would never evaluate; the grid "
                    "compares the evaluation at the last step (train.eval_every >= 0)")
    if errs:
        raise GridError(f"invalid grid config (mode {cfg.mode}):\n  " + "\n  ".join(errs))
    return cfg


# ----------------------------------------------------------------------------- running


def _fmt(seconds: float) -> str:
    return fmt(seconds)


def _prune(cell: Cell, run_dir: Path) -> None:
    """Deletes a finished cell's checkpoints (its results are in --out already)."""
    if (run_dir / "checkpoints").is_dir():
        shutil.rmtree(run_dir / "checkpoints")
        log.info("cell %s: finished, its checkpoints deleted (--prune_checkpoints)", cell.key)


def run_grid(config: str, modes: Sequence[str], seeds: Sequence[int], out: Path,
             scratch: Path, overrides: Sequence[str], cells: Sequence[Cell] | None = None,
             print_only: bool = False, runner: Any = subprocess.call,
             prune_checkpoints: bool = False, share_start_eval: bool = False) -> list[Cell]:
    """Runs the unfinished cells of ``cells`` (default: the whole grid), one process each;
    copies each finished cell's small files to ``out`` (and with ``prune_checkpoints``
    deletes its run directory's ``checkpoints/`` then). Returns the cells it launched."""
    overrides = check_overrides(overrides)
    out, scratch = Path(out), Path(scratch)
    ro, rs = out.resolve(), scratch.resolve()
    if rs == ro or ro in rs.parents:
        raise GridError(f"--scratch {scratch} lies inside --out {out}: the run directories "
                        "(checkpoints, HF export) must stay out of the committed folder")
    cells = list(cells) if cells else [Cell(m, s) for m in modes for s in seeds]

    bad = [m for m in modes if canonical(m) not in mode_names()]
    if bad:
        raise GridError(f"unknown mode(s) {bad}; modes: {mode_names()}, aliases: "
                        f"{tuple(aliases())}")
    cfgs = {m: grid_config(config, overrides, m) for m in dict.fromkeys(c.mode for c in cells)}
    steps = int(next(iter(cfgs.values())).train.steps)
    budget = {"config": config, "overrides": list(overrides), "train_steps": steps}
    n = len(cells)
    t0 = time.time()
    durations: list[float] = []
    launched: list[Cell] = []
    for k, cell in enumerate(cells, 1):
        dest, run_dir = out / cell.name, scratch / cell.name
        check_budget(read_info(dest), budget, dest)
        if cell_state(dest, steps)[0]:
            log.info("cell %d/%d %s: finished (%s), skipped", k, n, cell.key, dest)
            if prune_checkpoints and not print_only:
                _prune(cell, run_dir)
            continue
        check_budget(read_info(run_dir), budget, run_dir)
        cmd = cell_command(config, cell.mode, cell.seed, run_dir, list(overrides),
                           share_start_eval)
        info = {**budget, "mode": cell.mode, "seed": cell.seed, "command": cmd[1:],
                "run_dir": str(run_dir)}
        done, why = cell_state(run_dir, steps)
        if not done:
            if print_only:
                print(" ".join(cmd))
                continue
            left = sum(1 for c in cells[k - 1:] if not cell_state(out / c.name, steps)[0])
            eta = float(np.mean(durations)) * left if durations else float("nan")
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
        if prune_checkpoints:
            _prune(cell, run_dir)
        info["wall_seconds"] = durations[-1] if launched and launched[-1] == cell else None
        (dest / CELL_INFO).write_text(json.dumps(info, indent=2) + "\n")
        left = sum(1 for c in cells[k:] if not cell_state(out / c.name, steps)[0])
        eta = float(np.mean(durations)) * left if durations else float("nan")
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
                     print_only=_DRY.value, prune_checkpoints=_PRUNE.value,
                     share_start_eval=_SHARE.value)
        if not _DRY.value:
            comp = write_report(out, [Cell(m, s) for m in modes for s in seeds], modes, seeds,
                                [Path(a) for a in _AGAINST.value])
            print(comp["markdown"])
    except CellFailed as e:
        try:  # what has finished is still worth a table
            write_report(out, [Cell(m, s) for m in modes for s in seeds], modes, seeds,
                         [Path(a) for a in _AGAINST.value])
        except GridError:
            pass
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except GridError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def run() -> None:
    """The command line: ``python -m pmd_jax.grid`` (or ``pmd_jax.experiments``)."""
    # Overrides for the cells (--config.x=y) are passed through, not parsed here.
    argv = [a for a in sys.argv if _override_key(a) is None]
    passthrough = [a for a in sys.argv if _override_key(a) is not None]
    app.run(lambda av: main(av[:1] + passthrough + av[1:]), argv=argv)


if __name__ == "__main__":
    run()
