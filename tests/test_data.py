import numpy as np
import pytest

from pmd_jax.rollout import DataCursor, ProblemStream
from pmd_jax.teaching import select_demonstrations


def test_stream_covers_each_epoch_once_and_resumes_exactly():
    items = list(range(10))
    s = ProblemStream(items, seed=3)
    first = s.next_batch(4) + s.next_batch(4) + s.next_batch(2)
    assert sorted(first) == items  # one epoch: every problem once
    assert s.cursor == DataCursor(1, 0)
    a = ProblemStream(items, seed=3)
    a.next_batch(7)
    saved = a.cursor.state_dict()
    expect = a.next_batch(6)  # crosses into epoch 1
    b = ProblemStream(items, seed=3, cursor=DataCursor.from_state(saved))
    assert b.next_batch(6) == expect
    assert ProblemStream(items, seed=4).next_batch(10) != first


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
