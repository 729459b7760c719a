"""The grid's tables over training steps, read from the cells' evaluation records and metrics:
held-out accuracy (and the retention set's, ``eval.retention``) at every evaluated step with
its 95% CI and the paired change from step 0, and the training reward per step with its plot.

At an evaluated step a unit is a (problem, training seed) pair scored as its mean reward, as in
the last-step table of ``pmd_jax.grid.report``; the change from step 0 pairs each unit with
itself at step 0 (the same problem and seed before any update), so it is a within-cell
difference: its bootstrap CI resamples the pairs and its sign test counts the problems that
improved and got worse. A seed that did not evaluate a step is left out of that step (the
row's seeds say how many took part).

The training reward of a step is the mean reward of the step's rollouts (``reward_mean`` of its
train record): for the code tasks the share of rollouts whose program passes every training
test of its problem (the reward is 1 iff they all pass), for the question-answering tasks the
share answered correctly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from pmd_jax.grid.cells import CellResult, eval_dir
from pmd_jax.grid.diagnostics import _num, train_records
from pmd_jax.run import paths
from pmd_jax.tasks import evaluation
from pmd_jax.tasks.evaluation import (
    bootstrap_ci,
    minimum_detectable_difference,
    paired_bootstrap,
    sign_test,
)

TRAIN_REWARD_PLOT = "train_reward_vs_step.png"
# The per-step reward table shows at most this many steps (evenly spaced, the last included).
MAX_TABLE_STEPS = 30
CI = 0.95
N_BOOT = 10_000


def step_scores(folder: Path, file: str, name: str,
                known: dict[int, dict[str, float]] | None = None
                ) -> dict[int, dict[str, float]]:
    """step -> problem_id -> mean reward, for every ``eval/step_*/<file>`` of a run folder
    (``results.jsonl`` for the task, ``retention.jsonl`` for the retention set); the steps
    in ``known`` (already read by the caller) are taken from it, not read again."""

    out: dict[int, dict[str, float]] = {}
    for d in sorted((folder / "eval").glob("step_*")):
        step = d.name.removeprefix("step_")
        if step.isdigit() and (d / file).is_file() and d == eval_dir(folder, int(step)):
            got = (known or {}).get(int(step))
            out[int(step)] = (got if got is not None else
                              evaluation.load_results(d / file, name=name).problem_scores())
    return out


def train_rewards(recs: Sequence[dict]) -> dict[int, float]:
    """step -> the step's mean rollout reward (the last train record of each step)."""

    return {int(r["step"]): float(r["reward_mean"]) for r in train_records(recs)
            if _num(r.get("reward_mean"))}


def _units(rs: Sequence[CellResult], attr: str, step: int) -> dict[tuple[str, int], float]:
    return {(pid, r.cell.seed): v for r in rs
            for pid, v in getattr(r, attr).get(step, {}).items()}


def step_rows(results: Sequence[CellResult], modes: Sequence[str],
              attr: str = "step_scores") -> list[dict]:
    """Per mode and evaluated step: the accuracy over its (problem, seed) pairs with a
    percentile-bootstrap CI, and (after step 0) the paired change from step 0 with its CI,
    bootstrap p-value and sign test. ``attr``: ``step_scores`` (the task) or
    ``step_retention`` (the retention set)."""

    rows = []
    for mode in modes:
        rs = sorted((r for r in results if r.cell.mode == mode), key=lambda r: r.cell.seed)
        steps = sorted({s for r in rs for s in getattr(r, attr)})
        base = _units(rs, attr, 0) if 0 in steps else {}
        for step in steps:
            units = _units(rs, attr, step)
            x = np.fromiter(units.values(), dtype=np.float64, count=len(units))
            lo, hi = bootstrap_ci(x, ci=CI, n_boot=N_BOOT, seed=0)
            row: dict = {
                "mode": mode, "step": step, "accuracy": float(x.mean()), "ci_low": lo,
                "ci_high": hi, "n_pairs": int(x.size),
                "seeds": sorted({s for _, s in units})}
            common = sorted(set(units) & set(base)) if step != 0 else []
            if common:
                d = np.array([units[k] - base[k] for k in common], dtype=np.float64)
                clo, chi, p = paired_bootstrap(d, ci=CI, n_boot=N_BOOT, seed=0)
                up, down, p_sign = sign_test(d)
                row["change"] = {"diff": float(d.mean()), "ci_low": clo, "ci_high": chi,
                                 "p_bootstrap": p, "n_pairs": len(common), "better": up,
                                 "worse": down, "ties": len(common) - up - down,
                                 "p_sign": p_sign, "mdd": minimum_detectable_difference(d)}
            rows.append(row)
    return rows


def fmt(x: float, spec: str = ".3f") -> str:
    """A statistic for a table: ``spec`` format; a p-value (``.4f``) of 0 as below the
    bootstrap's resolution; 'n/a' for a missing or non-finite value."""
    if spec == ".4f" and x == 0.0:  # no bootstrap draw on the other side of 0
        return f"<{1 / N_BOOT:g}"
    return format(x, spec) if isinstance(x, int | float) and math.isfinite(x) else "n/a"


_f = fmt


