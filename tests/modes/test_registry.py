"""The mode registry (pmd_jax/modes): what each built-in mode means, the loss rule (an empty
name takes the mode's default, a named loss is kept or refused, never replaced), a new mode
added by one registration, and no branch on a mode's name outside the registry."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from pmd_jax import modes
from pmd_jax.config import apply_mode, base_config, config_errors
from pmd_jax.distill.registry import get_loss, loss_names
from pmd_jax.modes import ModeRuntime, ModeSpec, get_mode, mode_names, register_mode

ROOT = Path(__file__).resolve().parents[2]


def test_the_builtin_modes_and_what_each_means():
    assert mode_names() == (
        "grpo", "sdpo", "sdpo_matched_sampling", "pmd", "pmd_frozen_memory",
        "pmd_frozen_policy", "pmd_random_memory", "pmd_no_insight", "pmd_no_behaviors",
        "pmd_sdpo_signal", "pmd_verified", "pmd_verified_random_memory", "mel", "fast_slow")
    assert modes.memory_modes() == tuple(
        n for n in mode_names() if n.startswith("pmd") or n == "fast_slow")
    assert {n for n in mode_names() if not get_mode(n).has_teacher} == {
        "grpo", "mel", "fast_slow"}
    assert [n for n in mode_names() if not get_mode(n).trains_policy] == ["pmd_frozen_policy"]
    assert get_mode("memory_only") is get_mode("pmd_frozen_policy")
    assert get_mode("pmd_verified").memory_settings == {"verify.enabled": True}
    with pytest.raises(ValueError, match="mode='nope' is not one of"):
        get_mode("nope")


@pytest.mark.parametrize("mode", ["grpo", "sdpo", "pmd", "pmd_frozen_policy", "mel",
                                  "fast_slow"])
def test_a_named_loss_is_kept_or_refused_never_replaced(mode):
    spec = get_mode(mode)
    for loss in loss_names():
        c = base_config()
        c.rollout.max_tokens = 1024  # (SmolLM2's context)
        c.mode, c.distill.loss.name = mode, loss
        c = apply_mode(c)
        assert c.distill.loss.name == loss
        why = spec.loss_error(get_loss(loss))
        errs = config_errors(c)
        if why is None:
            assert not [e for e in errs if "distill.loss.name" in e], errs
        else:
            assert why in errs, errs


@pytest.mark.parametrize("first", ["pmd_jax.modes.fast_slow.mode", "pmd_jax.modes.builtin",
                                   "pmd_jax.modes.mel.mode"])
def test_the_order_does_not_depend_on_which_module_is_imported_first(first):
    code = (f"import {first}\nfrom pmd_jax.modes import mode_names\n"
            "print(','.join(mode_names()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    assert out == ",".join(mode_names())


def test_register_refuses_a_taken_name_and_an_unknown_teacher():
    with pytest.raises(ValueError, match="'sdpo' is registered twice"):
        register_mode(ModeSpec(name="sdpo", teacher="feedback", doc="again"))
    with pytest.raises(ValueError, match="registered twice"):
        register_mode(ModeSpec(name="x_new", teacher="feedback", doc="",
                               aliases=("memory_only",)))
    with pytest.raises(ValueError, match="teacher='oracle'"):
        register_mode(ModeSpec(name="x_oracle", teacher="oracle", doc=""))
    with pytest.raises(ValueError, match="needs uses_memory"):
        register_mode(ModeSpec(name="x_mem", teacher="memory", doc=""))


def test_a_new_mode_is_one_registration(tmp_path, monkeypatch):
    """A mode registered from outside the package: apply_mode gives it its default loss and
    implied settings, validation runs its own check, and build/launch read its facts."""
    from pmd_jax import launch_needs
    from pmd_jax.config import freeze

    monkeypatch.setattr(modes, "_MODES", dict(modes._MODES))
    monkeypatch.setattr(modes, "_ALIASES", dict(modes._ALIASES))
    monkeypatch.setattr(modes, "_RANK", dict(modes._RANK))

    class Runtime(ModeRuntime):
        work_name = "probe"

    def derive(c):
        c.teacher_prompt.include_feedback = False

    register_mode(ModeSpec(
        name="probe", teacher="memory", uses_memory=True, doc="a test mode",
        memory_settings={"levels.insight": False}, derive=derive,
        check=lambda c: ["probe says no"] if c.rollout.n > 8 else [],
        runtime=lambda *a: Runtime()))
    c = base_config()
    c.mode, c.run_dir, c.rollout.max_tokens = "probe", str(tmp_path / "r"), 1024
    c = apply_mode(c)
    assert c.distill.loss.name == "sdpo" and c.memory.levels.insight is False
    assert c.teacher_prompt.include_feedback is False
    assert config_errors(c) == []
    c.rollout.n = 9
    assert "probe says no" in config_errors(c)
    c.rollout.n = 4
    assert launch_needs.needs(freeze(c))["PMD_EXTRAS"] == "embeddings,scann"
    assert get_mode("probe").runtime().work_name == "probe"
    # the mode knob's help is written from the registry: the new mode is in it
    from pmd_jax.config.schema import help_text
    from pmd_jax.config.sections import RunConfig

    assert "probe: a test mode" in help_text(RunConfig, "mode")


def test_the_mode_knobs_help_names_every_mode_and_alias():
    from pmd_jax.config.schema import help_text
    from pmd_jax.config.sections import RunConfig

    h = help_text(RunConfig, "mode")
    for name in modes.mode_names():
        assert f"{name}: " in h or f"{name} (alias" in h, name
    for alias in modes.aliases():
        assert alias in h, alias
    assert "pmd_jax/config/modes.py" not in h  # (it named that file for the variants)


def _is_config(node: ast.AST) -> bool:
    """``cfg`` / ``c`` / ``config`` or ``<anything>.cfg``."""
    if isinstance(node, ast.Name):
        return node.id in ("cfg", "c", "config")
    return isinstance(node, ast.Attribute) and node.attr == "cfg"


def test_no_branch_on_a_mode_name_outside_the_registry():
    """``cfg.mode == ...``, ``cfg.mode in (...)`` and the like appear only in pmd_jax/modes,
    the modes' own modules and config/modes.py (which reads the registry)."""
    allowed = {"pmd_jax/config/modes.py", "pmd_jax/modes/mel/mode.py",
               "pmd_jax/modes/fast_slow/mode.py"}
    found = []
    for path in sorted((ROOT / "pmd_jax").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("pmd_jax/modes/") or rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "mode" and _is_config(s.value)
                   for s in sides):
                found.append(f"{rel}:{node.lineno}")
    assert found == [], found
