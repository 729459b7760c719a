"""train.offload_optimizer_during_grads: the train step as two programs, the gradient
(``TrainStep.gradients``) then the update (``TrainStep.apply_gradients``), with the AdamW
moments in a file while the first runs (``distill/train.py``).

References: the one-program step (``TrainStep.step``) on the same batches, unsharded, with
microbatches and on the 8-fake-device mesh; what the update program keeps resident is read
from XLA's own ``memory_analysis()`` of both ways.
"""

from __future__ import annotations

# isort: off
from tests.distill.distill_common import (  # first: sets 8 fake devices
    TINY, assert_same_steps, ema_step_config, make_mesh8, start_state)
# isort: on

import types
import warnings

import jax
import numpy as np
import pytest

from pmd_jax.distill import step as st
from pmd_jax.distill import train
from pmd_jax.run import sharding as shd
from tests.distill.test_microbatch import _batch


def _np(tree):
    return jax.tree.map(np.asarray, tree)


def _steps(ts: st.TrainStep, two: bool, steps: int = 3):
    state, out = start_state(ts), []
    for i in range(steps):
        b = _batch(i)
        if two:
            loss, m, g = ts.gradients(state.params, state.teacher, b)
            state, m = ts.apply_gradients(state, loss, m, g)
        else:
            state, m = ts.step(state, b)
        out.append(_np(m))
    return _np(state), out


def _assert_bitwise(got, want) -> None:
    assert_same_steps(got, want, dict(rtol=0, atol=0))  # (assert_allclose at 0: equality)


# slow tests both (~24 s each on 2 cores): the default suite runs the two programs with
# microbatches on the mesh (test_two_programs_on_the_mesh) and bitwise against the one
# program (test_train_step_keeps_the_moments_in_a_file_during_the_gradient)
@pytest.mark.parametrize("micro", [pytest.param(0, marks=pytest.mark.slow),
                                   pytest.param(4, marks=pytest.mark.slow)])
def test_two_programs_give_the_one_program_step(micro):
    """Three SDPO steps with an EMA teacher (clip, AdamW, EMA, metrics): the same bits."""
    ts = st.TrainStep(TINY, ema_step_config("sdpo", 2), microbatch_rows=micro)
    want = _steps(ts, two=False)
    got = _steps(st.TrainStep(TINY, ema_step_config("sdpo", 2), microbatch_rows=micro),
                 two=True)
    _assert_bitwise(got, want)
    assert want[1][0]["grad_norm"] > 0


def test_two_programs_on_the_mesh():
    mesh = make_mesh8()
    rules = shd.ShardingRules.from_mapping()
    mk = lambda: st.TrainStep(TINY, ema_step_config("hybrid", 2), mesh=mesh,  # noqa: E731
                              rules=rules, microbatch_rows=4)
    want, got = _steps(mk(), two=False, steps=2), _steps(mk(), two=True, steps=2)
    assert_same_steps(got, want, dict(rtol=1e-6, atol=1e-7))
    # the update's state keeps its shardings
    ts = mk()
    state = start_state(ts)
    loss, m, g = ts.gradients(state.params, state.teacher, _batch(0))
    new, _ = ts.apply_gradients(state, loss, m, g)
    for a, s in zip(jax.tree.leaves(new), jax.tree.leaves(ts.state_shardings()), strict=True):
        assert a.sharding.is_equivalent_to(s, a.ndim)


