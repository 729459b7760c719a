"""The side-by-side benchmarks run end to end on CPU on a tiny shape (each side in its own
process, one RESULT line each), and their model shapes are the published ones. No timing is
asserted."""

from __future__ import annotations

import re
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
