"""The sampler backends table is the one place a backend is registered: the config's
rollout.sampler choices, what a backend needs of the rollout section, its start-up check, its
single-process rule, rollout.overlap's second instance and build_sampler all come from its
BackendSpec, with no string branch elsewhere."""

from __future__ import annotations

import types

import pytest

from pmd_jax.config import SAMPLERS, base_config, config_errors, freeze
from pmd_jax.sampling import backends


def test_config_choices_are_the_registered_backends():
    assert SAMPLERS == backends.backend_names() == ("jax", "vllm")


def test_unknown_backend_is_refused_by_config_and_builder():
    cfg = base_config()
    cfg.rollout.sampler = "sglang"
    errs = config_errors(cfg)
    assert any("rollout.sampler='sglang'" in e for e in errs), errs
    with pytest.raises(ValueError, match="no such sampler backend; known: jax, vllm"):
        backends.build("sglang", freeze(cfg), None, 128)


def test_a_registered_backend_is_all_the_run_needs(monkeypatch):
    """One spec: its build, its rollout-section errors, its start-up refusal, its
    single-process rule and its overlap twin reach the config checks, main and build."""
    from pmd_jax.loop import build

    made = []
    spec = backends.BackendSpec(
        "fake", lambda cfg, model, max_len: made.append(max_len) or object(),
        rollout_errors=lambda r: [] if r.vllm_model else ["rollout.sampler=fake needs X"],
        start_refusal=lambda cfg: "no fake server here",
        single_process_reason="fake reasons", twin_for_overlap=True)
    monkeypatch.setitem(backends.SPECS._items, "fake", spec)
    cfg = base_config()
    cfg.rollout.sampler = "fake"
    assert "rollout.sampler=fake needs X" in config_errors(cfg)
    cfg.rollout.vllm_model = "m"
    assert not [e for e in config_errors(cfg) if "fake" in e]
    monkeypatch.setenv("PMD_COORDINATOR", "127.0.0.1:1234")
    monkeypatch.setenv("PMD_NUM_PROCESSES", "2")
    errs = [e for e in config_errors(cfg) if "single JAX process" in e]
    assert errs and "rollout.sampler='fake'" in errs[0] and "fake reasons" in errs[0], errs
    assert "rollout.sampler='jax' with several processes" in errs[0]
    monkeypatch.delenv("PMD_COORDINATOR")
    monkeypatch.delenv("PMD_NUM_PROCESSES")
    assert backends.start_refusal(freeze(cfg)) == "no fake server here"  # (main asks this)
    model = types.SimpleNamespace(cfg=types.SimpleNamespace(max_position_embeddings=16384),
                                  encode_chat=None, decode=None)
    s = build.build_samplers(freeze(cfg), model)  # no overlap: one sampler
    assert s.reflect is s.rollout and made == [16384]
    cfg.rollout.overlap = True  # overlap: the main thread's own instance (twin_for_overlap)
    s = build.build_samplers(freeze(cfg), model)
    assert s.reflect is not s.rollout and made == [16384] * 3
    monkeypatch.setitem(backends.SPECS._items, "fake", backends.BackendSpec(
        "fake", lambda cfg, model, max_len: made.append(max_len) or object()))
    s = build.build_samplers(freeze(cfg), model)  # a server client: shared
    assert s.reflect is s.rollout and made == [16384] * 4
