"""Where a run's host memory goes: array bytes by role, and the process's resident set.

On CPU the "device" is host RAM, so every copy of the weights the loop keeps is resident: the
trainable params, AdamW's two moments, the EMA teacher, the initial policy (the KL-to-initial
reference and what the sampler started from), the sampler's per-layer copy (its decode loop
reads layer weights in place), the memory's embedder. Around them XLA allocates temporaries
per compiled program (activations, logits chunks, KV caches) and holds the programs
themselves. :func:`breakdown` sums the first group from the live trees; ``rss_*`` read the
kernel's view of the whole process (``/proc/self/status``), so the difference is XLA's
temporaries, compiled programs, Python and the allocator's cache.

The allocator's cache: XLA:CPU allocates each program's temporaries, every array and its
compiler's working memory with ``malloc``; glibc serves blocks under its (dynamic, up to
32 MiB) mmap threshold from heap arenas and keeps them resident once freed. The per-layer
arrays a publish replaces, a compile's working memory and an orbax checkpoint's write buffers
(each freed when done) stayed resident that way: on the embedded default 1.0-1.9 GiB of the
heap was free but resident during the evaluation after step 1. :func:`release_free_memory`
(``malloc_trim``) hands such pages back to the kernel; the trainer calls it after every
phase. It moves no array and changes no number. Inside a phase (an evaluation's batches, a
behavior round's caches) freed blocks still pile up until the next trim;
:func:`set_mmap_threshold` (``train.malloc_mmap_threshold_mib``, set by ``pmd_jax.main``
before the model loads) gives every block above a fixed size its own mapping, unmapped on
free, which bounds that pile to the blocks under it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import resource
import sys
from collections.abc import Mapping
from typing import Any

import jax

GiB = 1024**3


def tree_bytes(tree: Any, seen: set[int] | None = None) -> int:
    """Bytes of the distinct arrays in a pytree (an array reached twice counts once)."""

    seen = set() if seen is None else seen
    total = 0
    for leaf in jax.tree.leaves(tree):
        nbytes = getattr(leaf, "nbytes", None)
        if nbytes is None or id(leaf) in seen:
            continue
        seen.add(id(leaf))
        total += int(nbytes)
    return total


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_gib() -> float:
    """Resident set size now (0.0 where /proc is missing)."""
    kib = _status_kib("VmRSS")
    return (kib or 0) / 1024**2


def peak_rss_gib() -> float:
    """The process's peak resident set size so far (getrusage: KiB on Linux, bytes on macOS;
    at least the RSS now: the kernel updates its high-water mark lazily)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(peak / (GiB if sys.platform == "darwin" else 1024**2), rss_gib())


def _glibc(name: str, argtypes: list[Any]) -> Any:
    """The C library's function ``name`` returning an int (None where there is none: not
    Linux, or a C library without it, e.g. musl's ``malloc_trim``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``."""
    return _glibc("malloc_trim", [ctypes.c_size_t])


def release_free_memory() -> bool:
    """Return the C heap's free pages to the kernel (glibc ``malloc_trim(0)``: every arena,
    free pages inside the heap too, not only at its top). Memory in use is untouched, so no
    array moves and no result changes; the next allocations fault fresh pages in. Returns
    whether anything was released (False where there is no ``malloc_trim``)."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD_MAX_MIB = 32  # glibc's upper bound on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)


@functools.cache
def _mallopt() -> Any:
    """glibc's ``mallopt``."""
    return _glibc("mallopt", [ctypes.c_int, ctypes.c_int])


def set_mmap_threshold(mib: float) -> bool:
    """Serve every C-heap block of at least ``mib`` MiB by its own ``mmap``, so that freeing
    it hands its pages straight back to the kernel (glibc ``mallopt(M_MMAP_THRESHOLD)``; a
    fixed threshold also turns off glibc's dynamic one, which climbs to 32 MiB after the first
    such block is freed and from then on keeps every freed block under that size resident in
    the heap until :func:`release_free_memory`). ``mib <= 0`` leaves glibc's default alone.
    Returns whether the threshold was set (False: no glibc, or glibc refused the value)."""
    if mib <= 0:
        return False
    fn = _mallopt()
    return bool(fn(M_MMAP_THRESHOLD, int(mib * 1024**2))) if fn is not None else False


def breakdown(parts: Mapping[str, Any]) -> dict[str, float]:
    """GiB per named tree, arrays shared between trees counted under the first name only,
    plus ``rss`` (now) and ``rss_peak``."""
    seen: set[int] = set()
    out = {name: tree_bytes(tree, seen) / GiB for name, tree in parts.items() if tree is not None}
    out["arrays_total"] = sum(out.values())
    out["rss"] = rss_gib()
    out["rss_peak"] = peak_rss_gib()
    return out


def format_breakdown(b: Mapping[str, float]) -> str:
    named = ", ".join(f"{k} {v:.2f}" for k, v in b.items()
                      if k not in ("arrays_total", "rss", "rss_peak"))
    rest = b.get("rss", 0.0) - b.get("arrays_total", 0.0)
    return (f"host memory (GiB): {named}; arrays {b.get('arrays_total', 0.0):.2f}; "
            f"process RSS {b.get('rss', 0.0):.2f} (peak {b.get('rss_peak', 0.0):.2f}; "
            f"{rest:.2f} beyond these arrays: XLA temporaries and programs, Python, allocator)")


def drop_compiled() -> float:
    """Drops jax's in-memory compiled programs and trace caches (``jax.clear_caches``), then
    hands the freed pages back; returns the GiB of RSS it gave back.

    Every new input shape of a jitted function leaves its executable resident (XLA:CPU, the
    embedded default: about 19 MB per train-step shape, 11 MB per KL forward, a few MB per
    prefill / cache-placement shape), and a run's shapes keep changing with its prompt
    lengths: on the embedded default the RSS between steps rose by ~0.2 GiB a step, 1.2 GiB by
    step 6. A program needed again is loaded from the persistent compilation cache
    (``train.compilation_cache_dir``) or compiled again. Called by the loop between steps
    (``train.clear_compiled_every``), when no other thread runs jax code."""

    before = rss_gib()
    jax.clear_caches()
    release_free_memory()
    return before - rss_gib()

