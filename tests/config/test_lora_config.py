"""The ``lora`` section (issue 51): PEFT's knob names, full fine-tuning by default, and bad
values named by key before anything is loaded (in-process and on the command line)."""

from __future__ import annotations

from pmd_jax.config import apply_mode, base_config, config_errors, freeze
from pmd_jax.config.sections import RunConfig
from pmd_jax.models.lora import TARGETS, LoraConfig
from tests.config.test_config import SCIQ, _load, _main


def _errors(**lora) -> list[str]:
    c = apply_mode(_load(SCIQ))
    for k, v in lora.items():
        c.lora[k] = v
    return config_errors(apply_mode(c))


def test_defaults_are_full_fine_tuning_with_peft_names():
    c = base_config()
    assert c.lora.enabled is False and c.lora.r == 16 and c.lora.alpha == 32.0
    assert list(c.lora.target_modules) == list(TARGETS)
    assert c.lora.use_rslora is False and c.lora.base_dtype == ""
    assert RunConfig().lora.config() is None
    on = RunConfig().lora.replace(enabled=True, r=8, alpha=16.0, use_rslora=True,
                                  target_modules=("v_proj", "q", "q_proj"))
    assert on.config() == LoraConfig(rank=8, alpha=16.0, targets=("q", "v"), use_rslora=True)
    assert on.replace(target_modules=("all-linear",)).config().targets == TARGETS
    assert _errors(enabled=True, r=4, target_modules=["q_proj", "v_proj"]) == []


def test_bad_values_are_named_by_key():
    assert _errors(r=0) == ["lora.r must be an integer >= 1, got 0"]
    assert _errors(alpha=-1.0) == ["lora.alpha must be a finite number > 0, got -1.0"]
    (err,) = _errors(target_modules=["q", "qkv", "lm_head"])
    assert err.startswith("lora.target_modules: unknown ['qkv', 'lm_head']")
    assert _errors(target_modules=[]) == ["lora.target_modules must name at least one "
                                          "projection"]
    assert _errors(base_dtype="int8") == [
        "lora.base_dtype='int8' is not one of ('', 'float32', 'bfloat16')"]


def test_a_mode_that_never_trains_accepts_and_ignores_it():
    """pmd_frozen_policy with lora.enabled: valid (the policy is the base either way);
    distill/train.py builds no adapters (tests/distill/test_lora_step.py)."""
    c = _load(SCIQ)
    c.mode = "pmd_frozen_policy"
    c.lora.enabled = True
    assert not [e for e in config_errors(apply_mode(c)) if "lora" in e]


def test_command_line_refuses_bad_lora_values_before_compute(tmp_path):
    p = _main(f"--config={SCIQ}", f"--config.run_dir={tmp_path}/run",
              "--config.lora.enabled=True", "--config.lora.r=0",
              "--config.lora.target_modules=['q', 'qkv']")
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert "lora.r must be an integer >= 1, got 0" in p.stderr
    assert "lora.target_modules: unknown ['qkv']" in p.stderr
    assert not (tmp_path / "run").exists()


def test_command_line_takes_comma_separated_target_names():
    """``--config.lora.target_modules=q_proj,v_proj`` (how PEFT users type it) is two names,
    not the one name 'q_proj,v_proj' (a bare-word list was read as a single item)."""
    from pmd_jax.config.cli import apply_taken, check_command_line, load_config_file

    line = check_command_line(["main", f"--config={SCIQ}", "--config.lora.enabled=True",
                               "--config.lora.target_modules=q_proj, v_proj,down"])
    assert line.errors == []
    c = load_config_file(SCIQ)
    apply_taken(c, line)
    assert tuple(c.lora.target_modules) == ("q_proj", "v_proj", "down")
    assert not [e for e in config_errors(apply_mode(c)) if "lora" in e]
    assert freeze(apply_mode(c)).lora.targets() == ("q", "v", "down")
