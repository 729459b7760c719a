"""benchmarks/peer_sdpo_rl_cells.py: a peer's cell is a grid cell the grid's report reads.

The peer's training (TRL + sdpo-rl, not installed in the test environment) and our
evaluations (a model each) are the script's resumable parts; here they are already done, as
after a killed run: the script must assemble the cell from them without running anything,
in the grid's layout, and the grid's report must compare it with one of our cells.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import peer_sdpo_rl_cells as pc
from pmd_jax.grid.cells import Cell, cell_state
from pmd_jax.grid.report import write_report

CONFIG = "configs/smollm2_sciq.py"
PROBLEMS = [f"sciq/{i}" for i in range(6)]


def _results(d: Path, rewards: list[int]) -> None:
    d.mkdir(parents=True)
    d.joinpath("results.jsonl").write_text("".join(
        json.dumps({"name": d.name, "problem_id": p, "seed": 0, "split": "validation",
                    "rewards": [float(r)], "reasons": ["ok" if r else "wrong"],
                    "mean": float(r), "in_sample": False}) + "\n"
        for p, r in zip(PROBLEMS, rewards, strict=True)))


def _eval_run(run_dir: Path, rewards: list[int], cfg_json: dict) -> None:
    """A finished 0-step run of our evaluation: its eval record and its results."""
    _results(run_dir / "eval" / "step_000000", rewards)
    run_dir.joinpath("metrics.jsonl").write_text(json.dumps(
        {"kind": "eval", "step": 0, "accuracy": sum(rewards) / len(rewards),
         "num_problems": len(rewards)}) + "\n")
    run_dir.joinpath("config.json").write_text(json.dumps(cfg_json))


def _our_cell(out: Path, steps: int, evals: dict[int, list[int]]) -> None:
    """A finished cell of ours as the grid leaves it."""
    cell = out / "sdpo_seed0"
    recs = []
    for s in range(steps + 1):
        if s in evals:
            _results(cell / "eval" / f"step_{s:06d}", evals[s])
            recs.append({"kind": "eval", "step": s, "accuracy": sum(evals[s]) / len(evals[s])})
        if s < steps:
            recs.append({"kind": "train", "step": s, "reward_mean": 0.5})
    (cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (cell / "config.json").write_text("{}")
    (cell / "cell.json").write_text(json.dumps({
        "config": CONFIG, "overrides": [], "train_steps": steps, "mode": "sdpo", "seed": 0}))


def test_a_peer_cell_from_finished_parts_is_a_grid_cell(tmp_path, monkeypatch):
    monkeypatch.chdir(pc.sp.ROOT)
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    args = pc.parse([f"--config={CONFIG}", "--seeds=0", f"--out={out}",
                     f"--scratch={scratch}", "--peer_python=/nonexistent/python"])
    cfg = pc.run_config(args)
    steps = int(cfg.train.steps)
    assert pc.eval_steps(cfg) == [0, 6, 12] and steps == 12  # the embedded default's
    work = scratch / "seed0"
    work.mkdir(parents=True)
    (work / "train.jsonl").write_text("".join(
        json.dumps({"kind": "train", "step": k, "reward_mean": 0.25, "time_step": 30.0,
                    "time_sample": 7.0}) + "\n" for k in range(steps)))
    peer = {0: [0, 0, 1, 1, 0, 0], 6: [0, 1, 1, 1, 0, 0], 12: [1, 1, 1, 1, 0, 0]}
    _eval_run(scratch / "eval_initial", peer[0], {"mode": "sdpo"})
    for s in (6, 12):
        _eval_run(work / f"eval_step_{s}", peer[s], {"mode": "sdpo", "step": s})
    pc.make_cell(args, cfg, 0, scratch / "eval_initial")  # runs nothing: every part is done
    cell = out / "sdpo_rl_seed0"
    assert cell_state(cell, steps)[0]
    info = json.loads((cell / "cell.json").read_text())
    assert (info["mode"], info["train_steps"], info["overrides"]) == ("sdpo_rl", 12, [])
    recs = [json.loads(x) for x in (cell / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["kind"] == "eval"] == [0, 6, 12]
    assert [r["step"] for r in recs if r["kind"] == "train"] == list(range(12))
    assert json.loads((cell / "config.json").read_text())["step"] == 12  # the last eval's
    # the grid's report compares it with our cell, pair by pair
    _our_cell(out, steps, {0: peer[0], 6: [0] * 6, 12: [0, 0, 1, 0, 0, 0]})
    comp = write_report(out, [Cell("sdpo", 0), Cell("sdpo_rl", 0)], ["sdpo", "sdpo_rl"], [0])
    (c,) = comp["comparisons"]
    assert (c["mode"], c["reference"], c["n_pairs"]) == ("sdpo_rl", "sdpo", 6)
    assert c["diff"] == (4 - 1) / 6 and (c["mode_better"], c["reference_better"]) == (3, 0)
    assert "| sdpo_rl - sdpo | 6 |" in (out / "comparison.md").read_text()
