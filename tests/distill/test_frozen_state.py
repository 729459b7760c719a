"""A mode whose weights never change (``trains_policy=False``, e.g. memory_only): the train
state holds the params only, with no AdamW moments or teacher copy, on one device and on the
8-fake-device mesh, and it survives a checkpoint round trip onto its own abstract state."""

from __future__ import annotations

# isort: off
from tests.distill.distill_common import (  # first: sets 8 fake devices
    TINY, ema_step_config, make_mesh8, tiny_params)
# isort: on

import jax
import numpy as np
import pytest

from pmd_jax.distill import step as st
from pmd_jax.run.checkpoint import Checkpointer
from tests.distill.test_microbatch import _batch


def _leaves(tree) -> int:
    return len(jax.tree.leaves(tree))


@pytest.mark.parametrize("mesh", [False, True])
def test_a_frozen_state_holds_the_params_only_and_round_trips(tmp_path, mesh):
    kw = {"mesh": make_mesh8()} if mesh else {}
    cfg = ema_step_config("sdpo", 2)
    trained = st.TrainStep(TINY, cfg, **kw).init(tiny_params(0), 0)
    ts = st.TrainStep(TINY, cfg, trains=False, **kw)
    state = ts.init(tiny_params(0), 0)
    assert state.opt_state == {} and state.teacher == {}
    assert _leaves(trained.opt_state) > 0 and _leaves(trained.teacher) > 0  # (what it drops)
    np.testing.assert_array_equal(jax.tree.leaves(state.params)[0],
                                  jax.tree.leaves(trained.params)[0])
    abstract = ts.abstract_state()
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    if mesh:
        assert jax.tree.structure(ts.state_shardings()) == jax.tree.structure(state)
    with pytest.raises(ValueError, match="trains=False"):
        ts.step(state, _batch(0))

    ck = Checkpointer(tmp_path / "ck", max_to_keep=1)
    ck.save(3, state)
    ck.wait()
    r = ck.restore(abstract)
    assert r.step == 3
    for a, b in zip(jax.tree.leaves(r.state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
