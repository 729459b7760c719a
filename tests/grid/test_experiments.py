"""The comparison grid (pmd_jax.experiments): cells on disk, resume/skip logic, the table.

Finished cells are written by hand here (metrics.jsonl + eval/step_*/results.jsonl with known
numbers, as the trainer writes them); the table's numbers are checked against direct numpy /
scipy computations: means per seed and over (problem, seed) pairs, bootstrap CIs against the
normal approximation, the sign test against scipy.stats.binomtest. The real end-to-end grid
(two tiny cells through pmd_jax.main) is marked slow: a tiny run takes minutes on a loaded CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pmd_jax.grid import command as ex
from pmd_jax.grid.command import Cell, GridError
from pmd_jax.grid.report import PLOT_FILE, REFERENCE_MODES
from tests.tiny_runs import child_env

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/smollm2_sciq.py"
STEPS = 4
OVERRIDES = [f"--config.train.steps={STEPS}", "--config.train.eval_every=2"]
BUDGET = {"config": CONFIG, "overrides": OVERRIDES, "train_steps": STEPS}


def _write_cell(folder: Path, cell: Cell, rewards: np.ndarray, *, steps: int = STEPS,
                last_train: int | None = None, final_eval: bool = True,
                info: dict | None = BUDGET) -> np.ndarray:
    """A run folder as the trainer leaves it: train records 0..steps-1, evals at 0, 2, ..,
    steps (accuracy at step s: the final accuracy scaled by s / steps), results.jsonl of the
    final evaluation with ``rewards[p]`` (k samples) for problem p. Returns the per-problem
    scores."""
    folder.mkdir(parents=True, exist_ok=True)
    scores = rewards.mean(axis=1)
    final_acc = float(scores.mean())
    last_train = steps - 1 if last_train is None else last_train
    recs = []
    for s in range(steps + 1):
        if s % 2 == 0 and (s < steps or final_eval) and s <= last_train + 1:
            recs.append({"kind": "eval", "step": s, "accuracy": final_acc * s / steps})
        if s <= last_train:
            recs.append({"kind": "train", "step": s, "loss": 0.1})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (folder / "config.json").write_text(json.dumps({"mode": cell.mode, "seed": cell.seed}))
    if final_eval:
        ev = folder / "eval" / f"step_{steps:06d}"
        ev.mkdir(parents=True)
        ev.joinpath("results.jsonl").write_text("".join(
            json.dumps({"name": ev.name, "problem_id": f"q{p}", "seed": 0, "split": "validation",
                        "rewards": r.tolist(), "reasons": [], "mean": float(r.mean()),
                        "in_sample": False}) + "\n" for p, r in enumerate(rewards)))
    if info is not None:
        (folder / ex.CELL_INFO).write_text(json.dumps({**info, "mode": cell.mode,
                                                        "seed": cell.seed}))
    return scores


# per-mode probability of a correct sample: pmd > sdpo > grpo
P = {"grpo": 0.3, "sdpo": 0.45, "pmd": 0.65}


@pytest.fixture
def grid(tmp_path):
    """3 modes x 2 seeds, 40 problems x 2 samples, all finished in out/."""
    rng = np.random.default_rng(1)
    out = tmp_path / "out"
    scores = {}
    for mode, p in P.items():
        for seed in (0, 1):
            rewards = (rng.random((40, 2)) < p).astype(float)
            scores[Cell(mode, seed)] = _write_cell(out / f"{mode}_seed{seed}", Cell(mode, seed),
                                                   rewards)
    return out, scores


def test_table_matches_direct_computation(grid):
    from scipy.stats import binomtest, norm

    out, scores = grid
    modes, seeds = list(P), [0, 1]
    comp = ex.write_report(out, [Cell(m, s) for m in modes for s in seeds], modes, seeds)
    assert comp["missing"] == []
    by_mode = {s["mode"]: s for s in comp["summaries"]}
    for mode in modes:
        s = by_mode[mode]
        units = np.concatenate([scores[Cell(mode, 0)], scores[Cell(mode, 1)]])
        assert s["n_pairs"] == 80 and s["n_problems"] == 40 and s["seeds"] == [0, 1]
        assert s["accuracy"] == pytest.approx(units.mean())
        for seed in seeds:
            assert s["per_seed"][str(seed)] == {
                "accuracy": pytest.approx(scores[Cell(mode, seed)].mean()), "n_problems": 40}
        # percentile bootstrap over the 80 pairs ~ normal approximation of the mean's CI
        half = 1.96 * units.std(ddof=0) / np.sqrt(units.size)
        assert s["ci_low"] == pytest.approx(units.mean() - half, abs=0.015)
        assert s["ci_high"] == pytest.approx(units.mean() + half, abs=0.015)
        # resampling problems (mean over seeds each): the CI of 40 problem means
        pm = (scores[Cell(mode, 0)] + scores[Cell(mode, 1)]) / 2
        half_p = 1.96 * pm.std(ddof=0) / np.sqrt(pm.size)
        assert s["ci_problems_low"] == pytest.approx(pm.mean() - half_p, abs=0.015)
        assert s["ci_problems_high"] == pytest.approx(pm.mean() + half_p, abs=0.015)
    pairs = {(c["mode"], c["reference"]): c for c in comp["comparisons"]}
    # every mode against SDPO, and against GRPO (grpo vs sdpo once)
    assert set(pairs) == {("grpo", "sdpo"), ("pmd", "sdpo"), ("pmd", "grpo")}
    for (mode, ref), c in pairs.items():
        d = np.concatenate([scores[Cell(mode, s)] - scores[Cell(ref, s)] for s in seeds])
        assert c["n_pairs"] == 80 and c["n_problems"] == 40 and c["seeds"] == [0, 1]
        assert c["diff"] == pytest.approx(d.mean())
        half = 1.96 * d.std(ddof=0) / np.sqrt(d.size)
        assert c["ci_low"] == pytest.approx(d.mean() - half, abs=0.02)
        assert c["ci_high"] == pytest.approx(d.mean() + half, abs=0.02)
        pos, neg = int((d > 0).sum()), int((d < 0).sum())
        assert (c["mode_better"], c["reference_better"], c["ties"]) == (pos, neg, 80 - pos - neg)
        assert c["p_sign"] == pytest.approx(binomtest(pos, pos + neg, 0.5).pvalue, rel=1e-9)
        # MDD at alpha 0.05 two-sided, power 0.8 (scipy's normal quantiles)
        z = norm.ppf(0.975) + norm.ppf(0.8)
        assert c["mdd"] == pytest.approx(z * d.std(ddof=1) / np.sqrt(d.size), rel=1e-9)
    assert pairs[("pmd", "grpo")]["p_sign"] < 0.01  # 0.65 vs 0.3: a real difference
    # the files: markdown shows the same numbers, JSON round-trips them, the plot is a PNG
    md = (out / "comparison.md").read_text()
    pg = pairs[("pmd", "grpo")]
    assert "| pmd - grpo | 80 | 40 | 2 |" in md and f"{pg['diff']:+.3f}" in md
    assert f"{pg['p_sign']:.4g} | {pg['mdd']:.3f} |" in md and "| MDD |" in md
    s = by_mode["sdpo"]
    assert f"{s['per_seed']['1']['accuracy']:.3f} (n=40)" in md
    assert f"[{s['ci_low']:.3f}, {s['ci_high']:.3f}]" in md
    js = json.loads((out / "comparison.json").read_text())
    assert js["summaries"][0]["accuracy"] == pytest.approx(by_mode["grpo"]["accuracy"])
    assert js["budget"] == BUDGET
    # the plotted curves: evaluations at steps 0, 2, 4 (accuracy final * step / 4 per seed)
    for mode in modes:
        c = comp["curves"][mode]
        finals = np.array([scores[Cell(mode, s)].mean() for s in seeds])
        assert c["steps"] == [0, 2, 4] and c["n_seeds"] == 2
        assert c["mean"] == pytest.approx([0.0, finals.mean() / 2, finals.mean()])
        assert c["min"][2] == pytest.approx(finals.min()) and c["max"][2] == finals.max()
    png = (out / PLOT_FILE).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    img = matplotlib.image.imread(out / PLOT_FILE)
    assert img.shape[0] > 200 and img.shape[1] > 300


def test_drift_and_retention_table(tmp_path):
    """KL(policy || initial) of the last record that has one (grpo: the final evaluation's
    own, pmd: the last train record's), mean / min / max over seeds; the
    retention accuracy pooled over (problem, seed) pairs; the accuracy-vs-KL plot."""
    from pmd_jax.grid.report import KL_PLOT_FILE

    rng = np.random.default_rng(3)
    out, kls, ret = tmp_path / "out", {}, {}
    for mode in ("grpo", "pmd"):
        for seed in (0, 1):
            cell, folder = Cell(mode, seed), out / f"{mode}_seed{seed}"
            _write_cell(folder, cell, (rng.random((10, 2)) < 0.5).astype(float))
            recs = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
            kl = {s: float(rng.random()) for s in range(STEPS)}
            for r in recs:
                if r["kind"] == "train":
                    r["kl_policy_initial"] = kl[r["step"]]
                    # 4 problems x n=2 rollouts of 10 tokens: 80 per step (a skipped
                    # over-long prompt is replaced; the counter is the run's running total)
                    r.update(response_tokens_mean=10.0, skipped_long_prompts=float(r["step"]))
                    if mode == "pmd" and seed == 0:  # seed 1 ran before the counter
                        r.update({"memory_generated_tokens": 7.0,
                                  "memory_behavior/generated_tokens": 3.0})
                elif r["step"] == STEPS and mode == "pmd":  # as memory_only logs it
                    r["accuracy_with_memory"] = 0.25 + 0.5 * seed
                    r.update(retention_task="mmlu_science", retention_prompt_style="direct_text")
                elif r["step"] == STEPS:  # grpo: the final weights' own KL (eval.kl_final)
                    r["kl_policy_initial"] = kl[STEPS] = float(rng.random())
            (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
            (folder / "config.json").write_text(json.dumps(
                {"mode": mode, "seed": seed, "rollout": {"problems_per_step": 4, "n": 2}}))
            kls[cell] = kl[max(kl)]
            if mode == "pmd":  # only pmd measured retention
                rr = (rng.random((6, 1)) < 0.4).astype(float)
                ret[cell] = rr.mean(axis=1)
                (folder / "eval" / f"step_{STEPS:06d}" / "retention.jsonl").write_text("".join(
                    json.dumps({"name": "r", "problem_id": f"mmlu/{p}", "seed": 0,
                                "split": "retention", "rewards": r.tolist(), "reasons": [],
                                "mean": float(r.mean()), "in_sample": False}) + "\n"
                    for p, r in enumerate(rr)))
    comp = ex.write_report(out, [Cell(m, s) for m in ("grpo", "pmd") for s in (0, 1)],
                           ["grpo", "pmd"], [0, 1])
    rows = {r["mode"]: r for r in comp["drift"]}
    for mode in ("grpo", "pmd"):
        v = [kls[Cell(mode, s)] for s in (0, 1)]
        assert rows[mode]["kl_step"] == [STEPS if mode == "grpo" else STEPS - 1]
        assert rows[mode]["kl_mean"] == pytest.approx(np.mean(v))
        assert (rows[mode]["kl_min"], rows[mode]["kl_max"]) == (min(v), max(v))
    assert "retention" not in rows["grpo"]
    units = np.concatenate([ret[Cell("pmd", 0)], ret[Cell("pmd", 1)]])
    assert rows["pmd"]["retention"]["accuracy"] == pytest.approx(units.mean())
    assert rows["pmd"]["retention"]["n_pairs"] == 12
    assert rows["pmd"]["retention"]["task"] == ["mmlu_science (direct_text)"]
    md = (out / "comparison.md").read_text()
    assert "| mmlu_science (direct_text) |" in md
    assert f"| grpo | 2 | {STEPS} |" in md and "not measured" in md
    assert f"{rows['pmd']['retention']['accuracy']:.3f}" in md
    assert (out / KL_PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "in_prompt" not in rows["grpo"]
    assert rows["pmd"]["in_prompt"] == {"metric": "accuracy_with_memory", "n_seeds": 2,
                                        "accuracy": 0.5}
    assert "| pmd | accuracy_with_memory | 2 | 0.500 |" in md
    # generated tokens: rollouts for both, the memory's reflections for pmd only
    assert rows["grpo"]["tokens"] == {"rollouts": 80.0 * STEPS}
    # pmd: the memory counter only on seed 0, so the total is seed 0's, never a mean with a
    # missing kind counted as 0 (which would put the total below its memory part)
    assert rows["pmd"]["tokens"] == {"rollouts": 80.0 * STEPS, "memory": 10.0 * STEPS}
    assert rows["pmd"]["tokens_seeds"] == {"rollouts": 2, "memory": 1}
    assert (rows["pmd"]["tokens_total"], rows["pmd"]["tokens_total_seeds"]) == (90.0 * STEPS, 1)
    # columns: rollouts, memory, mel, fast_slow, check replays, extra demos, total
    assert f"| grpo | {80 * STEPS:,} | - | - | - | - | - | {80 * STEPS:,} |" in md
    assert (f"| pmd | {80 * STEPS:,} | {10 * STEPS:,} (1 of 2 seeds) | - | - | - | - | "
            f"{90 * STEPS:,} (1 of 2 seeds) |") in md


def test_report_lists_a_missing_cell(grid):
    out, scores = grid
    modes, seeds = list(P), [0, 1, 2]  # seed 2 never ran; pmd seed 1 stopped midway
    (out / "pmd_seed1" / "eval" / f"step_{STEPS:06d}" / "results.jsonl").unlink()
    comp = ex.write_report(out, [Cell(m, s) for m in modes for s in seeds], modes, seeds)
    missing = {m["cell"]: m["why"] for m in comp["missing"]}
    assert set(missing) == {"grpo:2", "sdpo:2", "pmd:2", "pmd:1"}
    assert "results.jsonl" in missing["pmd:1"]
    pmd = next(s for s in comp["summaries"] if s["mode"] == "pmd")
    assert pmd["seeds"] == [0] and pmd["accuracy"] == pytest.approx(scores[Cell("pmd", 0)].mean())
    c = next(c for c in comp["comparisons"] if (c["mode"], c["reference"]) == ("pmd", "sdpo"))
    assert c["n_pairs"] == 40 and c["seeds"] == [0]  # matched pairs only
    md = (out / "comparison.md").read_text()
    assert "Cells finished: 5/9" in md and "pmd:1 (no eval/step_000004/results.jsonl)" in md
    assert "| pmd | 4 |" in md and "missing" in md



def test_against_another_grid_pairs_the_same_mode(tmp_path):
    """--against: this grid's sdpo (a variant's overrides) minus another grid's sdpo over the
    matched (problem, seed) pairs, checked against the direct computation; a grid of another
    config or last step is refused."""
    from scipy.stats import binomtest

    rng = np.random.default_rng(7)
    full, lora = tmp_path / "full", tmp_path / "lora"
    variant = {**BUDGET, "overrides": [*OVERRIDES, "--config.lora.enabled=True"]}
    ref, ours = {}, {}
    for seed in (0, 1):
        for mode in ("sdpo", "grpo"):  # the other grid holds a mode this one lacks
            ref[mode, seed] = _write_cell(full / f"{mode}_seed{seed}", Cell(mode, seed),
                                          (rng.random((30, 2)) < 0.4).astype(float))
        ours[seed] = _write_cell(lora / f"sdpo_seed{seed}", Cell("sdpo", seed),
                                 (rng.random((30, 2)) < 0.6).astype(float), info=variant)
    comp = ex.write_report(lora, [Cell("sdpo", 0), Cell("sdpo", 1)], ["sdpo"], [0, 1],
                           against=[full])
    (row,) = comp["against"]
    d = np.concatenate([ours[s] - ref["sdpo", s] for s in (0, 1)])
    assert row["mode"] == "sdpo" and row["reference"] == "sdpo [full]"
    assert row["n_pairs"] == 60 and row["seeds"] == [0, 1]
    assert row["diff"] == pytest.approx(d.mean())
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    assert (row["mode_better"], row["reference_better"]) == (pos, neg)
    assert row["p_sign"] == pytest.approx(binomtest(pos, pos + neg, 0.5).pvalue, rel=1e-9)
    assert row["against_overrides"] == [" ".join(OVERRIDES)]
    for s, ps_ in zip((0, 1), row["per_seed"], strict=True):
        assert ps_["diff"] == pytest.approx((ours[s] - ref["sdpo", s]).mean())
    md = (lora / "comparison.md").read_text()
    assert "## Against other grids" in md and "| sdpo - sdpo [full] |" in md
    assert f"{row['diff']:+.3f}" in md and "--config.lora.enabled=True" in md
    assert json.loads((lora / "comparison.json").read_text())["against"][0]["n_pairs"] == 60
    # the command line's flag reaches the report
    p = _cli(f"--config={CONFIG}", "--modes=sdpo", "--seeds=0,1", f"--out={lora}",
             "--report_only", f"--against={full}", *variant["overrides"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| sdpo - sdpo [full] |" in p.stdout
    # another last step cannot be paired
    other = tmp_path / "other"
    _write_cell(other / "sdpo_seed0", Cell("sdpo", 0), np.ones((30, 2)), steps=2,
                info={**BUDGET, "train_steps": 2})
    with pytest.raises(GridError, match="same config and last step"):
        ex.write_report(lora, [Cell("sdpo", 0)], ["sdpo"], [0], against=[other])
    with pytest.raises(GridError, match="no finished cell"):
        ex.write_report(lora, [Cell("sdpo", 0)], ["sdpo"], [0], against=[tmp_path / "lora" /
                                                                           "sdpo_seed0"])

def test_cell_state_and_budget_checks(tmp_path):
    rewards = np.ones((3, 1))
    done, why = ex.cell_state(tmp_path / "none", STEPS)
    assert not done and why == "not started"
    _write_cell(tmp_path / "a", Cell("grpo", 0), rewards)
    assert ex.cell_state(tmp_path / "a", STEPS) == (True, "finished")
    _write_cell(tmp_path / "b", Cell("grpo", 0), rewards, last_train=1, final_eval=False)
    done, why = ex.cell_state(tmp_path / "b", STEPS)
    assert not done and "no evaluation at step 4" in why
    with pytest.raises(GridError, match="past train.steps=2"):
        ex.cell_state(tmp_path / "a", 2)
    with pytest.raises(GridError, match="same budget"):
        ex.check_budget({**BUDGET, "overrides": ["--config.train.steps=8"]}, BUDGET,
                         tmp_path / "a")


def test_overrides_of_grid_keys_are_refused():
    assert ex.check_overrides(OVERRIDES) == OVERRIDES
    for bad in ("--config.mode=pmd", "--config.seed=3", "--config.run_dir=/x",
                "--config.eval.reuse_from=/x"):
        with pytest.raises(GridError, match="refused"):
            ex.check_overrides([*OVERRIDES, bad])
    # --share_start_eval: every cell may take its step-0 evaluation from the scratch folder
    cmd = ex.cell_command(CONFIG, "pmd", 1, Path("/s/pmd_seed1"), OVERRIDES, True)
    assert "--config.eval.reuse_from=/s" in cmd and cmd[-len(OVERRIDES):] == OVERRIDES
    assert not any("reuse_from" in a for a in ex.cell_command(
        CONFIG, "pmd", 1, Path("/s/pmd_seed1"), OVERRIDES))


def test_parse_cells():
    modes, seeds = ["grpo", "sdpo"], [0, 1]
    assert ex.parse_cells([], modes, seeds) == [Cell(m, s) for m in modes for s in seeds]
    assert ex.parse_cells(["sdpo:1", "grpo:0", "sdpo:1"], modes, seeds) == [
        Cell("sdpo", 1), Cell("grpo", 0)]
    with pytest.raises(GridError, match="not in the grid"):
        ex.parse_cells(["pmd:0"], modes, seeds)
    with pytest.raises(GridError, match="not mode:seed"):
        ex.parse_cells(["grpo"], modes, seeds)


def _never(cmd):
    pytest.fail(f"a process was started for a finished cell: {cmd}")


def test_run_grid_skips_finished_copies_scratch_and_reruns_unfinished(tmp_path):
    out, scratch = tmp_path / "docs" / "grid", tmp_path / "runs" / "grid"
    rewards = np.zeros((3, 2))
    # grpo:0 finished in out; grpo:1 finished in scratch only (crash before the copy), with
    # bulky files; grpo:2 stopped after step 1 (in scratch).
    _write_cell(out / "grpo_seed0", Cell("grpo", 0), rewards)
    _write_cell(scratch / "grpo_seed1", Cell("grpo", 1), rewards)
    (scratch / "grpo_seed1" / "checkpoints" / "4").mkdir(parents=True)
    (scratch / "grpo_seed1" / "checkpoints" / "4" / "state").write_bytes(b"x" * 100)
    (scratch / "grpo_seed1" / "final_hf").mkdir()
    _write_cell(scratch / "grpo_seed2", Cell("grpo", 2), rewards, last_train=1,
                final_eval=False)
    seeds = [0, 1, 2]
    launched = ex.run_grid(CONFIG, ["grpo"], seeds, out, scratch, OVERRIDES,
                           cells=[Cell("grpo", 0), Cell("grpo", 1)], runner=_never)
    assert launched == []
    copied = sorted(str(p.relative_to(out / "grpo_seed1"))
                    for p in (out / "grpo_seed1").rglob("*") if p.is_file())
    assert copied == ["cell.json", "config.json", "eval/step_000004/results.jsonl",
                      "metrics.jsonl"]
    assert (scratch / "grpo_seed1" / "checkpoints" / "4" / "state").is_file()  # not pruned
    ex.run_grid(CONFIG, ["grpo"], seeds, out, scratch, OVERRIDES, cells=[Cell("grpo", 1)],
                runner=_never, prune_checkpoints=True)
    assert not (scratch / "grpo_seed1" / "checkpoints").exists()
    assert (scratch / "grpo_seed1" / "final_hf").is_dir()  # the export stays
    calls = []

    def runner(cmd):  # the unfinished cell is started again with the grid's command
        calls.append(cmd)
        return 3

    with pytest.raises(ex.CellFailed, match="grpo:2 failed with exit code 3"):
        ex.run_grid(CONFIG, ["grpo"], seeds, out, scratch, OVERRIDES, runner=runner)
    assert calls == [ex.cell_command(CONFIG, "grpo", 2, scratch / "grpo_seed2", OVERRIDES)]
    assert not (out / "grpo_seed2").exists()
    # another budget for the same folders is refused before anything runs
    with pytest.raises(GridError, match="same budget"):
        ex.run_grid(CONFIG, ["grpo"], seeds, out, scratch, ["--config.train.steps=6"],
                    runner=_never)
    with pytest.raises(GridError, match="inside --out"):
        ex.run_grid(CONFIG, ["grpo"], seeds, out, out / "runs", OVERRIDES, runner=_never)


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run([sys.executable, "-m", "pmd_jax.experiments", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_cli_report_only_and_refusals(grid):
    out, _ = grid
    p = _cli(f"--config={CONFIG}", "--modes=grpo,sdpo,pmd", "--seeds=0,1,2",
             f"--out={out}", "--report_only")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "| pmd - grpo |" in p.stdout and "Cells finished: 6/9" in p.stdout
    assert "sdpo:2" in p.stderr  # the missing cells are logged too
    p = _cli(f"--config={CONFIG}", "--modes=grpo", f"--out={out}", "--config.seed=4")
    assert p.returncode == 2 and "--config.seed=4" in p.stderr and "refused" in p.stderr
    p = _cli(f"--config={CONFIG}", "--modes=grpo", f"--out={out}", "--cells=pmd:0")
    assert p.returncode == 2 and "not in the grid" in p.stderr


@pytest.mark.slow
def test_end_to_end_two_tiny_cells(tmp_path):
    """Two real cells (tiny random Llama, 1 step each) through pmd_jax.main, then a second
    invocation that starts no process."""
    tiny = [
        "--config.model.random_init=tiny-llama", "--config.rollout.problems_per_step=2",
        "--config.rollout.n=2", "--config.rollout.max_tokens=8",
        "--config.rollout.max_prompt_tokens=320", "--config.task.max_eval_problems=2",
        "--config.eval.n=1", "--config.eval.max_tokens=8", "--config.train.steps=1",
        "--config.train.eval_every=1", "--config.train.eval_at_start=False",
        "--config.teacher_prompt.max_tokens=768", "--config.distill.loss.topk=8",
        "--config.train.export_hf=False",
    ]
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    args = [f"--config={CONFIG}", "--modes=grpo,sdpo", "--seeds=0", f"--out={out}",
            f"--scratch={scratch}", *tiny]
    p = _cli(*args)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "cell 2/2 sdpo:0: done" in p.stderr
    for cell in ("grpo_seed0", "sdpo_seed0"):
        assert (out / cell / "eval" / "step_000001" / "results.jsonl").is_file()
        assert not (out / cell / "checkpoints").exists()
        # --prune_checkpoints (default): the finished cell's checkpoints are gone, its run
        # directory's records stay
        assert not (scratch / cell / "checkpoints").exists()
        assert (scratch / cell / "metrics.jsonl").is_file()
    assert "sdpo:0: finished, its checkpoints deleted" in p.stderr
    assert "| sdpo - grpo |" not in p.stdout and "| grpo - sdpo |" in p.stdout
    p = _cli(*args)
    assert p.returncode == 0 and p.stderr.count("skipped") == 2


# ----------------------------------------------------------------------------- diagnostics
NEW_MODES = ("grpo", "sdpo", "sdpo_matched_sampling", "pmd", "pmd_verified",
             "pmd_verified_random_memory")
VERIFY_ITEMS = ("proposed", "tested", "admitted", "rejected", "retired")
VERIFY_STATES = ("admitted", "pending", "rejected", "retired")


def _write_results(path: Path, rewards: np.ndarray, reasons: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(
        json.dumps({"name": path.parent.name, "problem_id": f"q{p}", "seed": 0,
                    "split": "validation", "rewards": r.tolist(), "reasons": why,
                    "mean": float(r.mean()), "in_sample": False}) + "\n"
        for p, (r, why) in enumerate(zip(rewards, reasons, strict=True))))


def _new_cell(folder: Path, cell: Cell, rng: np.random.Generator, *, old: bool = False
              ) -> dict:
    """A finished cell of the new modes (``old``: as logged before the new counters), with
    reasons at steps 0 and STEPS, and the per-step counters it logged; step 1 is logged
    twice (a run resumed from its step-1 checkpoint). Returns the logged arrays."""
    p = {"grpo": 0.3, "sdpo": 0.45, "sdpo_matched_sampling": 0.5}.get(cell.mode, 0.55)
    rewards = (rng.random((20, 2)) < p).astype(float)
    scores = _write_cell(folder, cell, rewards)
    reasons = {}
    for step, rw in ((0, (rng.random((20, 2)) < 0.3).astype(float)), (STEPS, rewards)):
        bad = rng.random(rw.shape) < (0.2 if step == 0 else 0.6)
        why = [["correct" if x else "invalid_answer" if b else "wrong_answer"
                for x, b in zip(r, br, strict=True)] for r, br in zip(rw, bad, strict=True)]
        _write_results(folder / "eval" / f"step_{step:06d}" / "results.jsonl", rw, why)
        reasons[step] = np.array(why)
    logged: dict = {"scores": scores, "invalid": {s: float((w == "invalid_answer").mean())
                                                  for s, w in reasons.items()}}
    recs = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    memory = cell.mode.startswith("pmd") and not old
    verify = cell.mode.startswith("pmd_verified") and not old
    for key, on, draw in (
            ("response_tokens_mean", True, lambda: float(rng.integers(5, 15))),
            *[(f"verify_items_{k}", verify, lambda: int(rng.integers(0, 6)))
              for k in VERIFY_ITEMS],
            *[(f"verify_memory_{k}", verify, lambda: int(rng.integers(0, 9)))
              for k in VERIFY_STATES],
            ("verify_generated_tokens", verify, lambda: int(rng.integers(50, 100))),
            ("extra_demo_sequences", cell.mode == "sdpo_matched_sampling", lambda: 16),
            ("extra_demo_generated_tokens", cell.mode == "sdpo_matched_sampling",
             lambda: int(rng.integers(30, 60))),
            ("extra_demo_found_fraction", cell.mode == "sdpo_matched_sampling", rng.random),
            ("memory_item_row_fraction", memory, rng.random),
            ("memory_signal_row_fraction", memory, rng.random)):
        if on:
            logged[key] = np.array([draw() for _ in range(STEPS)], dtype=float)
    if verify:  # each step tests at most what it proposed, and admits at most what it tests
        logged["verify_items_tested"] = np.minimum(logged["verify_items_tested"],
                                                   logged["verify_items_proposed"])
        logged["verify_items_admitted"] = np.minimum(logged["verify_items_admitted"],
                                                     logged["verify_items_tested"])
    if memory:  # rows whose signal is the memory alone hold memory items
        logged["memory_signal_row_fraction"] *= logged["memory_item_row_fraction"]
    for r in recs:
        if r["kind"] == "train":
            r.update({k: v[r["step"]].item() for k, v in logged.items()
                      if isinstance(v, np.ndarray)})
    at = next(i for i, r in enumerate(recs) if r["kind"] == "train" and r["step"] == 1)
    recs.insert(at + 1, dict(recs[at]))  # the resumed run logs step 1 again
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (folder / "config.json").write_text(json.dumps(
        {"mode": cell.mode, "seed": cell.seed, "rollout": {"problems_per_step": 4, "n": 2}}))
    return logged


def test_new_modes_references_and_diagnostics(tmp_path):
    """pmd_verified and its references: the comparison rows (the old references' first, each
    pair once), and the tables of answers that are not an option, of the check before use, of
    the memory's rows, and the generated tokens with the check's and the extra demos'; each
    against a direct computation from what the cells logged. pmd's seed 1 ran before the row
    counters existed."""
    rng = np.random.default_rng(7)
    out, seeds = tmp_path / "out", [0, 1]
    logs = {Cell(m, s): _new_cell(out / f"{m}_seed{s}", Cell(m, s), rng,
                                  old=(m, s) == ("pmd", 1))
            for m in NEW_MODES for s in seeds}
    comp = ex.write_report(out, [Cell(m, s) for m in NEW_MODES for s in seeds],
                           list(NEW_MODES), seeds)
    md = (out / "comparison.md").read_text()
    js = json.loads((out / "comparison.json").read_text())
    # the comparisons: every pair once, the old references first, in REFERENCE_MODES' order
    got = [(c["mode"], c["reference"]) for c in comp["comparisons"]]
    smp, pvr = "sdpo_matched_sampling", "pmd_verified_random_memory"
    assert got == [
        ("grpo", "sdpo"), (smp, "sdpo"), ("pmd", "sdpo"), ("pmd_verified", "sdpo"),
        (pvr, "sdpo"), (smp, "grpo"), ("pmd", "grpo"), ("pmd_verified", "grpo"),
        (pvr, "grpo"), ("pmd", smp), ("pmd_verified", smp), (pvr, smp),
        ("pmd_verified", "pmd"), (pvr, "pmd"), ("pmd_verified", pvr)]
    assert ex.REFERENCE_MODES is REFERENCE_MODES  # one definition
    for c in comp["comparisons"]:
        d = np.concatenate([logs[Cell(c["mode"], s)]["scores"]
                            - logs[Cell(c["reference"], s)]["scores"] for s in seeds])
        assert c["diff"] == pytest.approx(d.mean()) and c["n_pairs"] == 40
    for mode, ref in (("pmd_verified", "pmd"), ("pmd_verified", pvr), ("pmd_verified", smp)):
        assert f"| {mode} - {ref} | 40 | 20 | 2 |" in md
    # answers that are not an option: the share of samples, mean over seeds
    rows = {r["mode"]: r for r in comp["answers_not_options"]}
    for mode in NEW_MODES:
        first, last = ([logs[Cell(mode, s)]["invalid"][k] for s in seeds] for k in (0, STEPS))
        r = rows[mode]
        assert r["steps"]["0"]["invalid_fraction"] == {
            "mean": pytest.approx(np.mean(first)), "n_seeds": 2}
        assert r["steps"][str(STEPS)]["per_seed"] == {
            str(s): pytest.approx(v) for s, v in zip(seeds, last, strict=True)}
        assert r["steps"][str(STEPS)]["n_samples"] == {"0": 40, "1": 40}
        assert sum(r["steps"][str(STEPS)]["reasons"].values()) == pytest.approx(1.0)
        assert r["change"]["mean"] == pytest.approx(np.mean(last) - np.mean(first))
        assert (f"| {mode} | {np.mean(first):.3f} | 2 | {np.mean(last):.3f} | 2 | "
                f"{np.mean(last) - np.mean(first):+.3f} |") in md
    # the check before use: only the verify modes; sums over steps (step 1 once), the state
    # at the last step, the row fractions' means over steps; all means over seeds
    check = {r["mode"]: r for r in comp["memory"]["check"]}
    assert set(check) == {"pmd_verified", pvr}
    for mode, r in check.items():
        lg = [logs[Cell(mode, s)] for s in seeds]
        sums = {k: np.mean([x[f"verify_items_{k}"].sum() for x in lg]) for k in VERIFY_ITEMS}
        for k in VERIFY_ITEMS:
            assert r[k] == {"mean": pytest.approx(sums[k]), "n_seeds": 2}
        rate = (sum(x["verify_items_admitted"].sum() for x in lg)
                / sum(x["verify_items_tested"].sum() for x in lg))
        assert r["admission_rate"]["mean"] == pytest.approx(rate)
        state = [np.mean([x[f"verify_memory_{k}"][-1] for x in lg]) for k in VERIFY_STATES]
        assert [r[f"state_{k}"]["mean"] for k in VERIFY_STATES] == pytest.approx(state)
        fr = [np.mean([x[k].mean() for x in lg])
              for k in ("memory_item_row_fraction", "memory_signal_row_fraction")]
        assert (f"| {mode} | 2 | " + " | ".join(f"{sums[k]:,.1f}" for k in VERIFY_ITEMS)
                + f" | {rate:.3f} | " + " / ".join(f"{v:,.1f}" for v in state)
                + f" | {fr[0]:.3f} | {fr[1]:.3f} |") in md
    assert js["memory"]["check"][0]["mode"] == "pmd_verified"
    # the memory's rows: every memory mode; pmd's seed 1 never logged them
    ctx = {r["mode"]: r for r in comp["memory"]["context"]}
    assert set(ctx) == {"pmd", "pmd_verified", pvr}
    item = logs[Cell("pmd", 0)]["memory_item_row_fraction"].mean()
    assert ctx["pmd"]["memory_item_row_fraction"] == {"mean": pytest.approx(item),
                                                      "n_seeds": 1}
    sig = logs[Cell("pmd", 0)]["memory_signal_row_fraction"].mean()
    assert f"| pmd | 2 | {item:.3f} (1 of 2 seeds) | {sig:.3f} (1 of 2 seeds) |" in md
    # matched sampling's extra demonstrations
    (smp_row,) = comp["memory"]["sampling"]
    found = np.mean([logs[Cell(smp, s)]["extra_demo_found_fraction"].mean() for s in seeds])
    assert smp_row["mode"] == smp
    assert smp_row["extra_demo_sequences"] == {"mean": 16.0 * STEPS, "n_seeds": 2}
    assert f"| {smp} | 2 | {16 * STEPS} | " in md
    assert smp_row["extra_demo_found_fraction"]["mean"] == pytest.approx(found)
    # generated tokens: rollouts (4 problems x 2 each step), the check's replays and the
    # extra demos, both in the total; a step logged twice counts once
    drift = {r["mode"]: r for r in comp["drift"]}
    for mode in NEW_MODES:
        lg = [logs[Cell(mode, s)] for s in seeds]
        want = {"rollouts": np.mean([x["response_tokens_mean"].sum() * 8 for x in lg])}
        for group, key in (("check", "verify_generated_tokens"),
                           ("extra_demos", "extra_demo_generated_tokens")):
            if key in lg[0]:
                want[group] = np.mean([x[key].sum() for x in lg])
        assert drift[mode]["tokens"] == pytest.approx(want)
        assert drift[mode]["tokens_total"] == pytest.approx(sum(want.values()))
        cols = [want.get(g) for g in ("rollouts", "memory", "mel", "fast_slow", "check",
                                      "extra_demos")]
        assert (f"| {mode} | " + " | ".join("-" if v is None else f"{v:,.0f}" for v in cols)
                + f" | {sum(want.values()):,.0f} |") in md


def test_old_cells_render_dashes(grid):
    """Cells of an older grid (no reasons in their records, no check or row counters, no
    step-0 results) give '-' in the new tables, and no check-before-use table."""
    out, _ = grid
    modes, seeds = list(P), [0, 1]
    comp = ex.write_report(out, [Cell(m, s) for m in modes for s in seeds], modes, seeds)
    md = (out / "comparison.md").read_text()
    for mode in modes:
        assert f"| {mode} | - | 0 | - | 0 | - |" in md  # answers that are not an option
    assert comp["memory"]["check"] == [] and "Check before use" not in md
    assert comp["memory"]["context"] == [{"mode": "pmd", "n_seeds": 2,
                                          "memory_item_row_fraction": None,
                                          "memory_signal_row_fraction": None}]
    assert "| pmd | 2 | - | - |" in md
    assert "| grpo | 0 | - | - | - | - | - | 0 |" in md  # no rollout lengths logged
