"""Forgetting (eval.retention) and the training-free mode (memory_only).

Unit: the retention set's task defaults, its disjointness from the run's training and
evaluation questions (real SciQ and MMLU files), its seeded draw, and the config errors.
End to end (the real entry point, tiny random Llama, real SciQ and MMLU data): a
``mode=memory_only`` run of 2 steps evaluates with and without the memory and on the retention
set, its memory grows, and its exported weights are bitwise those of a 0-step run (the initial
weights); the plot of accuracy against KL to the initial policy is written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pmd_jax.config import apply_mode, base_config, config_errors, freeze
from pmd_jax.config.modes import set_dotted
from pmd_jax.loop import retention as ret
from pmd_jax.run.metrics import eval_kl_points
from pmd_jax.tasks import get_task
from tests.tiny_runs import ROOT
from tests.tiny_runs import cmd as _cmd
from tests.tiny_runs import env as _env
from tests.tiny_runs import final_params as _final_params


@pytest.fixture(scope="module")
def sciq():
    return get_task("sciq")


def _cfg(**over):
    c = base_config()
    for k, v in over.items():
        set_dotted(c, k, v)
    return freeze(apply_mode(c))


def test_default_retention_task_is_off_task():
    assert ret.retention_task_name(_cfg(**{"task.name": "sciq"})) == "mmlu_science"
    assert ret.retention_task_name(_cfg(**{"task.name": "mbpp"})) == "sciq"
    assert ret.retention_task_name(_cfg(**{"task.name": "mmlu_science"})) == "sciq"
    assert ret.retention_task_name(_cfg(**{"task.name": "gsm8k"})) == "mmlu_science"
    assert ret.retention_task_name(_cfg(**{"eval.retention_task": "gsm8k"})) == "gsm8k"


def test_a_task_declares_its_retention_set(monkeypatch):
    """The default comes from the task's spec (TaskSpec.retention_task), not its name."""
    import dataclasses

    from pmd_jax.tasks import registry

    spec = dataclasses.replace(registry.get_spec("gsm8k"), retention_task="sciq")
    monkeypatch.setitem(registry._REGISTRY, "gsm8k", spec)
    assert ret.retention_task_name(_cfg(**{"task.name": "gsm8k"})) == "sciq"


def test_retention_set_shares_no_question_with_the_run(sciq):
    keys = ret.question_key
    run = [*sciq.problems("train"), *sciq.problems("validation")]
    task, probs = ret.retention_set(_cfg(**{"task.name": "sciq"}), run)
    assert task.name == "mmlu_science" and len(probs) == 200
    assert len({p.id for p in probs}) == 200
    assert not {keys(p.question) for p in probs} & {keys(p.question) for p in run}
    # drawn from the run's own task, it keeps out the excluded questions
    train = sciq.problems("train")
    drawn = ret.draw_retention_problems(sciq, train, 50, seed=0)
    assert not {keys(p.question) for p in drawn} & {keys(p.question) for p in train}
    val_ids = {p.id for p in sciq.problems("validation")}
    assert {p.id for p in drawn} <= val_ids
    # SciQ has no question left once training and evaluation are excluded
    with pytest.raises(ret.RetentionError, match="eval.retention_size=1 .* has only 0"):
        ret.draw_retention_problems(sciq, run, 1, seed=0)


def test_retention_draw_is_seeded_and_order_free(sciq):
    a = [p.id for p in ret.draw_retention_problems(sciq, [], 30, seed=0)]
    b = [p.id for p in ret.draw_retention_problems(sciq, [], 30, seed=0)]
    c = [p.id for p in ret.draw_retention_problems(sciq, [], 30, seed=1)]
    assert a == b and set(a) != set(c)

    class Reversed:
        name = "sciq"
        splits = sciq.splits

        def problems(self, split):
            return list(reversed(sciq.problems(split)))

    assert [p.id for p in ret.draw_retention_problems(Reversed(), [], 30, seed=0)] == a


@pytest.mark.parametrize("key,value,message", [
    ("retention_task", "nope", "eval.retention_task='nope' must be"),
    ("retention_task", "jsonl_mcq", "reads a user file"),
    ("retention_size", 0, "eval.retention_size must be an int >= 1"),
    ("retention_prompt_style", "chatty", "eval.retention_prompt_style='chatty' must be"),
])
def test_bad_retention_knobs_name_the_knob(key, value, message):
    c = base_config()
    c.eval.retention = True
    c.eval[key] = value
    errs = config_errors(apply_mode(c))
    assert any(message in e for e in errs), errs


def test_a_style_the_retention_task_lacks_is_refused():
    c = base_config()
    c.eval.retention = True
    c.eval.retention_task = "gsm8k"
    c.eval.retention_prompt_style = "direct_text"  # GSM8K has reasoning and direct only
    errs = config_errors(apply_mode(c))
    assert any("'direct_text' is not a style of eval.retention_task='gsm8k'" in e
               for e in errs), errs


