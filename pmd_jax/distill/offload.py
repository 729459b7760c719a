"""A param tree kept in a file instead of memory, loaded when it is needed.

The initial policy is read once per KL measurement (``distill/kl.py``) and by nothing else, so
holding it resident costs one copy of the weights for a forward a step (0.50 GiB of the
embedded default's 2.90 GiB of arrays; on CPU the "device" is host RAM). With
``train.offload_initial_policy`` the loop writes it once to a file in the system temp
directory (``TMPDIR``; every leaf's raw bytes, 64-byte aligned; named by the run directory;
removed when the run ends or the process exits) and :meth:`DiskParams.load` maps the file and
places each leaf with the sharding it had: the same values bit for bit, and the mapping's
pages leave the process with the arrays. Single-process only (each leaf is written whole).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class _Leaf:
    offset: int
    shape: tuple[int, ...]
    dtype: Any
    sharding: Any


@dataclasses.dataclass(frozen=True)
class DiskParams:
    """The file and the layout of a param tree written by :meth:`write`."""

    path: Path
    treedef: Any
    leaves: tuple[_Leaf, ...]
    nbytes_on_disk: int

    @classmethod
    def write(cls, tree: Any, path: str | os.PathLike) -> DiskParams:
        """Writes ``tree``'s leaves to ``path`` (atomically: a temporary file, then a rename)
        and returns the handle that loads them back."""
        import jax

        if jax.process_count() > 1:
            raise ValueError("train.offload_initial_policy is single-process only: each "
                             "process would need the whole tree in its own file")
        path = Path(path)
        flat, treedef = jax.tree.flatten(tree)
        leaves, offset = [], 0
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            for x in flat:
                a = np.asarray(jax.device_get(x))
                pad = -offset % _ALIGN
                f.write(b"\0" * pad)
                offset += pad
                leaves.append(_Leaf(offset, tuple(a.shape), a.dtype,
                                    getattr(x, "sharding", None)))
                f.write(np.ascontiguousarray(a).tobytes())
                offset += a.nbytes
        os.replace(tmp, path)
        return cls(path, treedef, tuple(leaves), offset)

    @classmethod
    def write_temp(cls, tree: Any, key: str) -> DiskParams:
        """:meth:`write` to the system temp directory, removed at exit. The file is named by
        ``key`` (the run directory), so a run restarted after a kill overwrites the file its
        killed attempt left instead of adding one."""
        digest = hashlib.sha1(key.encode()).hexdigest()[:16]
        out = cls.write(tree, Path(tempfile.gettempdir()) / f"pmd_jax_initial_policy_{digest}.bin")
        atexit.register(out.remove)
        return out

    def load(self) -> Any:
        """The tree, each leaf placed with the sharding it had when written."""
        import jax

        if not self.path.is_file() or self.path.stat().st_size != self.nbytes_on_disk:
            raise FileNotFoundError(f"{self.path}: the offloaded initial policy is missing or "
                                    f"not {self.nbytes_on_disk} bytes (was it deleted?)")
        mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        out = []
        for leaf in self.leaves:
            size = int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
            a = mm[leaf.offset: leaf.offset + size].view(leaf.dtype).reshape(leaf.shape)
            out.append(jax.device_put(np.array(a), leaf.sharding)
                       if leaf.sharding is not None else jax.numpy.asarray(np.array(a)))
        del mm
        return jax.tree.unflatten(self.treedef, out)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
