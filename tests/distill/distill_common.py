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
