"""Checkpoints with orbax: train state, named owner slots, atomic commits, corruption fallback.

One checkpoint (one step directory, ``<root>/<step>/``) holds:

* ``state``: a pytree of arrays (orbax ``StandardSave``): params, optimizer state, teacher
  params, step and the RNG key data (see :class:`pmd_jax.distill.step.TrainState`). With the
  trust-region teacher the frozen initial params are the teacher tree, so they are saved here
  too (no need to re-derive them from the initial checkpoint, which may be gone or changed).
* named slots, one per owner (``"memory"``, ``"data_cursor"``, ...), each holding a JSON value,
  raw bytes, or a copy of a directory (for large ``state_dict`` blobs such as a memory with an
  index). Slots are written by :class:`BlobCheckpointHandler`.
* ``pmd_commit.json``: our commit marker, written after orbax has finalised the step. It lists
  every file of the step with its size and CRC32 (``checksum=True``) or size only.

Atomicity: orbax writes into ``<step>.orbax-checkpoint-tmp*`` and renames it to ``<step>`` on
finalisation; a process killed mid-save leaves only the tmp directory, which orbax never lists
as a step (and cleans up). A finalised step without our commit marker (killed between rename
and marker), with a file missing, truncated or changed, or that orbax fails to restore, is
*corrupt*: :meth:`Checkpointer.restore` logs its path and the reason, moves it aside to
``<root>/corrupt/<step>-<time>`` (so the step number can be saved again) and falls back to the
previous step. If no step is usable, :class:`CheckpointError` lists every failure.

Saving is asynchronous by default: :meth:`Checkpointer.save` returns once the arrays are
copied off the devices; the write, finalisation and commit marker happen in the background.
:meth:`Checkpointer.wait` blocks until they are done. Old steps beyond ``max_to_keep`` are
deleted by orbax, only once the new step is committed (its finalize thread deletes them after
the write and rename succeed; a failed write deletes nothing): keeping N takes N + 1
checkpoints of disk while one is written. With ``max_to_keep=1`` a failed or killed save still
leaves the previous step, but a committed step found corrupt at restore has none to fall back
to. :func:`disk_plan` estimates the bytes (the trainer logs them and refuses to start without
room for two).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import shutil
import threading
import time
import uuid
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_args
from orbax.checkpoint._src.handlers import async_checkpoint_handler

from pmd_jax.loop.phases import TrainingError
from pmd_jax.run import footprint, paths

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig

log = logging.getLogger(__name__)

COMMIT_FILE = "pmd_commit.json"
STATE_ITEM = "state"
DEFAULT_SLOTS = ("memory", "data_cursor")
_KIND_FILE = "kind"
_BLOB_FILE = "blob.bin"
_JSON_FILE = "value.json"
_DIR_NAME = "dir"
# Files orbax rewrites at or after the commit (timestamps), not covered by our marker.
_UNLISTED = frozenset({COMMIT_FILE, "_CHECKPOINT_METADATA", "commit_success.txt"})
# Bytes of arrays orbax serialises at once (its default, 96 GB, is every array of the state at
# once). The write buffers are host memory beside the live train state: saving the embedded
# default's 2.0 GiB train state (after a step, so the moments do not compress) took 1.9 GiB of
# C heap at the default, 0.9 GiB at 1; the same arrays, format and write time (13.5 s).
SAVE_CONCURRENT_GB = 1


class CheckpointError(RuntimeError):
    """No usable checkpoint, or a bad save/restore request; the message names the path."""


# --------------------------------------------------------------------------------------------
# slot handler: JSON, bytes or a directory copy
# --------------------------------------------------------------------------------------------


def _write_bytes_sync(path: Path, data: bytes) -> None:
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
                _write_bytes_sync(d / _BLOB_FILE, payload)
            elif kind == "json":
                _write_bytes_sync(d / _JSON_FILE, payload.encode())
            else:
                paths.move(payload, d / _DIR_NAME)  # a copy + delete onto gs://
            _write_bytes_sync(d / _KIND_FILE, kind.encode())

        from orbax.checkpoint._src.futures import future

        return [future.CommitFutureAwaitingContractedSignals(_as_coro(write), name="pmd_blob")]

    def save(self, directory: epath.Path, args: BlobSave) -> None:
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
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(MOVED_MODULES.get(module, module), name)


def load_pickle(data: bytes) -> Any:
    """``pickle.loads`` that also reads the classes of modules that moved (MOVED_MODULES)."""
    import io

    return _Unpickler(io.BytesIO(data)).load()


def _as_path(p: str | os.PathLike) -> Path:
    """A local path as ``pathlib.Path``, a gs:// one as ``epath.Path`` (kept a URL)."""
    return paths.run_path(p) if paths.is_remote(p) else Path(os.fspath(p))


