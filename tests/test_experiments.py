"""The grid runner's comparison table, on evaluation results written by tasks.evaluation."""

from pathlib import Path

import numpy as np

from pmd_jax.experiments import cell_command, compare_runs
from pmd_jax.tasks import evaluation


def _write_run(root: Path, mode: str, seed: int, p_correct: float, rng) -> Path:
    run = root / f"{mode}_seed{seed}"
    records = []
    for i in range(40):
        rewards = (rng.random(2) < p_correct + (0.3 if i % 3 == 0 else 0.0)).astype(float)
        records.append({"problem_id": f"q{i}", "seed": 0, "split": "validation",
                        "rewards": rewards.tolist(), "reasons": [], "mean": rewards.mean()})
    res = evaluation.EvalResult(name=mode, records=records)
    evaluation.save_results(res, run / "eval" / "step_000000" / "results.jsonl")
    evaluation.save_results(res, run / "eval" / "step_000010" / "results.jsonl")
    return run


def test_compare_runs_pools_seeds_and_tests_against_first_mode(tmp_path):
    rng = np.random.default_rng(0)
    cells = {
        "grpo": [_write_run(tmp_path, "grpo", s, 0.2, rng) for s in (0, 1)],
        "pmd": [_write_run(tmp_path, "pmd", s, 0.6, rng) for s in (0, 1)],
    }
    table = compare_runs(cells, tmp_path / "out")
    assert "| grpo |" in table and "| pmd |" in table and "pmd - grpo" in table
    # the reference: evaluation.compare on the pooled per-problem scores
    pooled = {}
    for mode, dirs in cells.items():
        recs = []
        for d in dirs:
            r = evaluation.load_results(d / "eval" / "step_000010" / "results.jsonl")
            recs += r.records
        pooled[mode] = evaluation.EvalResult(name=mode, records=recs)
    ref = evaluation.compare(pooled["grpo"], pooled["pmd"])
    assert f"{ref['diff']:+.3f}" in table
    assert ref["diff"] > 0.2 and ref["p_sign"] < 0.01
    assert (tmp_path / "out" / "comparison.json").exists()


def test_cell_command_is_the_main_entry_point(tmp_path):
    cmd = cell_command("configs/smollm2_sciq.py", "sdpo", 3, tmp_path, ["--config.train.steps=2"])
    assert cmd[1:3] == ["-m", "pmd_jax.main"]
    assert "--config.mode=sdpo" in cmd and "--config.seed=3" in cmd
    assert cmd[-1] == "--config.train.steps=2"
