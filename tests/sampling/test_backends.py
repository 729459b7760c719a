"""The sampler backends table is the one place a backend is registered: the config's
rollout.sampler choices and build_sampler both come from it."""

from __future__ import annotations

import pytest

from pmd_jax.config import SAMPLERS, base_config, config_errors, freeze
from pmd_jax.sampling import backends


def test_config_choices_are_the_registered_backends():
    assert SAMPLERS == tuple(backends.BACKENDS) == ("jax", "vllm")


def test_unknown_backend_is_refused_by_config_and_builder():
    cfg = base_config()
    cfg.rollout.sampler = "sglang"
    errs = config_errors(cfg)
    assert any("rollout.sampler='sglang'" in e for e in errs), errs
    with pytest.raises(ValueError, match="no such sampler backend; known: jax, vllm"):
        backends.build("sglang", freeze(cfg), None, 128)


def test_a_registered_backend_is_built(monkeypatch):
    made = []
    monkeypatch.setitem(backends.BACKENDS, "fake",
                        lambda cfg, model, max_len: made.append(max_len) or "sampler")
    assert backends.build("fake", freeze(base_config()), None, 64) == "sampler" and made == [64]
