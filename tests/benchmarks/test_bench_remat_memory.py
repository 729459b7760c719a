"""benchmarks/bench_remat_memory.py end to end on a tiny shape (XLA:CPU, one compile per
policy in its own process): a row per policy; saving more keeps more temp bytes than full
remat; on XLA:CPU an offloading policy's bytes are those of saving on the device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_remat_memory as brm
from tests.tiny_runs import child_env

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny-llama", "--layers", "0", "--batch", "2", "--student-len", "64",
        "--teacher-len", "96", "--response-len", "32", "--chunk", "32", "--dtype", "float32"]


def test_one_policy_in_process():
    """The child's compile of one policy (here in this process): XLA:CPU's figures."""
    r = brm.child(brm.parse([*TINY, "--child", "save_qkv_proj"]))
    assert r["policy"] == "save_qkv_proj" and r["device"].startswith("XLA:CPU")
    assert r["temp"] > 0 and r["argument"] > 0
    assert 0 < r["alias"] <= r["output"]  # the donated state: the new state reuses it


@pytest.mark.slow  # three compiles in three processes (~50 s on 2 cores)
def test_remat_memory_rows_on_cpu():
    p = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_remat_memory.py"), *TINY,
         "--policies", "full,save_qkv_proj,qkv_proj_offloaded", "--json"],
        env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["policy"]: r for r in (json.loads(ln) for ln in p.stdout.splitlines()
                                     if ln.startswith("{"))}
    assert set(rows) == {"full", "save_qkv_proj", "qkv_proj_offloaded"}, p.stdout
    assert "--compiler cpu" in p.stdout.splitlines()[0]  # the command that printed them
    assert rows["save_qkv_proj"]["temp"] > rows["full"]["temp"] > 0
    assert rows["full"]["host_temp"] == rows["save_qkv_proj"]["host_temp"] == 0
    # XLA:CPU places the "offloaded" tensors with the others (its host is its device): the
    # same bytes as saving them (an XLA:GPU compile shows them apart, docs/benchmarks.md)
    off = rows["qkv_proj_offloaded"]
    assert off["temp"] + off["host_temp"] == rows["save_qkv_proj"]["temp"]
    assert all(r["argument"] == rows["full"]["argument"] for r in rows.values())
