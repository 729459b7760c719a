"""Taking the step-0 evaluation from another run (eval.reuse_from, pmd_jax.loop.eval_reuse).

The key: equal for two cells of a grid (another mode, another seed, another run folder) and
different when anything the evaluation reads differs (one weight's bit, a sampling setting,
a problem's prompt or tests). End to end, on the tiny run through ``python -m pmd_jax.main``:
a first run evaluates and writes its key, a second run (another mode) takes its files and
metrics instead of evaluating, a run whose prompts differ (another seed: SciQ draws its
option order with the run seed) evaluates itself; the slow
test checks that what is taken is what the taker would have computed (its own evaluation,
reuse off, gives the same files byte for byte)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.loop import eval_reuse
from pmd_jax.tasks.base import Problem
from tests.loop.test_retention import _cfg  # (base config + overrides, frozen)
from tests.tiny_runs import ROOT, cmd, env

STEP0 = ["--config.train.steps=0", "--config.train.eval_at_start=True",
         "--config.train.eval_every=0", "--config.train.export_hf=False"]


class _Task:
    def prompt(self, p):
        return [{"role": "user", "content": p.question}]


PARAMS = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
          "b": jnp.ones((4,), jnp.bfloat16)}
PROBS = [Problem("a", "Add 1 and 2.", {"tests": ["assert f() == 3"]}),
         Problem("b", "Say hi.", "hi")]


def _key(cfg, params=PARAMS, probs=PROBS):
    return eval_reuse.evaluation_key(cfg, params, eval_reuse.problems_read(cfg, _Task(), probs))


def test_key_is_a_grid_cells_and_changes_with_what_the_evaluation_reads():
    base = _cfg(mode="sdpo")
    k = _key(base)
    # another cell of the grid: mode, seed, run folder and the reuse folder itself
    assert _key(_cfg(mode="pmd", seed=3, run_dir="/elsewhere", **{"eval.reuse_from": "x"})) == k
    # one bit of one weight
    w = np.asarray(PARAMS["w"]).copy()
    w.view(np.uint32)[1, 2] ^= 1
    assert _key(base, {**PARAMS, "w": jnp.asarray(w)}) != k
    assert _key(base, {**PARAMS, "b": PARAMS["b"].astype(jnp.float32)}) != k  # dtype
    # a sampling setting, the model, the task section
    assert _key(_cfg(mode="sdpo", **{"eval.max_tokens": 7})) != k
    assert _key(_cfg(mode="sdpo", **{"eval.seeds": (0, 1)})) != k
    assert _key(_cfg(mode="sdpo", **{"model.dtype": "bfloat16"})) != k
    assert _key(_cfg(mode="sdpo", **{"task.max_eval_problems": 7})) != k
    # a problem's prompt, its tests, the problems' order
    assert _key(base, probs=[Problem("a", "Add 1 and 3.", PROBS[0].gold), PROBS[1]]) != k
    assert _key(base, probs=[Problem("a", PROBS[0].question, {"tests": []}), PROBS[1]]) != k
    assert _key(base, probs=PROBS[::-1]) != k
    # the package's sources are hashed once per process
    src = eval_reuse.source_digest()
    assert len(src) == 64 and eval_reuse.source_digest() == src


def test_a_code_change_changes_the_key(monkeypatch):
    k = _key(_cfg(mode="sdpo"))
    monkeypatch.setattr(eval_reuse, "source_digest", lambda: "0" * 64)
    assert _key(_cfg(mode="sdpo")) != k


def test_find_needs_the_key_and_every_file(tmp_path):
    a = tmp_path / "a" / "eval" / "step_000000"
    a.mkdir(parents=True)
    (a / "results.jsonl").write_text("{}\n")
    eval_reuse.write_key(a, "k1", {"accuracy": 0.5, "accuracy_with_memory": 0.9,
                                   "time_eval": 3.0, "num_problems": 2})
    info = json.loads((a / eval_reuse.KEY_FILE).read_text())
    # only the memory-free metrics of the files it lists
    assert info == {"key": "k1", "files": ["results.jsonl"],
                    "metrics": {"accuracy": 0.5, "num_problems": 2}}
    assert eval_reuse.find(tmp_path, "k1", tmp_path / "b") == a
    assert eval_reuse.find(tmp_path, "k2", tmp_path / "b") is None
    assert eval_reuse.find(tmp_path, "k1", tmp_path / "a") is None  # never its own
    (a / "results.jsonl").unlink()
    assert eval_reuse.find(tmp_path, "k1", tmp_path / "b") is None  # a file is gone


def _run(run_dir: Path, *extra: str) -> tuple[dict, Path]:
    p = subprocess.run(cmd(run_dir, *STEP0, *extra), cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0], evals  # evaluated once, not at start and end
    return evals[0], run_dir / "eval" / "step_000000"


def _two_cells(root: Path) -> tuple[dict, Path, dict, Path]:
    reuse = f"--config.eval.reuse_from={root}"
    a, a_dir = _run(root / "sdpo_seed0", "--config.mode=sdpo", "--config.seed=0", reuse)
    b, b_dir = _run(root / "pmd_seed0", "--config.mode=pmd", "--config.seed=0", reuse)
    return a, a_dir, b, b_dir


def test_a_second_cell_takes_the_first_cells_step0_evaluation(tmp_path):
    a, a_dir, b, b_dir = _two_cells(tmp_path)
    assert "eval_reused_from" not in a and (a_dir / eval_reuse.KEY_FILE).is_file()
    assert b["eval_reused_from"] == str(tmp_path / "sdpo_seed0")
    for k in ("accuracy", "accuracy_ci_low", "accuracy_ci_high", "num_problems"):
        assert b[k] == a[k]
    assert (b_dir / "results.jsonl").read_bytes() == (a_dir / "results.jsonl").read_bytes()
    # another seed: SciQ's option order is drawn with the run seed, so the prompts differ,
    # no run under the folder has that key, and it evaluates (and writes its key)
    c, c_dir = _run(tmp_path / "sdpo_seed1", "--config.mode=sdpo", "--config.seed=1",
                    f"--config.eval.reuse_from={tmp_path}")
    assert "eval_reused_from" not in c
    assert json.loads((c_dir / eval_reuse.KEY_FILE).read_text())["key"] != json.loads(
        (a_dir / eval_reuse.KEY_FILE).read_text())["key"]


@pytest.mark.slow
def test_what_is_taken_is_what_the_taker_computes(tmp_path):
    a, a_dir, b, b_dir = _two_cells(tmp_path / "grid")
    assert "eval_reused_from" in b
    own, own_dir = _run(tmp_path / "own", "--config.mode=pmd", "--config.seed=0")
    assert (own_dir / "results.jsonl").read_bytes() == (b_dir / "results.jsonl").read_bytes()
    assert own["accuracy"] == b["accuracy"]
