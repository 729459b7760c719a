"""pmd_jax.footprint: array bytes by role, RSS, and handing the C heap's free pages back."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from pmd_jax import footprint


def test_breakdown_counts_shared_arrays_once():
    a, b = np.zeros(1024, np.float32), np.zeros(256, np.float32)
    out = footprint.breakdown({"x": {"a": a, "b": b}, "y": [a]})
    assert out["x"] * footprint.GiB == a.nbytes + b.nbytes
    assert out["y"] == 0.0
    assert 0 < out["rss"] <= out["rss_peak"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_release_free_memory_returns_freed_heap_pages():
    """Blocks under glibc's mmap threshold stay resident once freed when a live block above
    them pins the heap's top; malloc_trim hands the free pages back (the trainer calls it after
    every phase). The arrays in use are kept."""
    keep = np.arange(1 << 16, dtype=np.float64)
    footprint.release_free_memory()
    base = footprint.rss_gib()
    blocks = [b"\x01" * (64 << 10) for _ in range(4096)]  # 256 MiB of 64 KiB heap blocks
    pin = b"\x02" * (64 << 10)  # allocated last: the heap cannot shrink from its top
    grown = footprint.rss_gib()
    del blocks
    freed = footprint.rss_gib()
    assert footprint.release_free_memory() is True
    trimmed = footprint.rss_gib()
    assert grown - base > 0.2, (base, grown)  # the blocks were resident
    assert freed - trimmed > 0.15, (grown, freed, trimmed)  # free() alone kept most of them
    assert pin[0] == 2
    np.testing.assert_array_equal(keep, np.arange(1 << 16, dtype=np.float64))


def test_release_free_memory_without_malloc_trim(monkeypatch):
    monkeypatch.setattr(footprint, "_malloc_trim", lambda: None)
    assert footprint.release_free_memory() is False
