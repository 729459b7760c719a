"""LoRA through the whole loop (issue 51): the real entry point on the tiny random Llama
(tests/tiny_runs.py) with ``--config.lora.enabled=True``.

A 2-step run writes the merged weights (final_hf) and a PEFT adapter folder (final_peft)
whose adapters, read back with ``lora.load_peft_adapter`` and merged into the run's base
(its random init, rebuilt in a child process: this session's -O0 code generation differs
from a run's in the last bit), are final_hf to the bit; its checkpoints hold the adapters
only. A run killed with SIGKILL after its first checkpoint and resumed ends bitwise equal to
a straight run (slow).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.loop.test_trainer import kill9_and_resume
from tests.tiny_runs import ROOT, env, final_params, run_once, train_records

LORA = ("--config.lora.enabled=True", "--config.lora.r=4", "--config.lora.alpha=16.0",
        "--config.lora.target_modules=['q_proj', 'v', 'o', 'gate', 'down']")

# The run's base (decoder.init_params of model.random_init with the run seed, as
# loop/build.py makes it), final_peft read back and merged into it, compared with final_hf.
_MERGE_CHECK = """
import json, sys
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file

from pmd_jax.models import decoder, lora
from pmd_jax.models.config import preset
from pmd_jax.models.hf_io import iter_hf_tensors

run = Path(sys.argv[1])
c = json.loads((run / "config.json").read_text())
mc = preset(c["model"]["random_init"]).replace(dtype=c["model"]["dtype"],
                                               param_dtype=c["model"]["param_dtype"])
base = decoder.init_params(mc, jax.random.PRNGKey(int(c["seed"])))
adapters, lc = lora.load_peft_adapter(run / "final_peft", mc)
merged = dict(iter_hf_tensors(lora.merge(base, adapters, mc, lc), mc))
hf = {}
for f in sorted((run / "final_hf").glob("*.safetensors")):
    hf.update(load_file(f))
changed = [k for k in hf if not np.array_equal(hf[k], np.asarray(merged[k]))]
moved = [k for k, v in iter_hf_tensors(base, mc) if not np.array_equal(hf[k], np.asarray(v))]
print(json.dumps({"lora": [lc.rank, lc.alpha, list(lc.targets)], "keys": sorted(hf) ==
                  sorted(merged), "differ": changed, "moved": sorted(moved)}))
"""


def _merge_check(run_dir: Path) -> dict:
    p = subprocess.run([sys.executable, "-c", _MERGE_CHECK, str(run_dir)], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_lora_run_exports_merged_weights_and_a_peft_folder(tmp_path_factory):
    run = run_once(tmp_path_factory, "lora", *LORA, "--config.train.steps=2")
    assert [r["step"] for r in train_records(run)] == [0, 1]
    conf = json.loads((run / "final_peft" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4 and conf["lora_alpha"] == 16.0
    assert conf["target_modules"] == ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    got = _merge_check(run)
    assert got["lora"] == [4, 16.0, ["q", "v", "o", "gate", "down"]] and got["keys"]
    assert got["differ"] == [], got["differ"]  # final_hf is merge(base, final_peft), bitwise
    # the targets moved away from the base, nothing else did
    assert got["moved"] and all(k.endswith(("q_proj.weight", "v_proj.weight", "o_proj.weight",
                                            "gate_proj.weight", "down_proj.weight"))
                                for k in got["moved"]), got["moved"]
    recs = train_records(run)
    assert recs[1]["kl_policy_initial"] > 1e-5  # measured against the base: it moved
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in recs)
    # the checkpoint holds the adapters' state only: far less than the weights
    ckpt = sum(p.stat().st_size for p in (run / "checkpoints").rglob("state/**/*")
               if p.is_file())
    weights = sum(v.nbytes for v in final_params(run).values())
    assert 0 < ckpt < weights / 4, (ckpt, weights)


@pytest.mark.slow
def test_lora_kill9_resume_is_bitwise_identical(tmp_path_factory, tmp_path: Path):
    """3 steps killed after checkpoint 1 and resumed (the base loaded again from the model's
    source, the adapters, their moments and the teacher's from the checkpoint): every metric,
    the merged weights and the PEFT adapters equal a straight run's to the bit."""
    ref = run_once(tmp_path_factory, "lora_straight", *LORA)
    log = kill9_and_resume(ref, tmp_path / "killed", *LORA)
    assert "LoRA:" in log
    from safetensors.numpy import load_file

    a = load_file(str(ref / "final_peft" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "final_peft" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
