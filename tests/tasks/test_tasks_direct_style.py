"""The "direct" multiple-choice style: answer tag opened by the prompt, same reward rule."""

import pytest

from pmd_jax.tasks.base import TaskError
from pmd_jax.tasks.registry import get_task


def test_direct_style_prefix_and_reward_on_real_sciq():
    task = get_task("sciq", seed=0, prompt_style="direct")
    reasoning = get_task("sciq", seed=0)
    for p in task.problems("validation")[:20]:
        assert task.response_prefix(p) == "<answer>"
        assert reasoning.response_prefix(p) == ""
        msgs = task.prompt(p)
        assert "reason step by step" not in msgs[-1]["content"]
        assert msgs[-1]["content"].endswith("inside <answer></answer> tags.")
        # the options shown are the ones reasoning style shows (same seed, same order)
        assert msgs[-1]["content"].split("\n\n")[1].split("\nAnswer")[0] == \
            reasoning.prompt(p)[-1]["content"].split("\n\n")[1].split("\nPlease")[0]
        gold = p.gold
        wrong = next(c for c in "ABCD" if c != gold)
        assert task.verify(p, "<answer>" + gold + "</answer>").reward == 1.0
        assert task.verify(p, "<answer>" + wrong + "</answer>").reward == 0.0
        assert task.verify(p, "<answer>" + gold).reward == 1.0  # stopped before closing


def test_unknown_style_is_named():
    with pytest.raises(TaskError, match="prompt_style"):
        get_task("sciq", prompt_style="chatty")
