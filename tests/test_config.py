import pytest

from pmd_jax.config import apply_mode, base_config, validate_config
from pmd_jax.models.config import ConfigError


def _load(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("cfgmod", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


@pytest.mark.parametrize("path", ["configs/smollm2_sciq.py"])
def test_shipped_configs_validate(path):
    c = apply_mode(_load(path))
    validate_config(c)


def test_every_problem_is_named_at_once():
    c = base_config()
    c.mode = "magic"
    c.rollout.n = 0
    c.distill.loss.alpha = 1.5
    c.task.name = "sciknoweval"
    with pytest.raises(ConfigError) as e:
        validate_config(c)
    msg = str(e.value)
    for needle in ("mode='magic'", "rollout.n", "loss.alpha", "task.path"):
        assert needle in msg, msg


def test_modes_set_loss_mode():
    c = base_config()
    c.mode = "grpo"
    c = apply_mode(c)
    assert c.distill.loss.mode == "grpo"
    validate_config(c)
    c.mode = "sdpo"
    c = apply_mode(c)
    assert c.distill.loss.mode == "sdpo"
    assert c.distill.loss.group_size == c.rollout.n


@pytest.mark.parametrize("path", ["configs/olmo3.py", "configs/qwen3.py"])
def test_full_size_configs_name_missing_files(path):
    c = apply_mode(_load(path))
    with pytest.raises(ConfigError) as e:
        validate_config(c)
    assert "model.source" in str(e.value) and "task.path" in str(e.value)


def test_mbpp_config_validates():
    validate_config(apply_mode(_load("configs/smollm2_mbpp.py")))
