"""Shared by the train-step tests (test_step, test_microbatch): the tiny decoder they train
(``tests.fakes.tiny_model_config``'s step shape) and the 2 x 2 x 2 mesh of the 8 fake CPU
devices tests/conftest.py sets."""

from __future__ import annotations

import jax

from pmd_jax.run import sharding as shd
from tests.fakes import tiny_model_config
from tests.host import need_devices

TINY = tiny_model_config()


def make_mesh8() -> jax.sharding.Mesh:
    """The data x fsdp x tensor = 2 x 2 x 2 mesh of the 8 fake devices (skips the calling test
    or fixture, naming the count, where jax has fewer: a one-GPU host)."""
    __tracebackhide__ = True
    return shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, devices=need_devices(8))


def small_distill_config(**kw):
    """The frozen distill config the step tests train TINY with (top-K 8, GRPO groups of 2, lr
    3e-3 from step 0); ``section__knob=value`` overrides."""
    from pmd_jax.distill.config import default_distill_config, freeze_distill_config

    c = default_distill_config()
    c.loss.topk = 8
    c.loss.group_size = 2
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 0
    for k, v in kw.items():
        sec, name = k.split("__")
        c[sec][name] = v
    return freeze_distill_config(c)


def ema_step_config(mode: str, group: int):
    """The frozen distill config of the step-equivalence tests (test_microbatch,
    test_shared_prefix): loss ``mode`` with an EMA teacher (rate 0.1), top-K 8, loss chunks of
    3, GRPO groups of ``group``, hybrid lambda 0.6, lr 1e-3 from step 0."""
    from pmd_jax.distill.config import default_distill_config, freeze_distill_config

    c = default_distill_config()
    c.loss.name = mode
    c.teacher.rule = "ema"
    c.teacher.rate = 0.1
    c.loss.topk = 8
    c.loss.chunk_size = 3
    c.loss.group_size = group
    c.loss.hybrid_lambda = 0.6
    c.optim.lr = 1e-3
    c.optim.warmup_steps = 0
    return freeze_distill_config(c)


def tiny_params(seed: int):
    from pmd_jax.models import decoder

    return decoder.init_params(TINY, jax.random.PRNGKey(seed))


def start_state(ts):
    """``ts.init`` from ``tiny_params(0)``, with a teacher that differs from the student (so
    the teacher gives a signal)."""
    state = ts.init(tiny_params(0), 0)
    if state.teacher:
        state = state.replace(teacher=jax.tree.map(
            lambda t, p: jax.device_put(p, t.sharding), state.teacher, tiny_params(7)))
    return state


def assert_same_steps(got, want, tol) -> None:
    """``(state, [metrics per step])`` pairs: every metric of every step and the params,
    optimizer state and teacher agree within ``tol`` (assert_allclose keywords)."""
    import numpy as np

    (s_a, ms_a), (s_b, ms_b) = got, want
    for i, (ma, mb) in enumerate(zip(ms_a, ms_b, strict=True)):
        assert set(ma) == set(mb)
        for k in mb:
            np.testing.assert_allclose(ma[k], mb[k], **tol, err_msg=f"step {i} metric {k}")
    for name in ("params", "opt_state", "teacher"):
        la = jax.tree_util.tree_leaves_with_path(getattr(s_a, name))
        lb = jax.tree.leaves(getattr(s_b, name))
        assert len(la) == len(lb)
        for (path, a), b in zip(la, lb, strict=True):
            np.testing.assert_allclose(a, b, **tol,
                                       err_msg=f"{name}{jax.tree_util.keystr(path)}")
