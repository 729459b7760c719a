"""The grid's tables over steps (pmd_jax.grid.per_step), on cells written by hand as the
trainer writes them: the per-step accuracy and its paired change from step 0 against direct
numpy / scipy computations (mean, normal-approximation CI, scipy's binomial test), the
retention set's per-step rows for the seeds that measured it, the training reward per step
(mean / min / max over seeds) with its plot, and the answers-not-options table left out for a
code task."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pmd_jax.grid import command as ex
from pmd_jax.grid import per_step as ps
from pmd_jax.grid.command import Cell

STEPS = 4
EVAL_STEPS = (0, 2, 4)
BUDGET = {"config": "configs/smollm2_sciq.py", "overrides": [], "train_steps": STEPS}


def _results(path: Path, rewards: np.ndarray, split: str = "validation") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(
        json.dumps({"name": path.parent.name, "problem_id": f"q{p}", "seed": 0, "split": split,
                    "rewards": r.tolist(), "reasons": [], "mean": float(r.mean()),
                    "in_sample": False}) + "\n" for p, r in enumerate(rewards)))


def _cell(out: Path, cell: Cell, evals: dict[int, np.ndarray], train_reward: dict[int, float],
          task: str, retention: dict[int, np.ndarray] | None = None) -> None:
    folder = out / cell.name
    recs = []
    for s in range(STEPS + 1):
        if s in evals:
            recs.append({"kind": "eval", "step": s, "accuracy": float(evals[s].mean())})
            _results(folder / "eval" / f"step_{s:06d}" / "results.jsonl", evals[s])
        if s in (retention or {}):
            _results(folder / "eval" / f"step_{s:06d}" / "retention.jsonl",
                     retention[s], "retention")  # type: ignore[index]
        if s < STEPS:
            recs.append({"kind": "train", "step": s, "reward_mean": train_reward[s]})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (folder / "config.json").write_text(json.dumps(
        {"mode": cell.mode, "seed": cell.seed, "task": {"name": task}}))
    (folder / ex.CELL_INFO).write_text(json.dumps({**BUDGET, "mode": cell.mode,
                                                    "seed": cell.seed}))


def _grid(tmp_path: Path, task: str):
    """sdpo and pmd x seeds 0, 1; 50 problems x 2 samples at steps 0, 2, 4 (accuracy rising
    for pmd); pmd seed 0 alone measured retention (20 questions at steps 0 and 4)."""
    rng = np.random.default_rng(7)
    out, evals, rewards, ret = tmp_path / "out", {}, {}, {}
    for mode, rise in (("sdpo", 0.0), ("pmd", 0.1)):
        for seed in (0, 1):
            cell = Cell(mode, seed)
            evals[cell] = {s: (rng.random((50, 2)) < 0.3 + rise * s).astype(float)
                           for s in EVAL_STEPS}
            rewards[cell] = {s: float(rng.random()) for s in range(STEPS)}
            r = ({s: (rng.random((20, 1)) < 0.5).astype(float) for s in (0, STEPS)}
                 if cell == Cell("pmd", 0) else None)
            if r:
                ret[cell] = r
            _cell(out, cell, evals[cell], rewards[cell], task, r)
    comp = ex.write_report(out, [Cell(m, s) for m in ("sdpo", "pmd") for s in (0, 1)],
                           ["sdpo", "pmd"], [0, 1])
    return out, comp, evals, rewards, ret


def test_accuracy_per_step_and_change_from_step0(tmp_path):
    from scipy.stats import binomtest, norm

    out, comp, evals, _, _ = _grid(tmp_path, "sciq")
    rows = {(r["mode"], r["step"]): r for r in comp["per_step"]}
    assert set(rows) == {(m, s) for m in ("sdpo", "pmd") for s in EVAL_STEPS}
    md = (out / "comparison.md").read_text()
    for (mode, step), r in rows.items():
        x = np.concatenate([evals[Cell(mode, s)][step].mean(axis=1) for s in (0, 1)])
        assert (r["n_pairs"], r["seeds"]) == (100, [0, 1])
        assert r["accuracy"] == pytest.approx(x.mean())
        half = 1.96 * x.std() / np.sqrt(x.size)
        assert r["ci_low"] == pytest.approx(x.mean() - half, abs=0.02)
        assert r["ci_high"] == pytest.approx(x.mean() + half, abs=0.02)
        if step == 0:
            assert "change" not in r
            continue
        x0 = np.concatenate([evals[Cell(mode, s)][0].mean(axis=1) for s in (0, 1)])
        d, c = x - x0, r["change"]
        assert c["diff"] == pytest.approx(d.mean())
        half = 1.96 * d.std() / np.sqrt(d.size)
        assert c["ci_low"] == pytest.approx(d.mean() - half, abs=0.025)
        assert c["ci_high"] == pytest.approx(d.mean() + half, abs=0.025)
        up, down = int((d > 0).sum()), int((d < 0).sum())
        assert (c["better"], c["worse"], c["ties"]) == (up, down, 100 - up - down)
        assert c["p_sign"] == pytest.approx(binomtest(up, up + down, 0.5).pvalue, rel=1e-9)
        z = norm.ppf(0.975) + norm.ppf(0.8)
        assert c["mdd"] == pytest.approx(z * d.std(ddof=1) / np.sqrt(d.size), rel=1e-9)
        assert f"{c['p_sign']:.4g} | {c['mdd']:.3f} |" in md
        assert (f"| {mode} | {step} | 2 | 100 | {r['accuracy']:.3f} | "
                f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}] | {c['diff']:+.3f} |") in md
    # pmd's accuracy rises by ~0.4 over 4 steps: the change is real, not sdpo's
    assert rows[("pmd", 4)]["change"]["p_sign"] < 1e-6
    assert rows[("pmd", 4)]["change"]["ci_low"] > 0.2
    assert "| sdpo | 0 | 2 | 100 |" in md and "| - | - | - | - | - | - |" in md


def test_retention_per_step_and_its_seeds(tmp_path):
    out, comp, _, _, ret = _grid(tmp_path, "sciq")
    rows = {(r["mode"], r["step"]): r for r in comp["retention_per_step"]}
    assert set(rows) == {("pmd", 0), ("pmd", STEPS)}  # sdpo never measured it
    r0, r4 = ret[Cell("pmd", 0)][0][:, 0], ret[Cell("pmd", 0)][STEPS][:, 0]
    assert rows[("pmd", STEPS)]["seeds"] == [0] and rows[("pmd", STEPS)]["n_pairs"] == 20
    assert rows[("pmd", STEPS)]["accuracy"] == pytest.approx(r4.mean())
    assert rows[("pmd", STEPS)]["change"]["diff"] == pytest.approx((r4 - r0).mean())
    md = (out / "comparison.md").read_text()
    assert "Retention-set accuracy at every evaluated step" in md
    # the last-step drift table says the retention mean is over 1 of the mode's 2 seeds
    assert f"{r4.mean():.3f} (1 of 2 seeds)" in md


def test_training_reward_per_step_table_and_plot(tmp_path):
    out, comp, _, rewards, _ = _grid(tmp_path, "sciq")
    curves = comp["train_reward"]
    assert list(curves) == ["sdpo", "pmd"]
    md = (out / "comparison.md").read_text()
    for mode, c in curves.items():
        v = np.array([[rewards[Cell(mode, s)][t] for t in range(STEPS)] for s in (0, 1)])
        assert c["steps"] == list(range(STEPS)) and c["n_seeds"] == 2
        assert c["mean"] == pytest.approx(v.mean(axis=0).tolist())
        assert c["min"] == pytest.approx(v.min(axis=0).tolist())
        assert c["max"] == pytest.approx(v.max(axis=0).tolist())
        assert f"{c['mean'][3]:.3f} [{c['min'][3]:.3f}, {c['max'][3]:.3f}]" in md
    assert "| step | sdpo | pmd |" in md
    png = out / ps.TRAIN_REWARD_PLOT
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"Plot: `{ps.TRAIN_REWARD_PLOT}`" in md


def test_answers_table_is_left_out_for_code(tmp_path):
    out, comp, _, _, _ = _grid(tmp_path / "qa", "sciq")
    assert [r["mode"] for r in comp["answers_not_options"]] == ["sdpo", "pmd"]
    assert "Answers that are not an option" in (out / "comparison.md").read_text()
    out, comp, _, _, _ = _grid(tmp_path / "code", "mbpp")
    assert comp["answers_not_options"] == []
    assert "Answers that are not an option" not in (out / "comparison.md").read_text()


def test_a_long_run_shows_at_most_30_steps():
    steps = ps._table_steps(list(range(100)))
    assert len(steps) <= ps.MAX_TABLE_STEPS and steps[0] == 0 and steps[-1] == 99
    assert ps._table_steps([0, 1, 2]) == [0, 1, 2]
    curves = {"grpo": {"steps": list(range(100)), "n_seeds": 1, "mean": [0.5] * 100,
                       "min": [0.5] * 100, "max": [0.5] * 100, "seeds_at_step": [1] * 100,
                       "per_seed": {}}}
    md = "\n".join(ps.reward_markdown(curves))
    assert "(every 4th step and the last)" in md and "| 99 | 0.500 |" in md


def test_cost_per_cell_from_its_records(tmp_path):
    """Each cell's training-step and evaluation minutes and its peak host memory, from the
    records: a step redone after a resume counts once (its last record), an evaluated step
    once, and a cell that logged none of it (run before the counters) shows '-'."""
    out, _, _, _, _ = _grid(tmp_path, "mbpp")
    path = out / Cell("pmd", 0).name / "metrics.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    for r in recs:
        s = r["step"]
        if r["kind"] == "train":
            r.update(time_step=100.0 + s, rss_peak_gib_after_sample=2.0 + 0.1 * s,
                     rss_peak_gib_after_train=3.0 + 0.1 * s)
        else:
            r.update(time_eval=30.0 + s, **({"time_kl_final": 12.0} if s == STEPS else {}))
    # the run was killed in step 1 and resumed: step 1's first record (a larger peak from a
    # process that did not finish the step) and step 0's evaluation were logged twice
    recs.insert(2, {"kind": "train", "step": 1, "reward_mean": 0.0, "time_step": 1000.0,
                    "rss_peak_gib_after_train": 9.0})
    recs.insert(0, {"kind": "eval", "step": 0, "accuracy": 0.0, "time_eval": 500.0})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    comp = ex.write_report(out, [Cell(m, s) for m in ("sdpo", "pmd") for s in (0, 1)],
                           ["sdpo", "pmd"], [0, 1])
    rows = {r["cell"]: r for r in comp["cost"]}
    assert list(rows) == ["sdpo:0", "sdpo:1", "pmd:0", "pmd:1"]
    steps_s = sum(100.0 + s for s in range(STEPS))
    eval_s = sum(30.0 + s for s in EVAL_STEPS) + 12.0
    assert rows["pmd:0"] == {"cell": "pmd:0", "steps_s": steps_s, "eval_s": eval_s,
                             "rss_peak_gib": pytest.approx(3.0 + 0.1 * (STEPS - 1))}
    assert rows["sdpo:0"] == {"cell": "sdpo:0"}
    md = (out / "comparison.md").read_text()
    assert (f"| pmd:0 | {steps_s / 60:.1f} | {eval_s / 60:.1f} | "
            f"{3.0 + 0.1 * (STEPS - 1):.2f} |") in md
    assert "| sdpo:0 | - | - | - |" in md
