"""pmd_jax.loop.teaching's demonstrations: which successful rollout of its group each rollout's
teacher is shown (never its own with ``exclude_self``)."""

import numpy as np
import pytest

from pmd_jax.loop.teaching import select_demonstrations


def test_select_demonstrations_excludes_self():
    r = np.array([[0, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]], float)
    d = select_demonstrations(r, threshold=1.0, exclude_self=True)
    # group 0: first success is 1; rollout 1's own success excluded -> next success 3
    assert d[0].tolist() == [1, 3, 1, 1]
    # group 1: lone success gets no demonstration; others see it
    assert d[1].tolist() == [-1, 0, 0, 0]
    assert d[2].tolist() == [-1, -1, -1, -1]
    d2 = select_demonstrations(r, threshold=1.0, exclude_self=False)
    assert d2[1].tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="groups, rollouts"):
        select_demonstrations(np.zeros(3), 1.0)
