"""The typed run config (issue 16): one declaration per knob, the editable ConfigDict generated
from it, freeze() to the frozen tree with the same paths, moved keys that fail clearly."""

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from ml_collections import config_dict

from pmd_jax.config import RunConfig, apply_mode, base_config, config_errors, freeze
from pmd_jax.config.cli import check_command_line, config_keys
from pmd_jax.config.schema import Section, field_help, schema_keys
from pmd_jax.distill.config import DistillConfig, default_distill_config
from pmd_jax.memory.config import MemoryConfig, default_memory_config, validate_memory_config

ROOT = Path(__file__).parents[2]
SCIQ = "configs/smollm2_sciq.py"


def _load(path: str):
    spec = importlib.util.spec_from_file_location("cfgmod", ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def _sections(cls: type) -> list[type]:
    out = [cls]
    for f in dataclasses.fields(cls):
        if f.metadata.get("section"):
            out.extend(_sections(f.metadata["section"]))
    return out


def test_every_knob_has_a_type_and_help_text():
    for cls in _sections(RunConfig):
        assert issubclass(cls, Section) and cls.__dataclass_params__.frozen, cls
        for f in dataclasses.fields(cls):
            # (a help may be written when asked, e.g. the mode knob's from the mode registry)
            assert f.type and field_help(f).strip(), f"{cls.__name__}.{f.name}"


def test_config_dict_is_generated_from_the_declarations():
    # The command-line surface is exactly the declared keys (derived knobs left out).
    assert sorted(config_keys(base_config())) == sorted(schema_keys(RunConfig))
    assert "memory.success_threshold" not in config_keys(base_config())
    assert "success_threshold" in config_keys(default_memory_config())
    c = base_config()
    assert isinstance(c.distill.loss._fields["topk"], config_dict.FieldReference)
    assert c.distill.loss.get_type("topk") is int and c.distill.optim.get_type("grad_clip") is float
    assert isinstance(c.memory.stop_token_ids, list) and c.eval.seeds == (0,)
    want = default_distill_config().to_dict()
    del want["loss"]["group_size"], want["loss"]["temperature"]  # derived from rollout
    # a run's loss is the mode's default (apply_mode); a distill section alone takes SDPO
    assert c.distill.loss.name == "" and want["loss"]["name"] == "sdpo"
    want["loss"]["name"] = ""
    assert c.distill.to_dict() == want


def test_freeze_keeps_the_paths_and_values():
    c = apply_mode(_load(SCIQ))
    assert config_errors(c) == []
    r = freeze(c)
    assert isinstance(r, RunConfig)
    with pytest.raises(TypeError, match="already frozen"):  # one shape in, one out
        freeze(r)
    assert isinstance(r.distill, DistillConfig) and isinstance(r.memory, MemoryConfig)
    assert r.train.steps == c.train.steps and r.rollout.n == c.rollout.n
    assert r.distill.loss.name == c.distill.loss.name and r.distill.loss.topk == 100
    assert r.memory.insight.sampling.max_tokens == 384
    assert r.memory.behavior.sampling.max_tokens == 768
    assert r.memory.context.truncation_order == tuple(c.memory.context.truncation_order)
    assert r.mesh.rules == {} and not r.mesh.rules
    # one home: the memory's threshold and feedback rule are the teacher prompt's
    assert r.memory.success_threshold == c.teacher_prompt.success_threshold
    assert (r.memory.context.feedback_only_without_solution
            is c.teacher_prompt.feedback_only_without_solution)
    # ... and the loss's group size and temperature are the rollout's
    assert r.distill.loss.group_size == c.rollout.n
    assert r.distill.loss.temperature == c.rollout.temperature
    # config.json: the ConfigDict's values, plus the derived memory and loss knobs
    d, want = r.to_dict(), c.to_dict()
    want["distill"]["loss"]["group_size"] = c.rollout.n
    want["distill"]["loss"]["temperature"] = c.rollout.temperature
    want["memory"]["success_threshold"] = 1.0
    want["memory"]["context"]["feedback_only_without_solution"] = True
    assert d == want
    validate_memory_config(r.memory)


def test_the_frozen_config_cannot_change():
    r = freeze(apply_mode(base_config()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.train.steps = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.distill.loss.name = "grpo"  # type: ignore[misc]
    changed = r.replace(train=r.train.replace(steps=3))
    assert changed.train.steps == 3 and r.train.steps == 100


def test_mesh_rules_set_whole_are_frozen():
    c = base_config()
    c.mesh.rules = {"vocab": "fsdp"}
    r = freeze(c)
    assert dict(r.mesh.rules) == {"vocab": "fsdp"} and r.mesh.rules.to_dict() == {"vocab": "fsdp"}
    hash(r.mesh.rules)


@pytest.mark.parametrize("key,new", [
    ("distill.loss.mode", "distill.loss.name"),
    ("memory.success_threshold", "teacher_prompt.success_threshold"),
    ("memory.context.feedback_only_without_solution",
     "teacher_prompt.feedback_only_without_solution"),
])
def test_moved_keys_fail_naming_the_kept_key(key, new):
    value = "grpo" if key.endswith("mode") else "0.5" if "threshold" in key else "true"
    line = check_command_line(["prog", f"--config={SCIQ}", f"--config.{key}={value}"])
    assert len(line.errors) == 1 and repr(new) in line.errors[0] and "issue 16" in line.errors[0]
    # a config file that still sets the old key (an unlocked ConfigDict takes new keys)
    c = base_config()
    *head, last = key.split(".")
    node = c
    for part in head:
        node = node[part]
    node[last] = {"mode": "grpo", "success_threshold": 0.5}.get(last, True)
    errs = [e for e in config_errors(apply_mode(c)) if key in e]
    assert len(errs) == 1 and repr(new) in errs[0], errs


def test_unknown_key_added_by_a_config_file_is_named():
    c = base_config()
    c.rollout.temprature = 0.5
    assert any("unknown config key 'rollout.temprature'" in e for e in config_errors(c))


def test_mode_implications_are_set_before_freezing():
    c = base_config()
    c.mode = "pmd_frozen_memory"
    c.train.steps = 20
    r = freeze(apply_mode(c))
    assert r.memory.frozen_after_step == 3
    c = base_config()
    c.mode = "grpo"
    assert freeze(apply_mode(c)).distill.loss.name == "grpo"


def test_old_loss_key_on_the_command_line_reads_well():
    p = subprocess.run(
        [sys.executable, "-m", "pmd_jax.main", f"--config={SCIQ}",
         "--config.distill.loss.mode=grpo"], cwd=ROOT, capture_output=True, text=True,
        timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip() == (
        "invalid config: config key 'distill.loss.mode' was renamed 'distill.loss.name' "
        "(issue 16): set --config.distill.loss.name instead")


def test_knob_listing_shows_defaults_and_help():
    from pmd_jax.config.__main__ import main

    assert main(["prog", "nope"]) == 2
    p = subprocess.run([sys.executable, "-m", "pmd_jax.config", "teacher_prompt"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert out[0].startswith("[teacher_prompt]") and "teacher_prompt.max_tokens = 10240" in out
    assert "teacher_prompt.success_threshold = 1.0" in out
    assert not any(line.startswith("rollout.") for line in out)


def test_with_values_copies_a_frozen_section_with_dotted_changes():
    from pmd_jax.memory.config import MemoryConfig

    m = MemoryConfig()
    got = m.with_values({"context.max_tokens": 512, "stop_token_ids": [7, 9],
                         "levels.insight": False, "signal_rule": "sdpo"})
    assert (got.context.max_tokens, got.stop_token_ids, got.levels.insight, got.signal_rule) == (
        512, (7, 9), False, "sdpo")
    assert m == MemoryConfig()  # the section itself is unchanged
    assert got.context.truncation_order == m.context.truncation_order  # the rest kept
    with pytest.raises(KeyError, match="'context.max_tokenz'"):
        m.with_values({"context.max_tokenz": 1})
    with pytest.raises(KeyError, match="'signal_rule.x'"):
        m.with_values({"signal_rule.x": 1})  # a knob, not a section


def test_library_code_takes_the_frozen_section_only():
    """One shape below config/: the train step and the memory refuse an editable ConfigDict
    (naming the function that freezes it); validation reads the frozen RunConfig."""
    from pmd_jax.distill.config import default_distill_config, freeze_distill_config
    from pmd_jax.distill.loss_fn import StepOptions
    from pmd_jax.memory import ProceduralMemory, default_memory_config

    with pytest.raises(TypeError, match="freeze_distill_config"):
        StepOptions.from_config(default_distill_config(), 100)
    assert StepOptions.from_config(freeze_distill_config(default_distill_config()), 100)
    with pytest.raises(TypeError, match="freeze_memory_config"):
        ProceduralMemory(default_memory_config())
    from pmd_jax.loop.trainer import Trainer

    with pytest.raises(TypeError, match="frozen RunConfig"):
        Trainer(apply_mode(base_config()))


def test_list_and_tuple_knobs_from_the_command_line():
    """absl cannot set a list field (a FATAL flags error) and reads a tuple's text character
    by character (eval.seeds=abc became ('a', 'b', 'c') and failed at the first evaluation):
    check_command_line parses both, and a wrong item is one line naming the knob."""
    from pmd_jax.config.cli import apply_taken
    from pmd_jax.config.cli import load_config_file as load

    order = ["lessons", "behaviors", "strategies", "feedback", "successful_attempt"]
    argv = ["main", "--config=configs/smollm2_sciq.py", f"--config.memory.context."
            f"truncation_order={order!r}", "--config.eval.seeds", "1,2",
            "--config.memory.stop_token_ids=[]", "--config.train.steps=3"]
    line = check_command_line(argv)
    assert line.errors == [] and line.argv == argv[:2] + ["--config.train.steps=3"]
    c = load("configs/smollm2_sciq.py")
    apply_taken(c, line)
    assert list(c.memory.context.truncation_order) == order and c.eval.seeds == (1, 2)
    assert not [e for e in config_errors(apply_mode(c)) if "truncation" in e or "seeds" in e]
    line = check_command_line(["main", "--config=configs/smollm2_sciq.py",
                               "--config.eval.seeds=abc"])
    assert line.errors == ["eval.seeds needs a list of int, got 'abc' (--config.eval.seeds)"]
    # an empty default gives no item type to compare with: the frozen config's check does
    c = base_config()
    c.memory.stop_token_ids = [1.5]
    assert "memory.stop_token_ids must hold int values, got 1.5 in [1.5]" in config_errors(
        apply_mode(c))