def test_the_update_program_needs_no_temporary_the_size_of_the_weights():
    """XLA's ``memory_analysis()``: the update as the one-program step writes it materialises
    the clipped gradient (a temporary at least the weights' size); the split update returns
    it over the donated gradient's buffer instead, and every array it outputs is aliased."""
    ts = st.TrainStep(TINY, ema_step_config("sdpo", 2))
    state = ts.abstract_state()
    b = _batch(0)
    outs = jax.eval_shape(ts._loss_and_grads, state.params, state.teacher, b)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    update = ts._get_update_program().lower(state, *outs).compile().memory_analysis()
    with warnings.catch_warnings():  # (the gradient's buffers: donated, not usable there)
        warnings.simplefilter("ignore")
        plain = jax.jit(lambda s, loss, m, g: st.apply_update(ts.opts, s, loss, m, g),
                        donate_argnums=(0, 3)).lower(state, *outs).compile().memory_analysis()
    assert plain.temp_size_in_bytes >= weights
    # (at the 0.5B coder's shapes: 2.35 GiB of temporaries -> 0; at this tiny model's a few
    # small leaves stay temporaries, so: at least half the weights' size less)
    assert update.temp_size_in_bytes < plain.temp_size_in_bytes - weights // 2
    # every output but the metrics' scalars is written over a donated input
    assert update.output_size_in_bytes - update.alias_size_in_bytes < 4096
    # the gradient program reads no optimizer state: params and teacher (and the batch)
    grads = ts._get_grad_program(b).lower(state.params, state.teacher, b).compile()
    assert grads.memory_analysis().argument_size_in_bytes < 2 * weights + 2**16


def test_train_step_keeps_the_moments_in_a_file_during_the_gradient(tmp_path, monkeypatch):
    """distill.train.train_step with the option: while the gradient program runs the state
    has no optimizer state and one optimizer file exists; after the step the state equals
    the one-program step's bit for bit and the file is gone. A gradient that raises leaves
    the moments back in the state."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)

    def bundle(key):
        ts = st.TrainStep(TINY, ema_step_config("sdpo", 2), microbatch_rows=4)
        return train.TrainBundle(ts, start_state(ts), None, key)

    plain, split = bundle(None), bundle(str(tmp_path / "run"))
    seen = []
    real = split.step_fn.gradients

    def spy(*a, **k):
        seen.append((split.state.opt_state, sorted(p.name for p in tmp_path.iterdir())))
        return real(*a, **k)

    monkeypatch.setattr(split.step_fn, "gradients", spy)
    for i in range(2):
        m_plain = train.train_step(plain, _batch(i))
        m_split = train.train_step(split, _batch(i))
        assert m_split == m_plain
    assert len(seen) == 2
    for during, files in seen:
        assert during is None and len(files) == 1 and files[0].startswith("pmd_jax_optimizer_")
    _assert_bitwise((_np(split.state), []), (_np(plain.state), []))
    assert not list(tmp_path.iterdir())

    def boom(*a, **k):
        raise RuntimeError("backward failed")

    before = _np(split.state.opt_state)
    monkeypatch.setattr(split.step_fn, "gradients", boom)
    with pytest.raises(RuntimeError, match="backward failed"):
        train.train_step(split, _batch(0))
    for a, b in zip(jax.tree.leaves(_np(split.state.opt_state)), jax.tree.leaves(before),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    assert not list(tmp_path.iterdir())


def test_apply_gradients_without_the_moments_is_named():
    ts = st.TrainStep(TINY, ema_step_config("sdpo", 2))
    state = start_state(ts)
    loss, m, g = ts.gradients(state.params, state.teacher, _batch(0))
    with pytest.raises(ValueError, match="optimizer state"):
        ts.apply_gradients(state.replace(opt_state=None), loss, m, g)


def test_the_bundle_takes_the_option_from_the_run_config():
    from pmd_jax.config import apply_mode, base_config, freeze

    c = base_config()
    c.distill.loss.topk = 8  # (TINY's vocabulary is 48 tokens)
    assert freeze(apply_mode(c)).train.offload_optimizer_during_grads is False
    c.train.offload_optimizer_during_grads = True
    cfg = freeze(apply_mode(c))
    model = types.SimpleNamespace(cfg=TINY, mesh=None, rules=None,
                                  params=jax.tree.map(np.asarray, start_state(
                                      st.TrainStep(TINY, ema_step_config("sdpo", 2))).params))
    b = train.init_train_state(cfg, model)
    assert b.optimizer_offload_key == str(cfg.run_dir)
