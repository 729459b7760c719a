"""The side-by-side benchmarks run end to end on CPU on a tiny shape (each side in its own
process, one RESULT line each), and their model shapes are the published ones. No timing is
asserted."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_common as bc
from tests.tiny_runs import child_env

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_model_shapes_match_hf():
    """Parameter counts: Llama-3-8B's published 8,030,261,248, and HF's own count of the
    model the torch side builds (on the meta device, nothing allocated)."""
    import torch

    assert bc.model_config("llama3-8b").num_params() == 8_030_261_248
    for name, layers in (("llama3-8b", 2), ("smollm2-135m", 0), ("tiny-llama", 0)):
        cfg = bc.model_config(name, layers)
        with torch.device("meta"):
            hf = bc.hf_llama(cfg, "meta")
        assert hf.num_parameters() == cfg.num_params(), name
    cut = bc.model_config("llama3-8b", layers=8, dtype="bfloat16")
    assert cut.num_layers == 8 and cut.dtype == "bfloat16" and cut.param_dtype == "float32"


def test_child_env_keeps_torch_off_the_gpu():
    assert bc.child_env("torch", "gpu")["JAX_PLATFORMS"] == "cpu"
    env = bc.child_env("jax", "gpu", "--xla_dump_to=/tmp/x")
    assert env["JAX_PLATFORMS"] == "cuda" and "--xla_dump_to=/tmp/x" in env["XLA_FLAGS"]
    assert bc.child_env("jax", "cpu")["JAX_PLATFORMS"] == "cpu"


def _run(script: str, *args: str) -> str:
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args],
                       env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_train_step_benchmark_on_cpu():
    out = _run("bench_train_step.py", "--device", "cpu", "--model", "tiny-llama",
               "--batch", "2", "--student-len", "32", "--teacher-len", "48",
               "--response-len", "16", "--chunk", "16", "--steps", "1", "--gemm-n", "256",
               "--attention-probe")
    assert "FAILED" not in out, out
    assert re.search(r"pmd_jax: [\d.]+ s/step, [\d.e+-]+ model TFLOP/s = \d+% of the", out), out
    assert re.search(r"torch\+HF: [\d.]+ s/step", out), out
    assert "attention (student): dense (auto on cpu" in out
    assert "attention probe" in out and "xla + padding mask" in out
    rel = float(re.search(r"rel\. diff ([\d.e+-]+)\)", out).group(1))
    assert rel < 1e-4, out  # same weights, same batch, same loss on both sides
    assert re.search(r"ratio: pmd_jax is [\d.]+x torch\+HF's speed", out), out


@pytest.mark.slow  # (the train-step benchmark's run above is CI's end-to-end check of the
# parent/child protocol they share, benchmarks/bench_common.py)
def test_sampler_benchmark_on_cpu():
    out = _run("bench_sampler.py", "--device", "cpu", "--model", "tiny-llama", "--batch", "2",
               "--prompt-len", "12", "--new-tokens", "4", "--gemm-n", "256")
    assert "FAILED" not in out, out
    assert re.search(r"JaxSampler \(float32\): +[\d.]+ new tokens/s", out), out
    assert re.search(r"HF generate \(float32\): +[\d.]+ new tokens/s", out), out
    assert "ratio JaxSampler[float32] / HF generate" in out


# ------------------------------------------------------------------------------ --ablate
def _bts():
    from benchmarks import bench_train_step as bts

    return bts


TINY = ["--device", "cpu", "--model", "tiny-llama", "--batch", "2", "--student-len", "32",
        "--teacher-len", "48", "--response-len", "16", "--chunk", "12", "--steps", "1",
        "--gemm-n", "256"]


def test_ablation_variants_and_their_children():
    """The run order (baseline first, torch + HF after it, each change off, the remat
    policies other than --remat), the child argv (parent-only options and, but for the
    baseline, the probes dropped; the variant's switch last) and the child environment (our
    XLA GPU flags unless that variant switches them off)."""
    bts = _bts()
    argv = [*TINY, "--ablate", "--out=x.json", "--budget", "99", "--attention-probe",
            "--ablate-remat", "full,dots_no_batch,save_qkv_proj"]
    args = bts.parse(argv)
    vs = bts.ablation_variants(args)
    assert [v.name for v in vs] == ["baseline", "torch", "topk", "attention", "lm_head",
                                    "xla_flags", "chunks", "remat:full", "remat:save_qkv_proj"]
    base = bts.child_argv(argv, vs[0])
    assert base == [*TINY, "--attention-probe"]
    flags = bts.launch_xla_flags()
    for v in vs[1:]:
        a = bts.child_argv(argv, v)
        assert a == [*TINY, *v.argv], v.name
        child = bts.parse(a)  # what the child sees: only its own change off
        assert (child.right_padded, child.top_k_impl, child.lm_head_fp32, child.pad_chunks,
                child.launch_xla_flags) == (
            v.name != "attention", "sort" if v.name == "topk" else "auto",
            v.name == "lm_head", v.name == "chunks", v.name != "xla_flags"), v.name
        cmd, env = bts.child_command(args, argv, v)
        assert cmd[1:4] == ["benchmarks/bench_train_step.py", "--child", v.side]
        has = all(f in env["XLA_FLAGS"].split() for f in flags)
        assert has == (v.side == "jax" and v.name != "xla_flags"), v.name
    assert bts.parse(bts.child_argv(argv, vs[-1])).remat == "save_qkv_proj"
    default = bts.ablation_variants(bts.parse(TINY))  # remat: the floor and the most
    assert [v.name for v in default[-2:]] == ["remat:none", "remat:full"]
    picked = bts.ablation_variants(bts.parse([*TINY, "--variants", "chunks,remat:full,torch",
                                              "--skip-torch"]))
    assert [v.name for v in picked] == ["baseline", "chunks", "remat:full"]
    for bad in ("nope", "remat:nope"):
        with pytest.raises(SystemExit):
            bts.ablation_variants(bts.parse([*TINY, "--variants", bad]))


def test_ablation_table():
    """Derived columns from made-up rows: the peak is the largest GEMM rate of the run; x torch
    is torch's s/step over the row's; a switched-off change costs its row's s/step minus the
    baseline's; a child not run keeps its row with its reason."""
    bts = _bts()

    def row(name, s, peak=100.0, loss=2.0, side="jax"):
        return {"variant": name, "label": name, "flips": "", "side": side, "status": "ok",
                "s_per_step": s, "gemm_peak_tflops": peak, "first_loss": loss,
                "peak_mem_gib": 10.0, "first_step_s": 30.0}

    rows = [row("baseline", 1.0), row("torch", 0.5, peak=200.0, loss=2.002, side="torch"),
            row("topk", 1.25), {"variant": "chunks", "label": "chunks", "flips": "",
                                "side": "jax", "status": "not run: budget"}]
    table, peak = bts.table_rows(rows, flops=50e12)
    assert peak == 200.0
    b, t, k, c = table
    assert b["tflops"] == 50.0 and b["pct_peak"] == 0.25 and b["vs_torch"] == 0.5
    assert b["off_cost_s"] is None and b["loss_rel"] is None
    assert t["vs_torch"] == 1.0 and t["off_cost_s"] is None
    assert abs(t["loss_rel"] - 1e-3) < 1e-12
    assert k["off_cost_s"] == 0.25 and k["vs_torch"] == 0.4 and k["loss_rel"] == 0.0
    assert "tflops" not in c
    lines = bts.format_table(table).splitlines()
    assert lines[0].split()[:3] == ["variant", "s/step", "TFLOP/s"]
    assert lines[3].split() == ["topk", "1.250", "40", "20%", "10.00", "0.40x", "+0.250",
                                "(+25%)", "0.0e+00", "30.0"]
    assert lines[4].split() == ["chunks", "not", "run:", "budget"]


