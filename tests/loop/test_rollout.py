"""pmd_jax.loop.rollout's problem stream: every problem once per epoch, and a resume from the
saved data cursor draws what the uninterrupted stream would have."""

from pmd_jax.loop.rollout import DataCursor, ProblemStream


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
