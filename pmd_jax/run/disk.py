"""The disk a run's checkpoints need, measured before the first one is written.

One checkpoint holds the params, both AdamW moments, the teacher and the slot values (the
memory, the data cursor, a mode's state). Orbax writes the next step in full before it deletes
the old one, so keeping N takes N + 1 checkpoints of disk while one is written.
:func:`disk_plan` estimates one checkpoint's bytes from the train state's arrays (an upper
bound: orbax compresses), adds what is already there and the HF export, and compares it with
the free space; :meth:`DiskPlan.check` refuses a run that cannot hold two (``main``: one line,
exit 2). A ``gs://`` run directory is not measured.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import jax

from pmd_jax.run import footprint, paths
from pmd_jax.run.host_state import encode

log = logging.getLogger(__name__)

# Bytes of a checkpoint beyond its arrays and slot values: orbax's metadata files, the OCDBT
# manifests and our commit marker; per array and fixed (a tiny model's 80 arrays: ~55 KB).
CHECKPOINT_OVERHEAD_BYTES = 64 << 10
CHECKPOINT_OVERHEAD_PER_ARRAY = 1 << 10


class DiskSpaceError(RuntimeError):
    """The run directory's file system cannot hold the two checkpoints a run needs (the kept
    one and the next, written in full before the old one is deleted), or the system temp
    directory the files of the offload options (:func:`check_temp_space`); raised at
    start-up."""


def slot_bytes(value: Any) -> int:
    """Bytes of one slot value as ``RunCheckpointer.save`` (:mod:`pmd_jax.run.checkpoint`)
    writes it: ``bytes`` as they are, anything else (a JSON value, the memory's or the mode's
    state) as host state (``run/host_state.py``: JSON + arrays)."""
    if value is None:
        return 0
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    st = encode(value)
    return len(st.doc_bytes()) + sum(int(a.nbytes) for a in st.arrays)


def checkpoint_bytes(state: Any, slots: Mapping[str, Any] | None = None) -> int:
    """Bytes one checkpoint takes at most: every array of ``state`` uncompressed (each leaf
    once, at its dtype, whatever its sharding; orbax's compression takes 10-20% off trained
    float arrays, far more off the zero moments of a run that has not stepped), the slot
    values, and orbax's metadata (:data:`CHECKPOINT_OVERHEAD_BYTES`, and
    :data:`CHECKPOINT_OVERHEAD_PER_ARRAY` each). A slot that grows during the run (the
    memory) counts at its size now."""
    leaves = [x for x in jax.tree.leaves(state) if hasattr(x, "nbytes")]
    return (sum(int(x.nbytes) for x in leaves) + sum(slot_bytes(v) for v in (slots or {}).values())
            + CHECKPOINT_OVERHEAD_BYTES + CHECKPOINT_OVERHEAD_PER_ARRAY * len(leaves))


def export_bytes(params: Any) -> int:
    """Bytes of the final HF export (``train.export_hf``, :func:`pmd_jax.loop.export.export_hf`):
    float32 params as float32, any other dtype as bfloat16."""
    return sum(int(x.size) * (4 if x.dtype == "float32" else 2)
               for x in jax.tree.leaves(params) if hasattr(x, "size"))


def free_bytes(directory: str | os.PathLike) -> int | None:
    """Free bytes on ``directory``'s file system for this user (None for a remote URL: a
    bucket has no such number)."""
    if paths.is_remote(directory):
        return None
    return int(shutil.disk_usage(os.fspath(directory)).free)


def check_temp_space(files: list[tuple[str, int]]) -> str:
    """One line for the start-up log: the temp files the run's offload options write
    (:func:`pmd_jax.distill.offload.temp_files`) against the free space of the system temp
    directory. Raises :class:`DiskSpaceError` when they cannot fit, naming the options and
    the directory, before the run computes anything (a full temp disk would otherwise stop
    it at the first write, mid-step)."""

    directory = tempfile.gettempdir()
    need = sum(n for _, n in files)
    free = free_bytes(directory)
    what = "; ".join(f"{name} ~{_size(n)}" for name, n in files)
    if free is not None and free < need:
        raise DiskSpaceError(
            f"not enough disk in the system temp directory {directory} for the files of the "
            f"offload options: {what}: ~{_size(need)} needed, {_size(free)} free. Point "
            "TMPDIR at a larger disk, free space there or turn those options off")
    return f"temp files: {what}; free in {directory}: " + (
        "not measured" if free is None else _size(free))


def _size(n: float) -> str:
    return f"{n / footprint.GiB:.2f} GiB" if n >= footprint.GiB / 10 else \
        f"{n / 1024**2:.1f} MiB"


@dataclasses.dataclass(frozen=True)
class DiskPlan:
    """What a run's checkpoints take on disk. Orbax writes a new step in full and deletes the
    oldest only after the new one is committed, so keeping ``keep`` takes ``keep + 1`` while
    the next one is written; ``present`` committed steps are already on disk (a resumed run)."""

    directory: str
    one: int  # estimated bytes of one checkpoint (checkpoint_bytes)
    keep: int  # train.keep_checkpoints
    present: int = 0
    free: int | None = None  # free bytes on its file system (None: remote, not measured)
    export: int = 0  # the final HF export (train.export_hf), written at the end

    @property
    def peak(self) -> int:
        """Bytes the checkpoints take at most: ``keep`` kept and the next being written."""
        return (self.keep + 1) * self.one

    @property
    def to_start(self) -> int:
        """Free bytes needed to start: room for two checkpoints, less those already there
        (the next one always needs its own room)."""
        return max(1, 2 - self.present) * self.one

    @property
    def to_finish(self) -> int:
        """Free bytes needed for ``keep`` checkpoints and the final export."""
        return max(1, self.keep + 1 - self.present) * self.one + self.export

    def describe(self) -> str:
        there = f", {self.present} there already" if self.present else ""
        export = (f"; the final HF export's weights ~{_size(self.export)}" if self.export
                  else "")
        free = ("not measured (remote)" if self.free is None else _size(self.free))
        return (f"checkpoints: one takes up to ~{_size(self.one)}; keeping {self.keep} "
                f"(train.keep_checkpoints) needs ~{_size(self.peak)} ({self.keep + 1} while the "
                f"next is written{there}){export}; free on {self.directory}: {free}")

    def check(self) -> None:
        """Raises DiskSpaceError when the free space cannot hold the two checkpoints a run
        needs; logs a warning when it cannot hold what the run keeps and exports."""
        if self.free is None:
            return
        if self.free < self.to_start:
            raise DiskSpaceError(
                f"not enough disk for checkpoints in {self.directory}: one takes up to "
                f"~{_size(self.one)} and a run needs room for two (the kept one and the next, "
                f"written in full before the old one is deleted): ~{_size(self.to_start)} "
                f"free needed, {_size(self.free)} free. Free space there or set run_dir to a "
                "folder on a larger disk")
        if self.free < self.to_finish:
            log.warning(
                "checkpoints: keeping %d (train.keep_checkpoints)%s needs ~%s free, %s free on "
                "%s: the disk fills before the run ends; lower train.keep_checkpoints (1 keeps "
                "the last only) or free space", self.keep,
                " and the final HF export" if self.export else "", _size(self.to_finish),
                _size(self.free), self.directory)


def disk_plan(directory: str | os.PathLike, state: Any, slots: Mapping[str, Any] | None = None,
              *, keep: int, present: int = 0, export: int = 0) -> DiskPlan:
    """The :class:`DiskPlan` of checkpoints of ``state`` (+ ``slots``) under ``directory``."""
    return DiskPlan(directory=os.fspath(directory), one=checkpoint_bytes(state, slots),
                    keep=int(keep), present=int(present), free=free_bytes(directory),
                    export=int(export))