def test_retention_set_is_asked_in_the_runs_prompt_style():
    """The embedded default (SciQ, direct_text: the model writes an option's text after an
    opened answer tag) gets its MMLU retention set in the same style; in MMLU's default style
    (letters after reasoning) its 135M model scored 0 of 200 at every step of a grid cell."""
    from pmd_jax.config.cli import load_config_file
    from pmd_jax.loop.teaching import response_prefix

    default = freeze(apply_mode(load_config_file(str(ROOT / "configs" / "smollm2_sciq.py"))))
    assert ret.retention_prompt_style(default) == "direct_text"
    task, probs = ret.retention_set(default, get_task("sciq").problems("validation"))
    assert task.name == "mmlu_science" and task.prompt_style == "direct_text"
    assert all(response_prefix(task, p) == "<answer>" for p in probs)
    # a style the retention task does not take is left to its loader's default ...
    mbpp = _cfg(**{"task.name": "mbpp", "task.prompt_style": "direct_text"})
    assert ret.retention_task_name(mbpp) == "sciq"
    assert ret.retention_prompt_style(mbpp) == "direct_text"  # SciQ has it
    gsm = _cfg(**{"task.name": "gsm8k", "task.prompt_style": "direct",
                  "eval.retention_task": "humaneval"})
    assert ret.retention_prompt_style(gsm) == ""  # HumanEval takes no prompt style
    # ... and an explicit style wins over the run's
    over = _cfg(**{"task.prompt_style": "direct_text", "eval.retention_prompt_style": "direct"})
    assert ret.retention_prompt_style(over) == "direct"
    assert ret.retention_set(over, [])[0].prompt_style == "direct"


def test_eval_kl_points_pair_each_evaluation_with_its_policy():
    recs = [{"kind": "eval", "step": 0, "accuracy": 0.3},
            *({"kind": "train", "step": s, "kl_policy_initial": 0.1 * s} for s in range(4)),
            {"kind": "eval", "step": 2, "accuracy": 0.4, "retention_accuracy": 0.5},
            {"kind": "eval", "step": 4, "accuracy": 0.6},  # after the last step: no KL
            {"kind": "eval", "step": 4, "accuracy": 0.6, "kl_policy_initial": 0.9}]
    got = eval_kl_points(recs)
    assert [(p["step"], p["kl"], p["retention_accuracy"]) for p in got] == [
        (0, 0.0, None), (2, 0.2, 0.5), (4, 0.9, None)]


# ----------------------------------------------------------------------------- end to end
_INITIAL_EXPORT = """
import json, sys
from pathlib import Path

import jax

from pmd_jax.models import decoder
from pmd_jax.models.config import preset
from pmd_jax.models.hf_io import save_hf_checkpoint

run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
c = json.loads((run_dir / "config.json").read_text())
mc = preset(c["model"]["random_init"]).replace(dtype=c["model"]["dtype"],
                                               param_dtype=c["model"]["param_dtype"])
params = decoder.init_params(mc, jax.random.PRNGKey(int(c["seed"])))
save_hf_checkpoint(params, mc, out,
                   dtype="float32" if mc.param_dtype == "float32" else "bfloat16")
"""


def _initial_export(run_dir: Path, out: Path) -> dict[str, np.ndarray]:
    """The HF tensors of the run's initial weights: its random init (model.random_init, the
    run seed), built as pmd_jax.loop.build does and written by the same exporter. Built in a
    subprocess with the run's environment: this test session compiles at -O0
    (tiny_runs.codegen_flags), whose random-normal init differs from a run's in the last bit."""
    p = subprocess.run([sys.executable, "-c", _INITIAL_EXPORT, str(run_dir), str(out)], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    from safetensors.numpy import load_file

    got: dict[str, np.ndarray] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    return got


def test_memory_only_keeps_the_weights_and_reports_retention(tmp_path: Path):
    """2 steps of mode=memory_only (reflections as free text and no behavior extraction, to
    keep the run small), a final evaluation with and without the memory, and 2 retention
    questions."""
    run = tmp_path / "memory_only"
    p = subprocess.run(_cmd(run, "--config.mode=memory_only", "--config.train.steps=2",
                            "--config.train.eval_every=0", "--config.eval.retention=True",
                            "--config.eval.retention_size=2",
                            "--config.memory.structured_output=False",
                            "--config.memory.behavior.every_n_steps=100"),
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    # no AdamW moments or teacher copy held (or checkpointed), no initial policy kept
    assert "optimizer 0.00, teacher 0.00" in p.stderr, p.stderr[-4000:]
    assert "initial policy dropped (the mode never changes the weights" in p.stderr
    # the weights never changed: the export is bitwise the initial one
    a, b = _initial_export(run, tmp_path / "initial"), _final_params(run)
    assert a and a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert json.loads((run / "config.json").read_text())["mode"] == "pmd_frozen_policy"
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == [0, 1]
    assert train[-1]["memory_experiences"] == 8  # the memory evolved: 2 steps x 2 x 2
    # no update, so no loss: the progress line shows none (it showed loss=nan)
    steps = [ln for ln in p.stderr.splitlines() if "train 2/2" in ln]
    assert steps and "reward=" in steps[-1] and "loss" not in steps[-1], steps
    (ev,) = [r for r in recs if r["kind"] == "eval"]
    assert ev["step"] == 2 and "accuracy_with_memory" in ev
    assert ev["retention_task"] == "mmlu_science" and ev["retention_num_problems"] == 2
    assert ev["retention_accuracy_ci_low"] <= ev["retention_accuracy"] \
        <= ev["retention_accuracy_ci_high"]
    rows = [json.loads(x) for x in
            (run / "eval" / "step_000002" / "retention.jsonl").read_text().splitlines()]
    assert len({r["problem_id"] for r in rows}) == 2
    assert all(r["problem_id"].startswith("mmlu/") for r in rows)
    assert (run / "plots" / "retention_accuracy.png").exists()