def test_ablate_dry_prints_every_child(capsys):
    bts = _bts()
    argv = [*TINY, "--ablate", "--dry", "--variants", "xla_flags,chunks"]
    assert bts.ablate(bts.parse(argv), argv) == {}
    cmds = [shlex.split(ln) for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("env ")]
    assert [c[c.index("--child") + 1] for c in cmds] == ["jax", "jax", "jax"]
    assert cmds[1][-1] == "--no-launch-xla-flags"
    assert not any("--xla_gpu" in a for a in cmds[1])  # (the environment's XLA_FLAGS only)
    assert cmds[2][-1] == "--pad-chunks"
    assert any(a.startswith("XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true")
               for a in cmds[2])


def test_launch_xla_gpu_flags_exist_in_this_jaxlib(monkeypatch):
    """XLA aborts on a flag it does not know, and XLA:CPU parses the GPU flags too: a jaxlib
    that drops one of launch/xla_gpu_flags.sh's flags fails here, not on a GPU host; there the
    benchmark drops it (and says so) instead of losing every child."""
    bts = _bts()
    flags = bts.launch_xla_flags()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags and len(flags) >= 3
    assert bts.xla_accepts(flags)
    bogus = "--xla_gpu_no_such_flag=true"
    monkeypatch.setattr(bts, "launch_xla_flags", lambda: [flags[0], bogus])
    monkeypatch.setattr(bts, "_USABLE", {})
    assert bts.usable_launch_flags() == ([flags[0]], [bogus])


@pytest.mark.slow  # 9 children, ~15 s each on 2 cores
def test_train_step_ablation_on_cpu(tmp_path):
    """--ablate end to end at tiny shapes (bf16, so the LM-head switch changes the program):
    every child measured, each its own change off (read back from what the child reports),
    the same first-step loss within bf16 rounding, the table printed and written as JSON."""
    out = tmp_path / "ablate.json"
    text = _run("bench_train_step.py", *TINY, "--dtype", "bfloat16", "--ablate",
                "--out", str(out))
    assert "FAILED" not in text and "not run" not in text, text
    doc = json.loads(out.read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert list(rows) == ["baseline", "torch", "topk", "attention", "lm_head", "xla_flags",
                          "chunks", "remat:none", "remat:full"]
    assert all(r["status"] == "ok" for r in rows.values())
    k = {n: r["knobs"] for n, r in rows.items() if n != "torch"}
    assert k["baseline"]["loss_chunks"] == "2 x 8" and k["chunks"]["loss_chunks"].startswith(
        "2 x 12 (24 rows")
    assert k["baseline"]["lm_head_gemms"] == "compute dtype"
    assert k["lm_head"]["lm_head_gemms"].startswith("fp32")
    assert k["topk"]["top_k_impl"] == "sort" and k["attention"]["right_padded"] is False
    assert "--xla_gpu" in k["baseline"]["xla_flags"] and not k["xla_flags"]["xla_flags"]
    assert k["remat:none"]["remat"] == "none" and k["remat:full"]["remat"] == "full"
    for n, r in rows.items():
        assert r["loss_rel"] is None or r["loss_rel"] < 0.05, (n, r["loss_rel"])
        assert r["pct_peak"] > 0 and r["peak_mem_gib"] > 0
    table = text[text.index("variant  "):]
    assert re.search(r"all on \(baseline\) +[\d.]+ +[\d.e+-]+ +\d+% +[\d.]+ +[\d.]+x", table)
    assert re.search(r"part 3 off: padded chunks +[\d.]+ .* [+-][\d.]+ \([+-]\d+%\)", table)