def step_markdown(rows: Sequence[dict], what: str) -> list[str]:
    """The per-step table of :func:`step_rows`; ``what`` names the set in the caption."""
    if not rows:
        return []
    lines = [
        "", f"{what} at every evaluated step (memory-free): mean over (problem, seed) pairs "
        "with its 95% percentile-bootstrap CI (10,000 draws); change from step 0: the same "
        "pairs at this step minus at step 0, mean with its 95% paired-bootstrap CI and "
        "p-value, the pairs that got better / worse / tied, the exact two-sided sign test "
        "(ties dropped), and the change's minimum detectable difference (MDD: alpha 0.05, "
        "power 0.8, from the pairs' spread).", "",
        "| mode | step | seeds | pairs | accuracy | 95% CI | change from step 0 | 95% CI | "
        "p (bootstrap) | better / worse / ties | p (sign test) | MDD |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r.get("change")
        ch = (f"{_f(c['diff'], '+.3f')} | [{_f(c['ci_low'], '+.3f')}, "
              f"{_f(c['ci_high'], '+.3f')}] | {_f(c['p_bootstrap'], '.4f')} | {c['better']} / "
              f"{c['worse']} / {c['ties']} | {_f(c['p_sign'], '.4g')} | "
              f"{_f(c.get('mdd', float('nan')))}" if c
              else "- | - | - | - | - | -")
        lines.append(
            f"| {r['mode']} | {r['step']} | {len(r['seeds'])} | {r['n_pairs']} | "
            f"{_f(r['accuracy'])} | [{_f(r['ci_low'])}, {_f(r['ci_high'])}] | {ch} |")
    return lines


def reward_curves(results: Sequence[CellResult], modes: Sequence[str]) -> dict[str, dict]:
    """Per mode: step -> mean, min and max over the seeds that logged the step's reward."""
    out: dict[str, dict] = {}
    for mode in modes:
        per_seed = {r.cell.seed: r.train_reward for r in results
                    if r.cell.mode == mode and r.train_reward}
        if not per_seed:
            continue
        steps = sorted({s for v in per_seed.values() for s in v})
        vals = {s: [v[s] for v in per_seed.values() if s in v] for s in steps}
        out[mode] = {
            "steps": steps, "n_seeds": len(per_seed),
            "mean": [float(np.mean(vals[s])) for s in steps],
            "min": [float(np.min(vals[s])) for s in steps],
            "max": [float(np.max(vals[s])) for s in steps],
            "seeds_at_step": [len(vals[s]) for s in steps],
            "per_seed": {str(k): [[s, v[s]] for s in sorted(v)]
                         for k, v in sorted(per_seed.items())}}
    return out


def _table_steps(steps: Sequence[int]) -> list[int]:
    if len(steps) <= MAX_TABLE_STEPS:
        return list(steps)
    every = math.ceil(len(steps) / (MAX_TABLE_STEPS - 1))
    return sorted({*steps[::every], steps[-1]})


def reward_markdown(curves: Mapping[str, dict]) -> list[str]:
    """Training reward per step: one row per step, one column per mode (mean over seeds, with
    [min, max] where more than one seed logged it)."""
    if not curves:
        return []
    steps = _table_steps(sorted({s for c in curves.values() for s in c["steps"]}))
    shown = "" if len(steps) == len({s for c in curves.values() for s in c["steps"]}) else (
        f" (every {steps[1] - steps[0]}th step and the last)")
    lines = [
        "", "Training reward per step: the mean reward of the step's rollouts (code: the share "
        "of rollouts passing every training test of their problem; question answering: the "
        "share answered correctly), mean over seeds [min, max over seeds]" + shown + f"; plot: "
        f"`{TRAIN_REWARD_PLOT}`.", "",
        "| step | " + " | ".join(curves) + " |", "|---|" + "---|" * len(curves),
    ]
    for s in steps:
        cells = []
        for c in curves.values():
            if s not in c["steps"]:
                cells.append("-")
                continue
            i = c["steps"].index(s)
            cells.append(_f(c["mean"][i]) + (f" [{_f(c['min'][i])}, {_f(c['max'][i])}]"
                                             if c["seeds_at_step"][i] > 1 else ""))
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return lines


def save_plot(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """Labels, grid and legend of a grid plot; writes it to ``path``."""
    # lazy: matplotlib only for the plots, which a run without plotting never draws
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.save_figure(fig, path)
    plt.close(fig)
    return path


def plot_over_steps(curves: Mapping[str, dict], path: Path, ylabel: str, title: str) -> Path:
    """A value vs training step: per mode the mean over seeds (``steps``, ``mean``), a
    ``min``-``max`` band over seeds where there are several, and thin ``per_seed`` lines."""
    # lazy: matplotlib only for the plots, which a run without plotting never draws
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib only for the plots, which a run without plotting never draws
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

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
    return save_plot(fig, ax, path, "training step", ylabel, title)


def plot_rewards(curves: Mapping[str, dict], path: Path) -> Path | None:
    """Training reward vs step (:func:`reward_curves`); None when no cell logged it."""
    if not curves:
        return None
    return plot_over_steps(
        curves, path, "mean reward of the step's rollouts",
        "Training reward vs step (band: min-max over seeds; thin: each seed)")
