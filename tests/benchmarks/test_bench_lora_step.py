"""benchmarks/bench_lora_step.py (issue 51, part 5): the variants differ only in the LoRA
knobs, the command line refuses what it cannot run, the table reads the step records, and
(slow) the three variants run the trainer end to end on a tiny SmolLM2 budget. No timing is
asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_lora_step as bls
from tests.tiny_runs import child_env

REPO = Path(__file__).resolve().parents[2]


def test_variants_differ_only_in_lora_knobs():
    args = bls.parse(["--r", "8", "--override", "rollout.max_tokens=16"])
    full, lora, lean = (bls.overrides(args, v) for v in bls.VARIANTS)
    assert full["mode"] == "sdpo" and full["rollout.max_tokens"] == "16"
    assert full["train.eval_every"] == -1 and full["eval.retention"] is False
    assert not any(k.startswith("lora.") for k in full)
    assert {k: v for k, v in lora.items() if k not in full} == {
        "lora.enabled": True, "lora.r": 8, "lora.alpha": 32.0,
        "lora.target_modules": "q,k,v,o,gate,up,down"}
    extra = {k: v for k, v in lean.items() if k not in lora}
    assert extra == {"lora.base_dtype": "bfloat16", **{k: False for k in bls.OFFLOAD_KNOBS}}


@pytest.mark.parametrize("argv, msg", [
    (["--variants", "full,qlora"], "--variants: unknown ['qlora']"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--override", "rollout.n"], "expected key=value"),
])
def test_bad_arguments_are_named(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        bls.parse(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_report_reads_each_step_and_the_ratios():
    def rec(step_s, rss):
        st = {f: 1.0 for f in bls.FIELDS} | {"time_step": step_s, "rss_metric_gib": rss}
        return {"steps": [st], "peak_rss_gib": rss + 0.5, "wall_s": 2 * step_s}

    out = "\n".join(bls.report({"full": rec(10.0, 17.5), "lora": rec(5.0, 5.5)}, 1))
    assert "step 0" in out
    ratio = next(line for line in out.splitlines() if line.startswith("step s / full"))
    assert ratio.split()[-2:] == ["1.00", "0.50"]
    rss = next(line for line in out.splitlines() if line.startswith("peak RSS / full"))
    assert rss.split()[-1] == f"{6.0 / 18.0:.2f}"


@pytest.mark.slow  # three trainer processes, ~3 min on 2 cores
def test_three_variants_run_the_trainer(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run(
        [sys.executable, "benchmarks/bench_lora_step.py", "--config", "configs/smollm2_sciq.py",
         "--steps", "2", "--r", "4", "--override", "rollout.max_tokens=8", "--override",
         "rollout.problems_per_step=2", "--override", "rollout.n=2", "--override",
         "task.max_train_problems=4", "--json", str(out)],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    assert sorted(res) == sorted(bls.VARIANTS)
    full, lora = res["full"]["steps"], res["lora"]["steps"]
    # step 0: B = 0, so the same rollouts and the same loss as full fine-tuning
    assert lora[0]["loss"] == full[0]["loss"]
    assert lora[0]["reward_mean"] == full[0]["reward_mean"]
    assert res["lora"]["peak_rss_gib"] < res["full"]["peak_rss_gib"]
    assert "peak RSS / full" in p.stdout
