"""The grid's cells: what a cell is, and what of it lies on disk (finished or not, the files
that are committed, the budget it was run with). See ``pmd_jax.experiments`` for the grid."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from pmd_jax.run.metrics import read_metrics


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


SMALL_FILES: tuple[str, ...] = ("metrics.jsonl", "config.json")
CELL_INFO = "cell.json"


def eval_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "eval" / f"step_{step:06d}"


def cell_state(run_dir: Path, steps: int) -> tuple[bool, str]:
    """(finished, why not): finished = a train record for every step 0..steps-1, an eval
    record at ``steps`` and ``eval/step_<steps>/results.jsonl``."""

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
    if not (eval_dir(run_dir, steps) / "results.jsonl").is_file():
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


def read_info(folder: Path) -> dict | None:
    p = folder / CELL_INFO
    return json.loads(p.read_text()) if p.is_file() else None


def check_budget(info: dict | None, budget: dict, where: Path) -> None:
    if info is None:
        return
    theirs = {k: info.get(k) for k in budget}
    if ({**theirs, "overrides": sorted(theirs["overrides"] or [])}
            != {**budget, "overrides": sorted(budget["overrides"])}):
        raise GridError(
            f"{where} was run with {theirs}, this grid has {budget}: every cell must have the "
            "same budget; use the same config and overrides, or another --out / --scratch")


@dataclass
class CellResult:
    """What the report reads of one cell (``report.load_cell``)."""

    cell: Cell
    step: int
    scores: dict[str, float]  # problem_id -> mean reward (eval samples x eval seeds)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, accuracy)
    in_sample: bool = False
    # each evaluation with the KL(policy || initial) of the policy it evaluated
    kl_points: list[dict] = field(default_factory=list)
    last_kl: tuple[int, float] | None = None  # (step, kl_policy_initial): the last one
    retention_scores: dict[str, float] | None = None  # at the last step (eval.retention)
    retention_task: str = ""
    tokens: dict[str, float] = field(default_factory=dict)  # generated tokens by purpose
    # the last evaluation with the mode's text in the prompt: (metric, accuracy)
    in_prompt: tuple[str, float] | None = None
    # step (0 and the last) -> the share of evaluation samples per reason (diagnostics)
    reasons: dict[int, dict] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)  # diagnostics.run_counters
    # every evaluated step -> problem_id -> mean reward, for the task and the retention set
    step_scores: dict[int, dict[str, float]] = field(default_factory=dict)
    step_retention: dict[int, dict[str, float]] = field(default_factory=dict)
    train_reward: dict[int, float] = field(default_factory=dict)  # step -> rollouts' reward
    task: str = ""  # the run's task.name (config.json)
    cost: dict[str, float] = field(default_factory=dict)  # diagnostics.cell_cost
