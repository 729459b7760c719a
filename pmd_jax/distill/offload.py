"""A param tree kept in a file instead of memory, loaded when it is needed.

The initial policy is read once per KL measurement (``distill/kl.py``) and by nothing else, so
holding it resident costs one copy of the weights for a forward a step (0.50 GiB of the
embedded default's 2.90 GiB of arrays; on CPU the "device" is host RAM). With
``train.offload_initial_policy`` the loop writes it once to a file in the system temp
directory (``TMPDIR``; every leaf's raw bytes, 64-byte aligned; named by the run directory;
removed when the run ends or the process exits) and :meth:`DiskParams.load` maps the file and
places each leaf with the sharding it had: the same values bit for bit, and the mapping's
pages leave the process with the arrays. Each process writes, and reads back, the shards it
holds (its own file: ``_p<process index>``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pmd_jax.run import footprint
from pmd_jax.tasks.sandbox.sweep import proc_start_time  # (a live process's start, or None)

log = logging.getLogger(__name__)

_ALIGN = 64
_COLLECT_EVERY = 256 * 2**20  # load(): collect the host copies every this many bytes


@dataclasses.dataclass(frozen=True)
class _Shard:
    offset: int
    shape: tuple[int, ...]
    device: Any


@dataclasses.dataclass(frozen=True)
class _Leaf:
    shape: tuple[int, ...]
    dtype: Any
    sharding: Any  # None: a host value (numpy), loaded as one
    shards: tuple[_Shard, ...]


@dataclasses.dataclass(frozen=True)
class DiskParams:
    """The file and the layout of a param tree written by :meth:`write`."""

    path: Path
    treedef: Any
    leaves: tuple[_Leaf, ...]
    nbytes_on_disk: int

    @classmethod
    def write(cls, tree: Any, path: str | os.PathLike) -> DiskParams:
        """Writes the shards of ``tree``'s leaves that this process holds to ``path`` (a
        shard replicated on several devices once; atomically: a temporary file, then a
        rename) and returns the handle that loads them back."""

        path = Path(path)
        flat, treedef = jax.tree.flatten(tree)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            leaves, offset = cls._write_leaves(flat, tmp)
        except BaseException:
            # a failed write (a full disk: the Qwen grid's 4.7 GiB of moments once) leaves no
            # partial file behind to fill the disk further
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
        return cls(path, treedef, tuple(leaves), offset)

    @staticmethod
    def _write_leaves(flat: list[Any], tmp: Path) -> tuple[list[_Leaf], int]:
        leaves: list[_Leaf] = []
        offset = 0
        with open(tmp, "wb") as f:
            def put(a: np.ndarray) -> int:
                nonlocal offset
                pad = -offset % _ALIGN
                f.write(b"\0" * pad)
                start = offset + pad
                f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)  # no copy
                offset = start + a.nbytes
                return start

            for x in flat:
                if not isinstance(x, jax.Array):
                    a = np.asarray(x)
                    leaves.append(_Leaf(a.shape, a.dtype, None, (_Shard(put(a), a.shape, None),)))
                    continue
                written: dict[str, int] = {}  # the shard's index -> its offset
                shards = []
                for sh in x.addressable_shards:
                    key = repr(sh.index)
                    if key not in written:
                        written[key] = put(np.asarray(sh.data))
                    shards.append(_Shard(written[key], tuple(sh.data.shape), sh.device))
                leaves.append(_Leaf(tuple(x.shape), x.dtype, x.sharding, tuple(shards)))
        return leaves, offset

    @classmethod
    def write_temp(cls, tree: Any, key: str, kind: str = "initial_policy") -> DiskParams:
        """:meth:`write` to the system temp directory, removed at exit. The file is named by
        ``key`` (the run directory), so a run restarted after a kill overwrites the file its
        killed attempt left instead of adding one."""

        digest = hashlib.sha1(key.encode()).hexdigest()[:16]
        name = f"pmd_jax_{kind}_{digest}_p{jax.process_index()}.bin"
        _remove_dead_writers_temps(Path(tempfile.gettempdir()), name)
        out = cls.write(tree, Path(tempfile.gettempdir()) / name)
        atexit.register(out.remove)  # (a second registration of a removed file is a no-op)
        return out

    def load(self) -> Any:
        """The tree, each leaf placed with the sharding it had when written."""

        if not self.path.is_file() or self.path.stat().st_size != self.nbytes_on_disk:
            raise FileNotFoundError(f"{self.path}: the offloaded arrays' file is missing or "
                                    f"not {self.nbytes_on_disk} bytes (was it deleted?)")
        # Read into fresh arrays rather than through a mapping: pages of a mapped file count
        # in the process's resident set while it is mapped, so a mapping of the whole file
        # held the loaded tree twice by the end of the load (2.70 GiB peak for a 1 GiB tree).
        f = open(self.path, "rb")

        def read(leaf: _Leaf, shard: _Shard) -> np.ndarray:
            a = np.empty(shard.shape, leaf.dtype)
            f.seek(shard.offset)
            flat = a.reshape(-1).view(np.uint8)
            if f.readinto(flat.data) != flat.nbytes:
                raise FileNotFoundError(f"{self.path}: ended before the leaf at byte "
                                        f"{shard.offset} (was it changed?)")
            return a

        def place(leaf: _Leaf, shard: _Shard) -> jax.Array:
            return jax.device_put(read(leaf, shard), shard.device)

        out: list[np.ndarray | jax.Array] = []
        pending = 0  # bytes read since the last collection
        with f:
            for leaf in self.leaves:
                if leaf.sharding is None:  # a host value stays one
                    out.append(read(leaf, leaf.shards[0]))
                    continue
                out.append(jax.make_array_from_single_device_arrays(
                    leaf.shape, leaf.sharding, [place(leaf, s) for s in leaf.shards]
                ).block_until_ready())
                # device_put copies the host array and keeps a reference to it that only
                # the cyclic collector drops, once the copy is done: without collecting, the
                # host copies of the whole tree could wait beside the placed arrays (2.07
                # GiB resident after loading a 1 GiB tree; 1.07 collected)
                pending += sum(int(np.prod(s.shape)) for s in leaf.shards) * np.dtype(
                    leaf.dtype).itemsize
                if pending >= _COLLECT_EVERY:
                    gc.collect()
                    pending = 0
        gc.collect()
        return jax.tree.unflatten(self.treedef, out)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


@contextlib.contextmanager
def optimizer_set_aside(bundle: Any, run_key: str, enabled: bool = True) -> Iterator[None]:
    """The optimizer state of ``bundle.state`` waits in a file (its own, named by
    ``run_key``, the run directory, and the process) while the block runs, and comes back bit
    for bit with its shardings after it, even when the block raises; nothing when not
    ``enabled``. For the blocks that read no moments: the KL forward of the initial policy
    (``train.offload_optimizer_during_kl``) and the train step's gradient program
    (``train.offload_optimizer_during_grads``). Nothing reads the moments between one
    update and the next, so neither can see the difference."""
    if not enabled:
        yield
        return

    disk = DiskParams.write_temp(bundle.state.opt_state, f"{run_key}#optimizer",
                                 kind="optimizer")
    bundle.state = bundle.state.replace(opt_state=None)
    footprint.release_free_memory()
    try:
        yield
    finally:
        bundle.state = bundle.state.replace(opt_state=disk.load())
        disk.remove()


def local_nbytes(tree: Any) -> int:
    """Bytes of ``tree`` that this process writes to its file (:meth:`DiskParams.write`):
    each addressable shard once, host values whole."""

    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            seen = {repr(sh.index): sh.data.nbytes for sh in x.addressable_shards}
            total += sum(int(v) for v in seen.values())
        elif hasattr(x, "nbytes"):
            total += int(x.nbytes)
    return total


def temp_files(train_cfg: Any, bundle: Any) -> list[tuple[str, int]]:
    """The files the run's offload options write to the system temp directory, with this
    process's bytes: the initial policy (kept for the whole run) and the optimizer state (one
    file at a time, during the KL forward or the gradient)."""
    out = []
    trains = bundle.step_fn.trains  # (else: no optimizer, and no KL to the initial policy)
    lora = getattr(bundle, "base", None) is not None  # (the initial policy is the base: kept)
    if train_cfg.offload_initial_policy and train_cfg.kl_initial_every > 0 and trains \
            and bundle.initial_params is not None and not lora:
        out.append(("the initial policy (train.offload_initial_policy)",
                    local_nbytes(bundle.initial_params)))
    if trains and (train_cfg.offload_optimizer_during_kl
                   or train_cfg.offload_optimizer_during_grads):
        out.append(("the AdamW moments (train.offload_optimizer_during_kl / _grads)",
                    local_nbytes(bundle.state.opt_state)))
    return out


def _remove_dead_writers_temps(directory: Path, name: str) -> list[Path]:
    """Removes ``<name>.<pid>.tmp`` files whose writer is gone: a process killed while it
    wrote (SIGKILL, the OOM killer) cannot remove its own, and its restart writes under a new
    pid. Returns the removed paths."""

    removed = []
    for p in directory.glob(f"{name}.*.tmp"):
        pid = p.name[len(name) + 1 : -len(".tmp")]
        if not pid.isdigit() or proc_start_time(int(pid)) is not None:  # (alive)
            continue
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
    if removed:
        log.info("removed %d partial file(s) of killed writers: %s", len(removed),
                 ", ".join(str(p) for p in removed))
    return removed
