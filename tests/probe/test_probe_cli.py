"""The probe's command on the embedded model (SmolLM2-135M on SciQ): bad input fails before
any model is loaded; a small probe writes its report, and two arms that show the same text
give the same attempts (paired sampling keys through the real sampler)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _probe(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    from tests.tiny_runs import cache_flags, env

    return subprocess.run([sys.executable, "-m", "pmd_jax.probe",
                           "--config=configs/smollm2_sciq.py", *cache_flags(), *args],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


def _memory(path: Path, pids: list[str]) -> Path:
    rows = []
    for k, pid in enumerate(pids):
        rows.append({"level": "insight", "problem_id": pid, "kind": "strategy",
                     "text": f"Read the question about item {k} slowly."})
        rows.append({"level": "insight", "problem_id": pid, "kind": "lesson",
                     "text": f"Lesson {k}: copy the option exactly."})
    rows.append({"level": "behavior", "docid": "b0", "name": "copy_exactly",
                 "instruction": "Copy the chosen option's text exactly.", "cluster_id": 0})
    rows.append({"level": "cluster", "cluster_id": 0, "members": pids})
    rows.append({"level": "experience", "problem_id": pids[0], "step": 0, "rollout_index": 0,
                 "response_text": "<answer>x</answer>", "success": True})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_bad_input_fails_before_loading(tmp_path):
    r = _probe(f"--memory={tmp_path / 'none.jsonl'}", "--samples=1", "--train_arms=own,none",
               "--config.rollout.n=0", timeout=120)
    assert r.returncode == 2, r.stderr
    for msg in ("no memory file at", "--out=<folder> is required", "--samples=1: must be",
                "unknown train arm(s) ['own']", "rollout.n"):
        assert msg in r.stderr
    assert "loaded from" not in r.stderr  # no model was loaded


def test_small_probe_writes_report_and_pairs_attempts(tmp_path):
    from pmd_jax.config import apply_mode, freeze
    from pmd_jax.config.cli import load_config_file
    from pmd_jax.loop.build import build_task

    task = build_task(freeze(apply_mode(load_config_file("configs/smollm2_sciq.py"))),
                      check_heldout=False)
    pids = [str(p.id) for p in task.problems("train")[:12]]
    mem = _memory(tmp_path / "memory.jsonl", pids)
    out = tmp_path / "out"
    r = _probe(f"--memory={mem}", f"--out={out}", "--samples=2", "--screen_samples=4",
               "--max_train=4", "--max_heldout=0",
               "--train_arms=own_insights,other_insights,own_behaviors,other_behaviors",
               "--config.memory.behavior.top_k=1")
    if r.returncode == 2 and "screening kept no training problem" in r.stderr:
        pytest.fail("no mixed problem among 12: " + r.stderr[-500:])
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((out / "probe.json").read_text())
    assert (out / "probe.md").exists() and (out / "probe.png").stat().st_size > 10_000
    s = data["screen"]["train"]
    assert s["candidates"] == 12 and 1 <= s["kept"] <= 4
    assert s["mixed"] == 12 - s["never_solved"] - s["always_solved"]
    rows = {(c["a"], c["b"]): c for c in data["contrasts"]}
    # a bank of one behavior and top_k 1: both behavior arms show the same text, so paired
    # keys give the same attempts (any other pairing would differ somewhere)
    same = rows[("own_behaviors", "other_behaviors")]
    assert same["a_only"] == same["b_only"] == 0 and same["mean"] == 0.0
    assert same["verdict"].startswith("identical attempts")
    o = data["outcomes"]["train"]
    assert o["own_behaviors"] == o["other_behaviors"]
    assert set(o) == {"none", "own_insights", "other_insights", "own_behaviors",
                      "other_behaviors"}
    assert all(len(v) == 2 for arm in o.values() for v in arm.values())
    ins = rows[("own_insights", "other_insights")]
    assert ins["problems"] == s["kept"] and "mdd" in ins
    md = (out / "probe.md").read_text()
    assert "| train | own_insights | other_insights | primary" in md
    assert "Lesson" in md  # one prompt per arm shown
    assert "probe arm own_insights (train)" in r.stderr  # progress lines


def test_done_batches_skip_a_cut_line(tmp_path):
    import numpy as np

    from pmd_jax.probe.run import DoneBatches

    d = DoneBatches(tmp_path / "b.jsonl")
    d.put("a", np.array([[True, False]]))
    d.put("b", np.array([[False, False], [True, True]]))
    with open(tmp_path / "b.jsonl", "a") as f:
        f.write('{"key": "c", "ok": [[1')  # cut by a kill
    back = DoneBatches(tmp_path / "b.jsonl")
    assert set(back.rows) == {"a", "b"} and back.get("c") is None
    np.testing.assert_array_equal(back.get("b"), [[False, False], [True, True]])
    assert back.get("b").dtype == bool


@pytest.mark.slow
def test_a_killed_probe_resumes_from_its_finished_batches(tmp_path):
    """A kill during the last batch (its line half-written): the same command again restores
    every finished batch, redoes the last one, and writes the same outcomes."""
    from pmd_jax.config import apply_mode, freeze
    from pmd_jax.config.cli import load_config_file
    from pmd_jax.loop.build import build_task

    task = build_task(freeze(apply_mode(load_config_file("configs/smollm2_sciq.py"))),
                      check_heldout=False)
    mem = _memory(tmp_path / "memory.jsonl", [str(p.id) for p in task.problems("train")[:12]])
    out = tmp_path / "out"
    args = (f"--memory={mem}", f"--out={out}", "--samples=2", "--screen_samples=4",
            "--max_train=4", "--max_heldout=0",
            "--train_arms=own_insights,other_insights,own_behaviors,other_behaviors",
            "--config.memory.behavior.top_k=1")
    r = _probe(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads((out / "probe.json").read_text())
    done = out / "probe_batches.jsonl"
    lines = done.read_text().splitlines()
    assert len(lines) == 6  # screening + 5 arms
    done.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    again = _probe(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("attempts restored from") == 5, again.stderr[-3000:]
    assert json.loads((out / "probe.json").read_text())["outcomes"] == data["outcomes"]


def test_a_batch_key_changes_with_what_the_attempts_depend_on():
    from pmd_jax.config import apply_mode, freeze
    from pmd_jax.config.cli import load_config_file
    from pmd_jax.probe.run import batch_key
    from pmd_jax.sampling.base import SamplingParams

    cfg = freeze(apply_mode(load_config_file("configs/smollm2_sciq.py")))
    p = SamplingParams(n=2, temperature=0.7, max_tokens=8, seed=3)
    k = batch_key("arm a", "train", p, [[1, 2], [3]], cfg)
    assert k == batch_key("arm a", "train", p, [[1, 2], [3]], cfg)
    others = [batch_key("arm b", "train", p, [[1, 2], [3]], cfg),
              batch_key("arm a", "hidden", p, [[1, 2], [3]], cfg),
              batch_key("arm a", "train", SamplingParams(n=2, temperature=0.7, max_tokens=8,
                                                         seed=4), [[1, 2], [3]], cfg),
              batch_key("arm a", "train", p, [[1], [2, 3]], cfg),  # (same tokens, split)
              batch_key("arm a", "train", p, [[1, 2], [4]], cfg)]
    assert k not in others and len(set(others)) == len(others)
