"""How a checkpoint stores the values that are not arrays (its "slots": the memory, the data
cursor, a mode's state): an orbax handler that writes JSON, host state (``run/host_state.py``:
versioned JSON + arrays), bytes or a copy of a folder, and the unpickler that only
``python -m pmd_jax.run.convert`` uses, for slots pickled by older versions."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any

import jax
from etils import epath
from orbax.checkpoint import checkpoint_args
from orbax.checkpoint._src.handlers import async_checkpoint_handler

from pmd_jax.run import paths
from pmd_jax.run.host_state import ARRAYS_FILE, STATE_FILE, HostState, StoredHostState

# the files of one slot's directory
_KIND_FILE = "kind"
_BLOB_FILE = "blob.bin"
_JSON_FILE = "value.json"
_DIR_NAME = "dir"


class CheckpointError(RuntimeError):
    """No usable checkpoint, or a bad save/restore request; the message names the path."""


# --------------------------------------------------------------------------------------------
# slot handler: JSON, bytes or a directory copy
# --------------------------------------------------------------------------------------------


def write_bytes_sync(path: Path, data: bytes) -> None:
    if paths.is_remote(path):  # gs://: one object write (atomic there)
        paths.write_bytes(path, data)
        return
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class BlobCheckpointHandler(async_checkpoint_handler.AsyncCheckpointHandler):
    """Saves one slot value: a JSON-able object, ``bytes``, or a directory (copied).

    A directory is copied synchronously into a staging directory when ``save`` is called (so
    its owner may change it right after), then moved into the checkpoint in the background.
    Restore gives the JSON value / the bytes / the ``Path`` of the directory inside the
    checkpoint (or a copy at ``BlobRestore(target_dir=...)``; copy it if you need it beyond
    the checkpoint's lifetime under ``max_to_keep``).
    """

    def __init__(self, staging_root: str | os.PathLike | None = None):
        # A remote checkpoint root stages directory copies next to their local source.
        self._staging_root = (Path(staging_root) if staging_root
                              and not paths.is_remote(staging_root) else None)

    def _prepare(self, value: Any) -> tuple[str, Any]:
        if isinstance(value, HostState):
            return "state", (value.doc_bytes(), value.arrays_bytes())
        if isinstance(value, bytes | bytearray | memoryview):
            return "bytes", bytes(value)
        if isinstance(value, os.PathLike):
            src = Path(value)
            if not src.is_dir():
                raise CheckpointError(f"slot directory {src} does not exist or is not a directory")
            root = self._staging_root or src.parent
            stage = root / f".pmd-stage-{uuid.uuid4().hex}"
            stage.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src, stage)
            return "dir", stage
        try:
            return "json", json.dumps(value)
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"slot value of type {type(value).__name__} is neither bytes, a directory path, "
                f"nor JSON-serialisable: {e}"
            ) from None

    async def async_save(self, directory: epath.Path, args: BlobSave) -> list[Any] | None:
        kind, payload = self._prepare(args.value)

        def write() -> None:
            if not jax.process_index() == 0:
                if kind == "dir":
                    shutil.rmtree(payload, ignore_errors=True)
                return
            d = _as_path(directory)
            d.mkdir(parents=True, exist_ok=True)
            if kind == "bytes":
                write_bytes_sync(d / _BLOB_FILE, payload)
            elif kind == "json":
                write_bytes_sync(d / _JSON_FILE, payload.encode())
            elif kind == "state":
                write_bytes_sync(d / STATE_FILE, payload[0])
                write_bytes_sync(d / ARRAYS_FILE, payload[1])
            else:
                paths.move(payload, d / _DIR_NAME)  # a copy + delete onto gs://
            write_bytes_sync(d / _KIND_FILE, kind.encode())

        # lazy: orbax's private modules, only when a host-state slot is saved
        from orbax.checkpoint._src.futures import future

        return [future.CommitFutureAwaitingContractedSignals(_as_coro(write), name="pmd_blob")]

    def save(self, directory: epath.Path, args: BlobSave) -> None:
        # lazy: orbax's private modules, only when a host-state slot is saved
        from orbax.checkpoint._src import asyncio_utils

        async def run() -> None:
            futs = await self.async_save(directory, args)
            for f in futs or []:
                f.result()

        asyncio_utils.run_sync(run())

    def restore(self, directory: epath.Path, args: BlobRestore | None = None) -> Any:
        d = _as_path(directory)
        kind_path = d / _KIND_FILE
        if not kind_path.exists():
            raise CheckpointError(f"slot {d} has no '{_KIND_FILE}' file (incomplete slot)")
        kind = kind_path.read_text()
        if kind == "bytes":
            return (d / _BLOB_FILE).read_bytes()
        if kind == "state":
            return StoredHostState((d / STATE_FILE).read_bytes(),
                                   (d / ARRAYS_FILE).read_bytes(), str(d))
        if kind == "json":
            try:
                return json.loads((d / _JSON_FILE).read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"slot {d / _JSON_FILE} is not valid JSON: {e}") from None
        if kind == "dir":
            src = d / _DIR_NAME
            if args is not None and args.target_dir is not None:
                dst = _as_path(args.target_dir)
                if dst.exists():
                    paths.rmtree(dst)
                paths.copytree(src, dst)
                return dst
            return src
        raise CheckpointError(f"slot {d} has unknown kind {kind!r}")

    def metadata(self, directory: epath.Path) -> None:
        return None


# Modules that moved into the package's folders (issue 38): a checkpoint written before names
# their classes by the old paths (the prefetched StepBatch, a memory or mode state).
MOVED_MODULES = {
    **{f"pmd_jax.{m}": f"pmd_jax.loop.{m}" for m in (
        "trainer", "build", "teaching", "rollout", "evaluate", "phases", "export", "retention")},
    **{f"pmd_jax.{m}": f"pmd_jax.run.{m}" for m in (
        "checkpoint", "metrics", "paths", "footprint", "sharding", "distributed", "multihost")},
    "pmd_jax.config_cli": "pmd_jax.config.cli",
    # the neighbours' modes moved into modes/ (issue 49, part 3)
    **{f"pmd_jax.{p}.{m}": f"pmd_jax.modes.{p}.{m}" for p, ms in (
        ("mel", ("config", "lessons", "mode")),
        ("fast_slow", ("config", "contexts", "mode", "pareto", "pool"))) for m in ms},
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(MOVED_MODULES.get(module, module), name)


def load_pickle(data: bytes) -> Any:
    """``pickle.loads`` that also reads the classes of modules that moved (MOVED_MODULES)."""

    return _Unpickler(io.BytesIO(data)).load()


def _as_path(p: str | os.PathLike) -> Path:
    """A local path as ``pathlib.Path``, a gs:// one as ``epath.Path`` (kept a URL)."""
    return paths.run_path(p) if paths.is_remote(p) else Path(os.fspath(p))


async def _as_coro(fn: Any) -> None:
    await asyncio.to_thread(fn)


@checkpoint_args.register_with_handler(BlobCheckpointHandler, for_save=True)
@dataclasses.dataclass
class BlobSave(checkpoint_args.CheckpointArgs):
    value: Any


@checkpoint_args.register_with_handler(BlobCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class BlobRestore(checkpoint_args.CheckpointArgs):
    target_dir: str | os.PathLike | None = None
