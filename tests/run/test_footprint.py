"""pmd_jax.run.footprint: array bytes by role, RSS, and handing the C heap's free pages back."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from pmd_jax.run import footprint


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


_MMAP_PROBE = r"""
import ctypes, json, sys
from pmd_jax.run import footprint

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

class MI2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc.mallinfo2.restype = MI2
mib = float(sys.argv[1])
ok = footprint.set_mmap_threshold(mib)
size = 4 << 20
first = libc.malloc(size)  # above the default's initial 128 KiB: mmapped either way
libc.free(first)  # glibc's dynamic threshold now rises above 4 MiB (without a fixed one)
before = libc.mallinfo2().hblkhd
p = libc.malloc(size)
during = libc.mallinfo2().hblkhd
libc.free(p)
after = libc.mallinfo2().hblkhd
print(json.dumps({"ok": ok, "mapped": during - before, "unmapped": during - after}))
"""


def _has_mallinfo2() -> bool:
    import ctypes

    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")  # glibc >= 2.33
    except OSError:
        return False


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc's mallopt and mallinfo2")
@pytest.mark.parametrize("mib,mapped", [(1.0, True), (0.0, False)])
def test_set_mmap_threshold_serves_large_blocks_by_mmap(mib, mapped):
    """glibc's own accounting (mallinfo2's mmapped bytes), in a fresh process: with a fixed
    1 MiB threshold a 4 MiB block is mmapped each time and unmapped on free; with glibc's
    dynamic default (0: left alone) freeing the first such block raises the threshold, so the
    second comes from the heap, where it stays resident once freed."""
    import json
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # pmd_jax importable from any working directory
    out = subprocess.run([sys.executable, "-c", _MMAP_PROBE, str(mib)], check=True,
                         capture_output=True, text=True, cwd=root).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["ok"] is mapped
    if mapped:
        assert r["mapped"] >= 4 << 20 and r["unmapped"] >= 4 << 20, r
    else:
        assert r["mapped"] == 0 and r["unmapped"] == 0, r


def test_set_mmap_threshold_without_mallopt(monkeypatch):
    monkeypatch.setattr(footprint, "_mallopt", lambda: None)
    assert footprint.set_mmap_threshold(8.0) is False


def test_drop_compiled_empties_the_program_caches_and_changes_no_result():
    """drop_compiled: a jitted function's programs for three shapes are gone from memory, and
    the next call (compiled again) gives the same bits."""
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0))
    xs = [np.random.default_rng(n).normal(size=(n, 8)).astype(np.float32) for n in (3, 5, 7)]
    before = [np.asarray(f(x)) for x in xs]
    assert f._cache_size() == 3
    footprint.drop_compiled()
    assert f._cache_size() == 0
    for x, b in zip(xs, before, strict=True):
        np.testing.assert_array_equal(np.asarray(f(x)), b)
