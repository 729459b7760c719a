"""Bring your own data: jsonl_mcq / jsonl_code / jsonl_math on the small files of tests/data.

Expected golds are written out by hand from the data files (not computed by the loader);
code answers run in the real sandbox; malformed rows are checked line by line against the
line and field we broke in tests/data/byo_bad_*.jsonl; the command line exits 2 before any
compute on a bad file.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pmd_jax.config import _task_errors as _run_task_errors
from pmd_jax.config import base_config, freeze
from pmd_jax.tasks import TaskError, get_task
from pmd_jax.tasks.jsonl_schema import file_errors, parse_file
from pmd_jax.tasks.mcq import (
    LETTERS,
    SKE_DOMAINS,
    SKE_TYPES,
    load_sciknoweval,
    sciknoweval_filters,
)
from tests.tiny_runs import child_env

ROOT = Path(__file__).parents[2]
DATA = ROOT / "tests" / "data"
MCQ, CODE, MATH = (str(DATA / f"byo_{k}.jsonl") for k in ("mcq", "code", "math"))
BAD = {k: str(DATA / f"byo_bad_{k}.jsonl") for k in ("mcq", "code", "math")}

# The right option of each row of byo_mcq.jsonl (ids: the row's "id", else "byo_mcq/<line>").
MCQ_GOLD = {
    "photosynthesis": "carbon dioxide",
    "water-boil": "100 degrees Celsius",  # "B"
    "7": "Na",  # index 2
    "byo_mcq/4": "Mercury",
    "byo_mcq/5": "nucleus",  # "A"
    "sound-vacuum": "no",  # index 1
    "electron-charge": "negative",
    "ph-neutral": "7",  # options given as numbers
    "largest-organ": "skin",
    "speed-light": "vacuum",  # "C"
    "mitochondria": "mitochondrion",
    "gravity-moon": "weaker",  # index 2
}


# ----------------------------------------------------------------------------- multiple choice


def test_mcq_loads_every_row_with_its_gold():
    t = get_task("jsonl_mcq", path=MCQ)
    probs = t.problems("all")
    assert {p.id: p.meta["gold_text"] for p in probs} == MCQ_GOLD
    for p in probs:  # the gold letter points at the gold text after the shuffle
        assert p.meta["options"][LETTERS.index(p.gold)] == MCQ_GOLD[p.id]
    by_id = {p.id: p for p in probs}
    assert sorted(by_id["ph-neutral"].meta["options"]) == ["1", "10", "14", "7"]
    assert by_id["byo_mcq/5"].meta["row_meta"] == {"topic": "biology"}
    assert by_id["byo_mcq/4"].meta["line"] == 4 and by_id["sound-vacuum"].meta["line"] == 7


def test_mcq_prompt_and_verify_reasoning_style():
    t = get_task("jsonl_mcq", path=MCQ)
    p = next(p for p in t.problems("all") if p.id == "water-boil")
    msgs = t.prompt(p)
    assert "three options" in msgs[0]["content"] and "(A, B, or C)" in msgs[0]["content"]
    user = msgs[1]["content"]
    assert user.startswith("At sea level, water boils at which temperature?")
    for letter, opt in zip(LETTERS, p.meta["options"], strict=False):
        assert f"{letter}: {opt}" in user
    right = LETTERS[p.meta["options"].index("100 degrees Celsius")]
    wrong = LETTERS[p.meta["options"].index("50 degrees Celsius")]
    ok = t.verify(p, f"<reasoning>Water boils at 100.</reasoning>\n<answer>\n{right}\n</answer>")
    assert ok.reward == 1.0 and ok.reason == "correct"
    bad = t.verify(p, f"<reasoning>Hm.</reasoning>\n<answer>{wrong}</answer>")
    assert bad.reward == 0.0 and bad.reason == "wrong_answer" and "50 degrees" in bad.feedback


def test_mcq_direct_text_style_and_passage():
    t = get_task("jsonl_mcq", path=MCQ, prompt_style="direct_text", include_support=True)
    by_id = {p.id: p for p in t.problems("all")}
    p = by_id["photosynthesis"]
    user = t.prompt(p)[1]["content"]
    assert user.startswith("Passage: Plants make sugar from carbon dioxide and water")
    assert "Question: Which gas do plants take in" in user
    assert "Passage:" not in t.prompt(by_id["electron-charge"])[1]["content"]
    assert t.response_prefix(p) == "<answer>"
    assert t.verify(p, "<answer>Carbon dioxide.</answer>").reward == 1.0
    r = t.verify(p, "<answer>oxygen</answer>")
    assert r.reward == 0.0 and r.reason == "wrong_answer"
    plain = get_task("jsonl_mcq", path=MCQ)  # the passage only with include_support
    assert "Passage:" not in plain.prompt(plain.problems("all")[0])[1]["content"]


def test_mcq_option_order_seeded_or_kept():
    a = get_task("jsonl_mcq", path=MCQ, seed=3).problems("all")
    b = get_task("jsonl_mcq", path=MCQ, seed=3).problems("all")
    assert [p.meta["options"] for p in a] == [p.meta["options"] for p in b]
    kept = {p.id: p for p in get_task("jsonl_mcq", path=MCQ, shuffle=False).problems("all")}
    assert kept["photosynthesis"].meta["options"] == ["oxygen", "carbon dioxide", "nitrogen",
                                                      "helium"]
    assert kept["photosynthesis"].gold == "B" and kept["7"].gold == "C"
    assert kept["ph-neutral"].meta["options"] == ["1", "7", "14", "10"]


# ----------------------------------------------------------------------------- splits


def _split(kind: str, path: str, **kw) -> tuple[list[str], list[str], list[str]]:
    t = get_task(kind, path=path, **kw)
    return tuple([p.id for p in t.problems(s)] for s in ("train", "validation", "all"))


@pytest.mark.parametrize("kind,path", [("jsonl_mcq", MCQ), ("jsonl_code", CODE),
                                       ("jsonl_math", MATH)])
def test_split_disjoint_seeded_and_order_free(kind, path, tmp_path):
    n = sum(1 for x in Path(path).read_text().splitlines() if x.strip())
    for kw in ({}, {"valid_size": 3}, {"valid_fraction": 0.5, "split_seed": 7}):
        train, val, every = _split(kind, path, **kw)
        assert not set(train) & set(val) and sorted(train + val) == sorted(every)
        assert len(every) == n
        want = kw.get("valid_size") or max(1, round(n * kw.get("valid_fraction", 0.1)))
        assert len(val) == want
        assert _split(kind, path, **kw) == (train, val, every)  # same seed, same split
    # The split does not depend on the row order: the file reversed (ids kept explicit).
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    for i, r in enumerate(rows):
        r.setdefault("id", f"row{i}")
    fwd, rev = tmp_path / "fwd.jsonl", tmp_path / "rev.jsonl"
    fwd.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rev.write_text("".join(json.dumps(r) + "\n" for r in reversed(rows)))
    a, b = _split(kind, str(fwd), valid_size=3), _split(kind, str(rev), valid_size=3)
    assert set(a[1]) == set(b[1]) and set(a[0]) == set(b[0])
    # Other seeds hold out other problems.
    held = {frozenset(_split(kind, path, valid_size=2, split_seed=s)[1]) for s in range(6)}
    assert len(held) > 1


def test_split_that_leaves_nothing_to_train_on():
    with pytest.raises(TaskError, match="leaves none to train on"):
        get_task("jsonl_math", path=MATH, valid_size=10)
    with pytest.raises(TaskError, match=r"valid_fraction=1\.0 must be in \(0, 1\)"):
        get_task("jsonl_math", path=MATH, valid_fraction=1.0)
    assert "leaves none to train on" in file_errors("jsonl_mcq", MCQ, valid_size=12)[0]


# ----------------------------------------------------------------------------- code


def fence(code: str) -> str:
    return f"Here is my program.\n```python\n{code}\n```\n"


# A right and a wrong program per test style, run in the real sandbox.
PROGRAMS = {
    "add": ("def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b"),
    "sum-stdin": ("a, b = map(int, input().split())\nprint(a + b)",
                  "a, b = map(int, input().split())\nprint(a * b)"),
    "is-even": ("def is_even(n):\n    return n % 2 == 0", "def is_even(n):\n    return n % 2"),
}


@pytest.fixture(scope="module")
def code_task():
    t = get_task("jsonl_code", path=CODE)
    yield t
    t.close()


def test_code_rows_become_tests(code_task):
    by_id = {p.id: p for p in code_task.problems("all")}
    assert len(by_id) == 6
    add = by_id["add"].gold
    assert add["kind"] == "call" and add["fn_name"] == "add"
    assert add["inputs"][:2] == ["1\n2", "-5\n5"] and add["inputs"][2] == {"a": 10, "b": 0.5}
    assert [json.loads(o) for o in add["outputs"]] == [3, 0, 10.5]
    s = by_id["sum-stdin"].gold
    assert s["kind"] == "stdin" and s["inputs"] == ["1 2\n", "-4 10\n"]
    e = by_id["is-even"].gold
    assert e["kind"] == "code" and len(e["inputs"]) == 3 and e["outputs"] == ["", "", ""]
    assert by_id["count-lines"].gold["time_limit"] == 3.0
    msg = code_task.prompt(by_id["sum-stdin"])[0]["content"]
    assert "Read two integers separated by a space" in msg and "```" in msg
    # train uses every test: the problems are held out, not the tests
    assert code_task.test_indices(by_id["add"], "train") == [0, 1, 2]


def test_code_entry_point_named_in_prompt(tmp_path):
    f = tmp_path / "c.jsonl"
    rows = [{"prompt": "Return the square of x.", "entry_point": "square", "test_style": "call",
             "tests": [{"args": [3], "expected": 9}]},
            {"prompt": "Write square(x).", "entry_point": "square", "test_style": "call",
             "tests": [{"args": [3], "expected": 9}]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    probs = get_task("jsonl_code", path=str(f), valid_size=1).problems("all")
    assert probs[0].question.endswith("The function should be called `square`.")
    assert probs[1].question == "Write square(x)."


@pytest.mark.parametrize("pid", sorted(PROGRAMS))
def test_code_right_and_wrong_program_in_the_sandbox(code_task, pid):
    p = next(p for p in code_task.problems("all") if p.id == pid)
    right, wrong = PROGRAMS[pid]
    ok = code_task.verify(p, fence(right), "validation")
    assert ok.reward == 1.0 and ok.reason == "correct", ok
    assert ok.details["passed"] == ok.details["total"] == len(p.gold["inputs"])
    bad = code_task.verify(p, fence(wrong), "validation")
    assert bad.reward == 0.0 and bad.reason == "wrong_answer", bad
    assert bad.feedback.startswith("Test Case") and "Wrong Answer" in bad.feedback
    assert code_task.verify(p, "no code here").reason == "no_code_block"


# ----------------------------------------------------------------------------- math


def test_math_golds_prompts_and_verify():
    t = get_task("jsonl_math", path=MATH)
    by_id = {p.id: p for p in t.problems("all")}
    assert len(by_id) == 10 and "byo_math/10" in by_id
    cases = {  # id: (a right response, a wrong one)
        "eggs": ("3 boxes of 12 is 36.\nThe answer is 36.", "The answer is 35."),
        "half": ("Half of 1.5 is 3/4.\nThe answer is 3/4.", "The answer is 0.7."),
        "price": ("8 + 3 = 11. The answer is $11.", "The answer is 10.5"),
        "thousands": ("The answer is 1200", "The answer is 120"),
        "fraction": ("The answer is 0.75", "The answer is 1/3"),
        "negative": ("3 - 10 = -7\nThe answer is -7.", "The answer is 7."),
        "tenth": ("The answer is 1/10", "The answer is 0.01"),
        "byo_math/10": ("2.5 * 60 = 150\nThe answer is 150.", "The answer is 120."),
        "sqrt8": ("sqrt(8) = sqrt(4 * 2), so \\boxed{2\\sqrt{2}}", "\\boxed{2\\sqrt{4}}"),
        "capital": ("All sides equal.\nThe answer is Equilateral.", "The answer is isosceles."),
    }
    for pid, (right, wrong) in cases.items():
        p = by_id[pid]
        ok, bad = t.verify(p, right), t.verify(p, wrong)
        assert ok.reward == 1.0 and ok.reason == "correct", (pid, ok)
        assert bad.reward == 0.0 and bad.reason == "wrong_answer", (pid, bad)
    assert t.verify(by_id["capital"], "I am not sure.").reason == "no_answer"
    numeric, text = t.prompt(by_id["eggs"]), t.prompt(by_id["capital"])
    assert numeric[1]["content"] == "A box holds 12 eggs. How many eggs are in 3 boxes?"
    assert "number" in numeric[0]["content"] and "number" not in text[0]["content"]
    assert "The answer is <answer>" in text[0]["content"]
    direct = get_task("jsonl_math", path=MATH, prompt_style="direct")
    p = next(p for p in direct.problems("all") if p.id == "capital")
    assert direct.response_prefix(p) == "The answer is "
    assert direct.verify(p, direct.response_prefix(p) + "equilateral").reward == 1.0


# ----------------------------------------------------------------------------- malformed rows

# (line, field) of each broken row of tests/data/byo_bad_*.jsonl; None = the whole row.
BAD_ROWS = {
    "mcq": [(2, None), (3, "question"), (4, "options"), (5, "answer"), (6, "answer"),
            (7, "answer"), (8, "options[1]"), (9, "pasage"), (10, "options[0]"), (11, "id"),
            (12, None), (13, "answer")],
    "code": [(2, "tests"), (3, "tests"), (4, "test_style"), (5, "entry_point"),
             (6, "tests[0].output"), (7, "tests[1]"), (8, "tests[0]"), (9, "tests[0].args"),
             (10, "time_limit"), (11, "prompt")],
    "math": [(2, "answer"), (3, "answer"), (4, "question"), (5, "answer"), (6, None)],
}


@pytest.mark.parametrize("kind", sorted(BAD_ROWS))
def test_every_malformed_row_is_named_by_line_and_field(kind):
    path = BAD[kind]
    rows, errors = parse_file(f"jsonl_{kind}", path)
    assert [r[1] for r in rows] == [1]  # only the first row is well formed
    assert len(errors) == len(BAD_ROWS[kind]), errors
    for err, (line, field) in zip(errors, BAD_ROWS[kind], strict=True):
        where = f"{path} line {line}, " + (f"field {field!r}" if field else "the whole row")
        assert err.startswith(where + ": "), (err, where)
    with pytest.raises(TaskError) as e:
        get_task(f"jsonl_{kind}", path=path)
    for line, _ in BAD_ROWS[kind]:
        assert f" line {line}, " in str(e.value)


def test_specific_messages():
    errs = parse_file("jsonl_mcq", BAD["mcq"])[1]
    assert "'blue' is not among the options ['red', 'green']" in errs[3]
    assert "did you mean 'passage'?" in errs[7]
    assert "give the 0-based index" in errs[11]
    errs = parse_file("jsonl_code", BAD["code"])[1]
    assert "is empty" in errs[1] and "unknown test style 'pytest'" in errs[2]
    assert "not valid Python" in errs[6]
    with pytest.raises(TaskError, match="JSONL file not found"):
        get_task("jsonl_math", path=str(DATA / "nope.jsonl"))
    with pytest.raises(TaskError, match="needs path"):
        get_task("jsonl_code")


def test_empty_file_and_too_many_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert file_errors("jsonl_math", empty) == [f"{empty}: no rows (the file is empty)"]
    many = tmp_path / "many.jsonl"
    many.write_text("".join('{"question": "q"}\n' for _ in range(30)))
    errs = file_errors("jsonl_math", many)
    assert len(errs) == 21 and errs[-1] == "... and 10 more malformed rows"


# ----------------------------------------------------------------------------- config


def _task_errors(c) -> list[str]:
    return _run_task_errors(freeze(c))


def _cfg(**task):
    c = base_config()
    for k, v in task.items():
        setattr(c.task, k, v)
    return c


def test_config_validation_reads_the_file():
    assert _task_errors(_cfg(name="jsonl_mcq", path=MCQ)) == []
    assert _task_errors(_cfg(name="jsonl_code", path=CODE, valid_size=2)) == []
    assert _task_errors(_cfg(name="jsonl_math", path=MATH, prompt_style="direct")) == []
    errs = _task_errors(_cfg(name="jsonl_mcq", path=BAD["mcq"]))
    assert len(errs) == 12 and all(e.startswith("task.path: ") for e in errs)
    assert f"{BAD['mcq']} line 5, field 'answer'" in errs[3]
    assert _task_errors(_cfg(name="jsonl_code")) == [
        "task.name='jsonl_code' needs task.path (a JSONL file)"]
    errs = _task_errors(_cfg(name="jsonl_math", path=MATH, valid_size=10))
    assert len(errs) == 1 and "leaves none to train on" in errs[0]
    errs = _task_errors(_cfg(name="jsonl_math", path=MATH, prompt_style="direct_text"))
    assert errs == ["task.prompt_style='direct_text' is not one of ('reasoning', 'direct') "
                    "(the styles of task 'jsonl_math')"]
    assert _task_errors(_cfg(name="jsonl_mcq", path=MCQ, include_support=True)) == []
    assert "include_support" in _task_errors(_cfg(name="jsonl_math", path=MATH,
                                                  include_support=True))[0]


def test_command_line_bad_file_exits_2_naming_line_and_field(tmp_path):
    env = child_env()
    args = ["--config=configs/smollm2_sciq.py", "--config.task.name=jsonl_mcq",
            f"--config.task.path={BAD['mcq']}", f"--config.run_dir={tmp_path}/run"]
    prog = f"import sys; from pmd_jax import main; sys.argv = sys.argv[:1] + {args!r}; main.run()"
    p = subprocess.run([sys.executable, "-c", prog], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    assert p.stderr.startswith("invalid config (12 problems):"), p.stderr
    assert f"{BAD['mcq']} line 5, field 'answer': 'blue' is not among the options" in p.stderr
    assert f"{BAD['mcq']} line 9, field 'pasage'" in p.stderr


# ----------------------------------------------------------------------------- SciKnowEval


def test_sciknoweval_filter_defaults_are_the_loaders():
    c = base_config()
    kw, errs = sciknoweval_filters(c.task.sciknoweval_domain, c.task.sciknoweval_level,
                                   c.task.sciknoweval_type)
    sig = inspect.signature(load_sciknoweval).parameters
    assert errs == [] and kw == {k: tuple(sig[k].default) for k in ("domains", "levels", "types")}
    assert kw["domains"] == SKE_DOMAINS and kw["types"] == SKE_TYPES
    _, errs = sciknoweval_filters("Biology,biology", "L3,L9", "")
    assert errs == [
        "task.sciknoweval_domain: unknown domain 'biology'; known: Biology, Chemistry, "
        "Material, Physics (comma-separated, '' = all)",
        "task.sciknoweval_level: unknown level 'L9'; known: L1, L2, L3, L4, L5 "
        "(comma-separated, '' = all)"]


def test_sciknoweval_filters_reach_the_loader(tmp_path):
    from pmd_jax.loop.build import build_task

    def row(i, domain, level, typ):
        return {"question": f"q{i}?", "choices": {"text": ["x", "y"], "label": ["A", "B"]},
                "answerKey": "A", "domain": domain, "type": typ, "details": {"level": level}}

    rows = [row(i, d, lv, "mcq-2-choices") for i, (d, lv) in enumerate(
        [(d, lv) for d in ("Biology", "Physics") for lv in ("L2", "L3")] * 5)]
    f = tmp_path / "ske.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = _cfg(name="sciknoweval", path=str(f))
    got = build_task(freeze(c)).problems("train") + build_task(freeze(c)).problems("validation")
    assert {(p.meta["domain"], p.meta["level"]) for p in got} == {("Biology", "L3"),
                                                                  ("Physics", "L3")}
    c.task.sciknoweval_level, c.task.sciknoweval_domain = "L2", "Physics"
    t = build_task(freeze(c))
    got = t.problems("train") + t.problems("validation")
    assert len(got) == 5 and {(p.meta["domain"], p.meta["level"]) for p in got} == {
        ("Physics", "L2")}
    c.task.sciknoweval_level = "L7"
    assert "unknown level 'L7'" in _task_errors(c)[0]
