"""Shared by the train-step tests (test_step, test_microbatch): 8 fake CPU devices, the tiny
decoder they train and the 2 x 2 x 2 mesh.

Import this module before ``jax`` in a test file: ``XLA_FLAGS`` is read when the CPU backend
starts, so the device count must be set before the first array is made.
"""

from __future__ import annotations

import jax  # noqa: E402

from pmd_jax import sharding as shd  # noqa: E402
from pmd_jax.models.config import ModelConfig  # noqa: E402

TINY = ModelConfig(
    family="llama", vocab_size=48, hidden_size=16, intermediate_size=32, num_layers=2,
    num_heads=2, num_kv_heads=2, head_dim=8, tie_embeddings=False,
)


def make_mesh8() -> jax.sharding.Mesh:
    """The data x fsdp x tensor = 2 x 2 x 2 mesh of the 8 fake devices."""
    assert len(jax.devices()) == 8, "XLA_FLAGS must give 8 CPU devices"
    return shd.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})


def small_distill_config(**kw):
    """The distill ConfigDict the step tests train TINY with (top-K 8, GRPO groups of 2, lr
    3e-3 from step 0); ``section__knob=value`` overrides."""
    from pmd_jax.distill.config import default_distill_config

    c = default_distill_config()
    c.loss.topk = 8
    c.loss.group_size = 2
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 0
    for k, v in kw.items():
        sec, name = k.split("__")
        c[sec][name] = v
    return c
