"""The loop's count of non-finite updates in a row (distill/train.count_nonfinite)."""

import math

import pytest

from pmd_jax.distill.train import count_nonfinite
from pmd_jax.phases import TrainingError


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
