"""The pool's selection rule: a Pareto front over per-problem validation reward (FST keeps its
fast-weight pool "as a Pareto-frontier population", review Figure 1; GEPA's candidate pool)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def dominates(a: np.ndarray, b: np.ndarray) -> bool:
    """``a`` is at least as good as ``b`` on every problem and better on one."""
    return bool(np.all(a >= b) and np.any(a > b))


def pareto_front(scores: Sequence[Sequence[float]], cap: int) -> tuple[list[int], int]:
    """The candidates kept (indices, ascending) and the front's size before the cap.

    ``scores[c][p]``: candidate c's reward on validation problem p. A candidate dominated by
    another (>= on every problem, > on one) is dropped; of candidates with identical scores the
    first (the older pool member: the pool lists them first) is kept. When more than ``cap``
    remain, those that reach the best score on the most problems are kept (GEPA samples a
    parent by that count), then the higher mean, then the older.
    """
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    s = np.asarray(scores, np.float64)
    if s.ndim != 2:
        raise ValueError(f"scores must be [candidates, problems], got shape {s.shape}")
    n = s.shape[0]
    keep = []
    for i in range(n):
        if any(dominates(s[j], s[i]) or (j < i and np.array_equal(s[j], s[i]))
               for j in range(n) if j != i):
            continue
        keep.append(i)
    front = len(keep)
    if front > cap:
        best = s[keep].max(axis=0)
        wins = {i: int((s[i] >= best).sum()) for i in keep}
        keep = sorted(sorted(keep, key=lambda i: (-wins[i], -float(s[i].mean()), i))[:cap])
    return keep, front
