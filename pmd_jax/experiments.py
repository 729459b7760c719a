"""Run a grid of modes x seeds with identical budgets and write one comparison table.

    python -m pmd_jax.experiments --config=configs/smollm2_sciq.py \
        --modes=grpo,sdpo,pmd --seeds=0,1 --out=runs/compare [--config.train.steps=12]

Each cell is a normal run (``python -m pmd_jax.main``) in its own run directory, launched as
a subprocess so a crash in one cell leaves the others (and resumes where it stopped when the
grid is run again). The table uses the final memory-free evaluation of each run: mean with a
95% bootstrap CI over problems (seeds pooled), and paired tests (paired bootstrap and exact
sign test over problems) of every mode against the first one.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from absl import app, flags

_CONFIG = flags.DEFINE_string("config", None, "Config file (as for pmd_jax.main).")
_MODES = flags.DEFINE_list("modes", ["grpo", "sdpo", "pmd"], "Modes to compare.")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds per mode.")
_OUT = flags.DEFINE_string("out", "runs/compare", "Output folder for the grid.")
_DRY = flags.DEFINE_bool("print_only", False, "Print the commands, run nothing.")

log = logging.getLogger("pmd_jax")


def _final_eval_dir(run_dir: Path) -> Path | None:
    evals = sorted((run_dir / "eval").glob("step_*"))
    return evals[-1] if evals else None


def cell_command(
    config: str, mode: str, seed: int, run_dir: Path, overrides: list[str]
) -> list[str]:
    return [
        sys.executable, "-m", "pmd_jax.main", f"--config={config}", f"--config.mode={mode}",
        f"--config.seed={seed}", f"--config.run_dir={run_dir}", *overrides,
    ]


def compare_runs(cells: dict[str, list[Path]], out: Path) -> str:
    """Pools each mode's seeds, compares every mode to the first, writes table + JSON."""
    from pmd_jax.tasks import evaluation

    results = []
    for mode, dirs in cells.items():
        records: list[dict] = []
        for d in dirs:
            ev = _final_eval_dir(d)
            if ev is None or not (ev / "results.jsonl").exists():
                raise FileNotFoundError(f"run {d} has no final evaluation (did it finish?)")
            r = evaluation.load_results(ev / "results.jsonl", name=mode)
            seed = d.name.rsplit("seed", 1)[-1]
            for rec in r.records:  # keep seeds apart when pooling runs
                records.append({**rec, "seed": int(seed) * 1000 + int(rec["seed"])})
        results.append(evaluation.EvalResult(name=mode, records=records, n_boot=5000))
    for r in results:
        r.summarize()
    comps = [evaluation.compare(results[0], r) for r in results[1:]]
    table = evaluation.report_table(results, comps)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.md").write_text(table + "\n")
    (out / "comparison.json").write_text(json.dumps(
        {"summaries": [r.summary for r in results], "comparisons": comps}, indent=2,
        default=str))
    return table


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if not _CONFIG.value:
        raise app.UsageError("--config is required")
    overrides = [a for a in argv[1:] if a.startswith("--config.")]
    out = Path(_OUT.value)
    cells: dict[str, list[Path]] = {}
    for mode in _MODES.value:
        for seed in (int(s) for s in _SEEDS.value):
            run_dir = out / f"{mode}_seed{seed}"
            cells.setdefault(mode, []).append(run_dir)
            cmd = cell_command(_CONFIG.value, mode, seed, run_dir, overrides)
            log.info("cell %s seed %d: %s", mode, seed, " ".join(cmd))
            if _DRY.value:
                continue
            rc = subprocess.call(cmd)
            if rc != 0:
                raise SystemExit(f"cell {mode} seed {seed} failed with exit code {rc}")
    if not _DRY.value:
        print(compare_runs(cells, out))


if __name__ == "__main__":
    # Overrides for the cells (--config.x=y) are passed through, not parsed here.
    argv = [a for a in sys.argv if not a.startswith("--config.")]
    passthrough = [a for a in sys.argv if a.startswith("--config.")]
    app.run(lambda av: main(av[:1] + passthrough), argv=argv)
