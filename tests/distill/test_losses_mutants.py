"""Tests written for the losses' mutation survivors (docs/mutation.md): truncated IS weights
against the formula verl documents, written out in numpy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.distill.losses import truncated_is_weights


def _reference(trainer: np.ndarray, sampler: np.ndarray, threshold: float) -> np.ndarray:
    """min(exp(clip(trainer - sampler, -20, 20)), threshold) in float64."""
    return np.minimum(np.exp(np.clip(trainer - sampler, -20.0, 20.0)), threshold)


@pytest.mark.parametrize("threshold", [0.5, 2.0, 1e9])
def test_truncated_is_weights_follow_the_formula_at_extreme_ratios(threshold):
    """Log-ratios far outside [-20, 20] are clipped (below: exp(-20), not 0; above: no
    overflow, so the threshold binds), and any positive threshold, 0.5 included, is
    accepted and applied; a bf16 input gives float32 weights (the trainer's dtype)."""
    trainer = np.array([[0.0, -50.0, 30.0, -1.0, 1e4]], np.float32)
    sampler = np.array([[0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    got = np.asarray(truncated_is_weights(jnp.asarray(trainer), jnp.asarray(sampler),
                                          threshold))
    np.testing.assert_allclose(got, _reference(trainer.astype(np.float64), sampler, threshold),
                               rtol=1e-6)
    assert got[0, 1] > 0.0
    half = truncated_is_weights(jnp.asarray(trainer, jnp.bfloat16),
                                jnp.asarray(sampler, jnp.bfloat16), threshold)
    assert half.dtype == jnp.float32


@pytest.mark.parametrize("threshold", [0.0, -1.0])
def test_a_threshold_that_is_not_positive_is_refused(threshold):
    x = jnp.zeros((1, 3))
    with pytest.raises(ValueError, match=r"IS threshold must be > 0, got "):
        truncated_is_weights(x, x, threshold)


def test_the_default_threshold_is_verls_2():
    x = jnp.zeros((1, 2))
    w = truncated_is_weights(x + 5.0, x)
    np.testing.assert_allclose(np.asarray(w), [[2.0, 2.0]])


def test_masked_weights_are_zero_and_a_wrong_mask_is_named():
    x = jnp.zeros((1, 3))
    w = truncated_is_weights(x, x, 2.0, mask=jnp.asarray([[1, 0, 1]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(w), [[1.0, 0.0, 1.0]])
    assert w.dtype == jnp.float32
    with pytest.raises(ValueError, match="IS weights/mask"):
        truncated_is_weights(x, x, 2.0, mask=jnp.ones((1, 2)))
    with pytest.raises(ValueError, match="trainer/sampler token log-probs"):
        truncated_is_weights(x, jnp.zeros((1, 2)), 2.0)
