"""The behavior level reads the problem, not the task's shared instructions
(``memory.sanitize.without_shared_preamble``): on real MBPP prompts the preamble of
``tasks.code.CODE_PROMPT`` comes off and the problem statement is left exactly; real SciQ
prompts (every style, with and without the support passage) are left as they are; and a
behavior round over code prompts shows the problems in its extractive summaries, where the
first 120 characters used to be "You are a coding expert. ..." for every cluster."""

from __future__ import annotations

import pytest

from pmd_jax.memory import ProceduralMemory
from pmd_jax.memory.sanitize import without_shared_preamble
from pmd_jax.tasks.code import CODE_PROMPT
from pmd_jax.tasks.registry import get_task
from tests.memory.test_memory_levels import BIO, CODE, Scripted, recs, small_config


def _user(task, p) -> str:
    return next(m["content"] for m in reversed(task.prompt(p)) if m["role"] == "user")


def test_mbpp_prompts_lose_exactly_the_code_preamble():
    task = get_task("mbpp")
    probs = task.problems("train")[:40]
    texts = {p.id: _user(task, p) for p in probs}
    assert all(t.startswith("You are a coding expert.") for t in texts.values())
    out = without_shared_preamble(texts)
    assert out == {p.id: p.question for p in probs}
    assert all(CODE_PROMPT.format(problem=out[k]) == t for k, t in texts.items())


@pytest.mark.parametrize("style", ["reasoning", "direct", "direct_text"])
@pytest.mark.parametrize("support", [False, True])
def test_sciq_prompts_are_left_as_they_are(style, support):
    task = get_task("sciq", seed=0, prompt_style=style, include_support=support)
    texts = {p.id: _user(task, p) for p in task.problems("train")[:60]}
    assert without_shared_preamble(texts) == texts


def test_only_whole_shared_paragraphs_come_off():
    # a shared first word is not a preamble; a text that is only the preamble stays whole
    assert without_shared_preamble({"a": "What is x?", "b": "What is y?"}) == {
        "a": "What is x?", "b": "What is y?"}
    pre = "Solve it.\n\nBe brief.\n\n"
    got = without_shared_preamble({"a": pre + "Add 1.", "b": pre + "Add 2.", "c": pre,
                                   "d": ""})
    assert got == {"a": "Add 1.", "b": "Add 2.", "c": pre, "d": ""}
    # a shared first paragraph whose second differs: only the first comes off
    assert without_shared_preamble({"a": "Hi.\n\nSay A.\n\nx", "b": "Hi.\n\nSay B.\n\nx"}) == {
        "a": "Say A.\n\nx", "b": "Say B.\n\nx"}
    assert without_shared_preamble({"a": pre + "x"}) == {"a": pre + "x"}  # one text: as given


def test_behavior_round_summaries_show_the_code_problems():
    # one task's problems, as a run stores them: each prompt opens with the same instructions
    qs = CODE + [q.replace("?", " in Python?") for q in BIO]
    problems = {f"p{i}": CODE_PROMPT.format(problem=q) for i, q in enumerate(qs)}
    gen = Scripted()
    mem = ProceduralMemory(small_config())
    mem.update(0, recs(0, problems, [1.0, 0.0]), gen)
    summaries = mem.behaviors.summaries
    assert len(summaries) == 2
    assert not any("coding expert" in s for s in summaries)
    # each summary names its cluster's (up to) three nearest problems by their statements
    assert sum(q[:40] in s for q in qs for s in summaries) == 6
    # and the extraction prompts' evidence shows the problems, not the instructions
    ext = [c[-1]["content"] for c in gen.of("behaviors")]
    assert len(ext) == 2 and not any("coding expert" in e for e in ext)
    assert all(q[:40] in "".join(ext) for q in qs)
