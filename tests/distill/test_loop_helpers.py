"""Helpers of the loop: the count of non-finite updates in a row (distill/train.count_nonfinite)
and the cadence of the KL to the initial policy (distill/kl.kl_due)."""

import math

import pytest

from pmd_jax.distill.kl import kl_due
from pmd_jax.distill.train import count_nonfinite
from pmd_jax.loop.phases import TrainingError


def test_finite_step_resets_the_count():
    assert count_nonfinite({"loss": 0.5, "finite": True}, 2, 3, step=7) == 0
    assert count_nonfinite({}, 2, 3, step=7) == 0  # pmd_frozen_policy: no update, no metrics


@pytest.mark.parametrize("metrics", [
    {"loss": 0.5, "finite": False},  # the step function saw a non-finite gradient
    {"loss": math.nan, "finite": True},
    {"loss": math.inf},
])
def test_nonfinite_step_counts_and_stops_at_the_limit(metrics, caplog):
    assert count_nonfinite(metrics, 0, 3, step=4) == 1
    assert "step 4: non-finite loss or gradient; update skipped (1 in a row)" in caplog.text
    assert count_nonfinite(metrics, 1, 3, step=5) == 2
    with pytest.raises(TrainingError, match="3 non-finite updates in a row at step 6"):
        count_nonfinite(metrics, 2, 3, step=6)


def test_kl_cadence_meets_the_evaluations():
    # Every step by default; 0 never; with N = eval_every the measured steps are the ones whose
    # sampling policy the evaluations at 0, N, 2N see (their accuracy-vs-KL points).
    assert [s for s in range(5) if kl_due(s, 1)] == [0, 1, 2, 3, 4]
    assert not any(kl_due(s, 0) for s in range(20))
    assert [s for s in range(12) if kl_due(s, 6)] == [0, 6]
    assert [s for s in range(10) if kl_due(s, 4)] == [0, 4, 8]