async def _as_coro(fn: Any) -> None:
    import asyncio

    await asyncio.to_thread(fn)


@checkpoint_args.register_with_handler(BlobCheckpointHandler, for_save=True)
@dataclasses.dataclass
class BlobSave(checkpoint_args.CheckpointArgs):
    value: Any


@checkpoint_args.register_with_handler(BlobCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class BlobRestore(checkpoint_args.CheckpointArgs):
    target_dir: str | os.PathLike | None = None


# --------------------------------------------------------------------------------------------
# commit marker
# --------------------------------------------------------------------------------------------


def _crc32(path: Path) -> int:
    crc = 0
    with (path.open("rb") if paths.is_remote(path) else open(path, "rb")) as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _file_table(step_dir: Path, checksum: bool) -> dict[str, list[int]]:
    table: dict[str, list[int]] = {}
    files = (paths.walk_files(step_dir) if paths.is_remote(step_dir)  # no rglob on gs://
             else (p for p in step_dir.rglob("*") if p.is_file()))
    for p in sorted(files, key=os.fspath):
        if p.name not in _UNLISTED:
            rel = os.fspath(p)[len(os.fspath(step_dir)):].lstrip("/")
            entry = [paths.size(p)]
            if checksum:
                entry.append(_crc32(p))
            table[rel] = entry
    return table


def write_commit_marker(step_dir: Path, step: int, checksum: bool = True) -> None:
    """Write ``pmd_commit.json`` (file sizes and CRC32s) atomically into a finalised step."""
    marker = {
        "step": int(step),
        "time": time.time(),
        "checksum": bool(checksum),
        "files": _file_table(step_dir, checksum),
    }
    tmp = step_dir / f".{COMMIT_FILE}.tmp"
    _write_bytes_sync(tmp, json.dumps(marker).encode())
    paths.replace(tmp, step_dir / COMMIT_FILE)


def verify_step_dir(step_dir: Path, step: int) -> None:
    """Raise :class:`CheckpointError` naming the step directory and the problem."""
    marker_path = step_dir / COMMIT_FILE
    if not marker_path.exists():
        raise CheckpointError(
            f"checkpoint {step_dir} has no commit marker {COMMIT_FILE} (partial save)"
        )
    try:
        marker = json.loads(marker_path.read_text())
        files = marker["files"]
        checksum = bool(marker["checksum"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {step_dir}: unreadable commit marker: {e}") from None
    if int(marker.get("step", -1)) != int(step):
        raise CheckpointError(
            f"checkpoint {step_dir}: commit marker is for step {marker.get('step')}, not {step}"
        )
    for rel, entry in files.items():
        p = step_dir / rel
        if not p.is_file():
            raise CheckpointError(f"checkpoint {step_dir}: file {rel} is missing")
        size = paths.size(p)
        if size != entry[0]:
            raise CheckpointError(
                f"checkpoint {step_dir}: file {rel} has {size} bytes, expected {entry[0]} "
                "(truncated or changed)"
            )
        if checksum and _crc32(p) != entry[1]:
            raise CheckpointError(f"checkpoint {step_dir}: file {rel} fails its CRC32 check")


# --------------------------------------------------------------------------------------------
# the checkpointer
# --------------------------------------------------------------------------------------------


def abstract_state(state: Any, shardings: Any | None = None) -> Any:
    """``ShapeDtypeStruct`` tree (with target shardings) to restore ``state``-shaped trees."""
    if shardings is None:
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=getattr(x, "sharding", None) or default
            ),
            state,
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )


@dataclasses.dataclass
class Restored:
    step: int
    state: Any
    slots: dict[str, Any]
    skipped: list[tuple[int, str]]  # (step, reason) of corrupt checkpoints passed over


class Checkpointer:
    """Orbax ``CheckpointManager`` over ``state`` + named slots, with commit markers.

    ``slots``: the slot names this run uses (each optional per save). ``max_to_keep``: how
    many committed steps to keep. ``async_save``: write in the background. ``checksum``:
    record and verify CRC32 of every file (else sizes only; for very large checkpoints).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int = 3,
        async_save: bool = True,
        slots: tuple[str, ...] = DEFAULT_SLOTS,
        checksum: bool = True,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise CheckpointError(f"max_to_keep must be >= 1, got {max_to_keep}")
        bad = [s for s in slots if s == STATE_ITEM or not s.isidentifier()]
        if bad:
            raise CheckpointError(f"bad slot names {bad} (identifiers, not {STATE_ITEM!r})")
        # A gs:// root stays a URL (epath.Path; orbax and tensorstore write it directly).
        self.directory = (paths.run_path(directory) if paths.is_remote(directory)
                          else Path(directory).absolute())
        self.directory.mkdir(parents=True, exist_ok=True)
        self.slots = tuple(slots)
        self.checksum = checksum
        self._async = async_save
        self._lock = threading.Lock()
        self._pending: list[int] = []
        self._max_to_keep = max_to_keep
        if jax.process_index() == 0:  # directory-slot copies left by a killed run
            for stale in self.directory.glob(".pmd-stage-*"):
                paths.rmtree(stale, ignore_errors=True)
        self._mgr = self._make_manager()

    def _make_manager(self) -> ocp.CheckpointManager:
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add(STATE_ITEM, ocp.args.StandardSave,
                     ocp.StandardCheckpointHandler(save_concurrent_gb=SAVE_CONCURRENT_GB))
        registry.add(STATE_ITEM, ocp.args.StandardRestore, ocp.StandardCheckpointHandler())
        for s in self.slots:
            h = BlobCheckpointHandler(staging_root=self.directory)
            registry.add(s, BlobSave, h)
            registry.add(s, BlobRestore, h)
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=self._max_to_keep,
            enable_async_checkpointing=self._async,
            async_options=ocp.options.AsyncOptions(
                post_finalization_callback=self._on_finalized
            ) if self._async else None,
            cleanup_tmp_directories=True,
        )
        return ocp.CheckpointManager(self.directory, options=opts, handler_registry=registry)

    # ---------------------------------------------------------------- saving
    def _on_finalized(self) -> None:
        footprint.release_free_memory()  # the write buffers, freed, back to the kernel
        with self._lock:
            pending, self._pending = self._pending, []
        if jax.process_index() != 0:
            return
        for step in pending:
            d = self._unfinalized_dir(step)
            if d is not None:
                write_commit_marker(d, step, self.checksum)

    def _unfinalized_dir(self, step: int) -> Path | None:
        """Where step ``step`` is being written when orbax calls back before its commit.

        Orbax calls ``post_finalization_callback`` after the items are finalised and *before*
        the atomic rename of ``<step>.orbax-checkpoint-tmp*`` to ``<step>`` (on filesystems
        without atomic rename it writes in place), so the marker lands inside the rename.
        """
        tmps = sorted(self.directory.glob(f"{step}.orbax-checkpoint-tmp*"),
                      key=paths.mtime)
        if tmps:
            return tmps[-1]
        d = self.directory / str(step)
        return d if d.is_dir() else None

    def save(
        self, step: int, state: Any, *, slots: Mapping[str, Any] | None = None,
        force: bool = True,
    ) -> bool:
        """Save ``state`` (and slot values: JSON / bytes / ``Path`` of a directory) at ``step``."""
        slots = dict(slots or {})
        unknown = set(slots) - set(self.slots)
        if unknown:
            raise CheckpointError(
                f"unknown checkpoint slots {sorted(unknown)}; this Checkpointer has {self.slots}"
            )
        items: dict[str, Any] = {STATE_ITEM: ocp.args.StandardSave(state)}
        for name, value in slots.items():
            if value is not None:
                items[name] = BlobSave(value)
        self._mgr.wait_until_finished()  # one save in flight: the marker callback knows its step
        with self._lock:
            self._pending.append(int(step))
        saved = self._mgr.save(int(step), args=ocp.args.Composite(**items), force=force)
        if not saved:
            with self._lock:
                self._pending.remove(int(step))
        elif not self._async:
            self._on_finalized()
        return bool(saved)

    def wait(self) -> None:
        """Block until the in-flight save is written, finalised and committed."""
        self._mgr.wait_until_finished()

    def poll(self) -> bool:
        """Never blocks on a save still being written: once the in-flight save has ended,
        raises its error if it failed. Returns whether a save is still in flight."""
        if self._mgr.is_saving_in_progress():
            return True
        self._mgr.wait_until_finished()  # an ended save: returns at once, or raises its error
        return False

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()

    # ---------------------------------------------------------------- restoring
    def all_steps(self) -> list[int]:
        self._mgr.reload()
        return sorted(int(s) for s in self._mgr.all_steps())

    def committed_steps(self) -> list[int]:
        """Steps whose commit marker exists (not verified)."""
        return [s for s in self.all_steps() if (self.directory / str(s) / COMMIT_FILE).exists()]

    def latest_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def _quarantine(self, step: int, reason: str) -> None:
        src = self.directory / str(step)
        log.warning("checkpoint %s is corrupt, falling back to the previous one: %s", src, reason)
        if jax.process_index() != 0 or not src.exists():
            return
        dst_root = self.directory / "corrupt"
        dst_root.mkdir(parents=True, exist_ok=True)
        paths.move(src, dst_root / f"{step}-{int(time.time() * 1e3)}")

    def restore(
        self, target: Any, *, step: int | None = None, slot_dirs: Mapping[str, Any] | None = None,
    ) -> Restored:
        """Restore the newest usable step (or ``step``) onto ``target``'s shapes/shardings.

        ``target``: a tree of arrays or ``ShapeDtypeStruct`` (with ``sharding`` for placement
        on the mesh; see :func:`abstract_state`). Corrupt steps are logged, moved aside and
        skipped (``Restored.skipped``); with an explicit ``step`` a corrupt one raises.
        """
        self._mgr.wait_until_finished()
        target = abstract_state(target)
        candidates = [step] if step is not None else list(reversed(self.all_steps()))
        if not candidates:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        skipped: list[tuple[int, str]] = []
        slot_dirs = dict(slot_dirs or {})
        for s in candidates:
            d = self.directory / str(s)
            try:
                verify_step_dir(d, s)
                present = [n for n in self.slots if (d / n).is_dir()]
                items: dict[str, Any] = {STATE_ITEM: ocp.args.StandardRestore(target)}
                for n in present:
                    items[n] = BlobRestore(slot_dirs.get(n))
                out = self._mgr.restore(s, args=ocp.args.Composite(**items))
                state = out[STATE_ITEM]
                slots = {n: out[n] for n in present}
            except Exception as e:  # noqa: BLE001 - any failure marks the step corrupt
                reason = f"{type(e).__name__}: {e}"
                if step is not None:
                    raise CheckpointError(f"checkpoint {d} is unusable: {reason}") from e
                skipped.append((s, reason))
                self._quarantine(s, reason)
                continue
            if skipped:
                self._mgr.reload()
            return Restored(step=s, state=state, slots=slots, skipped=skipped)
        self._mgr.reload()
        detail = "; ".join(f"step {s}: {r}" for s, r in skipped)
        raise CheckpointError(f"no usable checkpoint in {self.directory} ({detail})")


# --------------------------------------------------------------------------------------------
# the run's checkpoints: train state + the loop's slots
class RunCheckpointer:
    """The trainer's checkpoints under ``<run_dir>/checkpoints``: the train state and the
    memory, data-cursor, trainer-counter, prefetched-rollouts and fast_slow-pool slots."""

    def __init__(self, run_dir: Path, keep: int) -> None:
        self.ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=keep,
                                 slots=("memory", "data_cursor", "trainer", "prefetch",
                                        "mode_state", "fast_slow"))
        self.inflight: int | None = None  # the step of the background write, until it ends

    def save(self, step: int, bundle: Any, extras: dict[str, Any]) -> None:
        """Saves ``bundle.state`` (a distill.train.TrainBundle) and the trainer's ``extras``."""
        mem = extras.get("memory")
        slots = {
            "data_cursor": extras["data_cursor"],
            "trainer": {"step": int(step),
                        "nonfinite_in_a_row": int(extras.get("nonfinite_in_a_row", 0)),
                        "skipped_long_prompts": int(extras.get("skipped_long_prompts", 0))},
            "memory": pickle.dumps(mem, protocol=5) if mem is not None else None,
            # rollout.overlap: the next step's rollouts, already sampled (pickled bytes)
            "prefetch": extras.get("prefetch"),
            # the mode runtime's state (pmd_jax/modes; fast_slow: its context pool), pickled
            "mode_state": (pickle.dumps(extras["mode_state"], protocol=5)
                           if extras.get("mode_state") is not None else None),
        }
        self.wait()  # a failed background write of the previous save stops here
        try:
            self.ckpt.save(int(step), bundle.state, slots=slots)
        except Exception as e:  # noqa: BLE001 - report which step failed and what is intact
            raise self._error(int(step), e) from e
        self.inflight = int(step)

    def restore_latest(self, bundle: Any) -> tuple[Any, dict[str, Any]] | None:
        """The latest usable checkpoint into ``bundle`` and the trainer's extras, or None."""
        if not self.ckpt.all_steps():
            return None
        try:
            r = self.ckpt.restore(bundle.step_fn.abstract_state())
        except CheckpointError as e:
            log.error("%s; starting from scratch", e)
            return None
        for s, why in r.skipped:
            log.warning("skipped corrupt checkpoint %d: %s", s, why)
        bundle.state = r.state
        tr = r.slots.get("trainer") or {"step": r.step}
        mem = r.slots.get("memory")
        extras = {
            "step": int(tr["step"]),
            "data_cursor": r.slots["data_cursor"],
            "nonfinite_in_a_row": int(tr.get("nonfinite_in_a_row", 0)),
            "skipped_long_prompts": int(tr.get("skipped_long_prompts", 0)),
            "memory": load_pickle(mem) if mem else None,
            "prefetch": r.slots.get("prefetch"),
        }
        # ("fast_slow": the slot's name in checkpoints written before the mode registry)
        state = r.slots.get("mode_state") or r.slots.get("fast_slow")
        if state:
            extras["mode_state"] = load_pickle(state)
        return bundle, extras

    def wait(self, block: bool = True) -> None:
        """Blocks until the background write is committed (``block=False``: only looks
        whether it has ended, so a failed write stops the run after the step it failed in,
        not at the next save); a failure raises a TrainingError naming its step."""
        step = self.inflight
        if step is None:
            return
        try:
            if not block and self.ckpt.poll():
                return  # still being written
            self.inflight = None
            self.ckpt.wait()  # (after a poll: an ended save, so it returns at once)
        except Exception as e:  # noqa: BLE001 - report which step failed and what is intact
            self.inflight = None
            raise self._error(step, e) from e

    def _error(self, step: int, e: Exception) -> TrainingError:
        try:
            prev = self.ckpt.latest_step()
        except Exception:  # noqa: BLE001 - only used in the message
            prev = None
        intact = (f"the previous checkpoint (step {prev}) is intact" if prev is not None
                  else "there is no earlier checkpoint")
        return TrainingError(
            f"checkpoint write at step {step} failed ({type(e).__name__}: {e}); {intact}")

    def check_disk(self, bundle: Any, slots: Mapping[str, Any] | None = None, *,
                   export_hf: bool = False) -> str:
        """The disk this run's checkpoints need (:class:`DiskPlan`, from ``bundle.state`` and
        the slot values as they are now), as one line for the start-up log. Raises
        :class:`DiskSpaceError` when the file system cannot hold two checkpoints (the kept
        one and the next); logs a warning when it cannot hold all that
        ``train.keep_checkpoints`` keeps."""
        plan = disk_plan(self.ckpt.directory, bundle.state, slots, keep=self.ckpt._max_to_keep,
                         present=len(self.ckpt.committed_steps()),
                         export=export_bytes(bundle.state.params) if export_hf else 0)
        plan.check()
        return plan.describe()


# --------------------------------------------------------------------------------------------
# the disk a run's checkpoints need
# Bytes of a checkpoint beyond its arrays and slot values: orbax's metadata files, the OCDBT
# manifests and our commit marker; per array and fixed (a tiny model's 80 arrays: ~55 KB).
CHECKPOINT_OVERHEAD_BYTES = 64 << 10
CHECKPOINT_OVERHEAD_PER_ARRAY = 1 << 10


class DiskSpaceError(CheckpointError):
    """The run directory's file system cannot hold the two checkpoints a run needs (the kept
    one and the next, written in full before the old one is deleted); raised at start-up."""


def slot_bytes(value: Any) -> int:
    """Bytes of one slot value as :meth:`RunCheckpointer.save` writes it: ``bytes`` as they
    are, anything else (a JSON value, the memory's or the mode's state) pickled (the JSON of a
    small dict is about as long)."""
    if value is None:
        return 0
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    return len(pickle.dumps(value, protocol=5))


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


def build_checkpointer(cfg: RunConfig, run_dir: Path) -> RunCheckpointer:
    return RunCheckpointer(run_dir, int(cfg.train.keep_checkpoints))
