"""Checkpoints with orbax: train state, named owner slots, atomic commits, corruption fallback.

One checkpoint (one step directory, ``<root>/<step>/``) holds:

* ``state``: a pytree of arrays (orbax ``StandardSave``): params, optimizer state, teacher
  params, step and the RNG key data (see :class:`pmd_jax.distill.step.TrainState`). With the
  trust-region teacher the frozen initial params are the teacher tree, so they are saved here
  too (no need to re-derive them from the initial checkpoint, which may be gone or changed).
  A LoRA run's state holds the adapters, their AdamW moments and the teacher's adapters; its
  frozen base is not saved (a resumed run loads it again from ``model.source``, as at start).
* named slots, one per owner (``"memory"``, ``"data_cursor"``, ...), each holding a JSON value,
  raw bytes, or a copy of a directory (for large ``state_dict`` blobs such as a memory with an
  index). Slots are written by :class:`pmd_jax.run.slots.BlobCheckpointHandler`.
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
to. :func:`pmd_jax.run.disk.disk_plan` estimates the bytes (the trainer logs them and refuses to
start without room for two).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp

from pmd_jax.loop.phases import TrainingError
from pmd_jax.run import footprint, host_state, paths
from pmd_jax.run.disk import disk_plan, export_bytes
from pmd_jax.run.slots import (
    BlobCheckpointHandler,
    BlobRestore,
    BlobSave,
    CheckpointError,
    write_bytes_sync,
)

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig

log = logging.getLogger(__name__)

COMMIT_FILE = "pmd_commit.json"
STATE_ITEM = "state"
DEFAULT_SLOTS = ("memory", "data_cursor")
# Files orbax rewrites at or after the commit (timestamps), not covered by our marker.
_UNLISTED = frozenset({COMMIT_FILE, "_CHECKPOINT_METADATA", "commit_success.txt"})
# Bytes of arrays orbax serialises at once (its default, 96 GB, is every array of the state at
# once). The write buffers are host memory beside the live train state: saving the embedded
# default's 2.0 GiB train state (after a step, so the moments do not compress) took 1.9 GiB of
# C heap at the default, 0.9 GiB at 1; the same arrays, format and write time (13.5 s).
SAVE_CONCURRENT_GB = 1


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
    write_bytes_sync(tmp, json.dumps(marker).encode())
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
        # the manager's clean-up of old temp dirs runs in a thread from its construction on,
        # and neither wait_until_finished nor close waits for it: a run that ends before its
        # first save (a refusal at set-up) would leave it to fail at interpreter shutdown.
        # (private orbax, 0.12: an orbax without the method is assumed to have no such thread)
        await_cleanup = getattr(self._mgr, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:
            await_cleanup()
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
        def state(v: Any) -> Any:  # versioned JSON + arrays (run/host_state.py), or None
            return host_state.encode(v) if v is not None else None

        slots = {
            "data_cursor": extras["data_cursor"],
            "trainer": {"step": int(step),
                        "nonfinite_in_a_row": int(extras.get("nonfinite_in_a_row", 0)),
                        "skipped_long_prompts": int(extras.get("skipped_long_prompts", 0))},
            "memory": state(extras.get("memory")),
            # rollout.overlap: the next step's rollouts, already sampled
            "prefetch": state(extras.get("prefetch")),
            # the mode runtime's state (pmd_jax/modes; fast_slow: its context pool)
            "mode_state": state(extras.get("mode_state")),
        }
        self.wait()  # a failed background write of the previous save stops here
        try:
            self.ckpt.save(int(step), bundle.state, slots=slots)
        except Exception as e:  # noqa: BLE001 - report which step failed and what is intact
            raise self._error(int(step), e) from e
        self.inflight = int(step)

    def restore_latest(self, bundle: Any, rebuild: Callable[[], Any] | None = None
                       ) -> tuple[Any, dict[str, Any]] | None:
        """The latest usable checkpoint into ``bundle`` and the trainer's extras, or None.

        With ``rebuild`` (a function that makes the initial train state again), the bundle
        lets go of its state before the restore, so the restored arrays are never resident
        beside the ones they replace: Qwen2.5-Coder-0.5B's params, Adam moments and teacher
        are 9.4 GiB, and a resume that held both was killed on a 24 GiB machine. When no
        checkpoint is usable the run starts from ``rebuild()``. Without it the state is kept
        until the restore has succeeded."""
        if not self.ckpt.all_steps():
            return None
        target = bundle.step_fn.abstract_state()
        if rebuild is not None:
            bundle.state = None
            footprint.release_free_memory()
        try:
            r = self.ckpt.restore(target)
        except CheckpointError as e:
            log.error("%s; starting from scratch", e)
            if rebuild is not None:
                bundle.state = rebuild()
            return None
        for s, why in r.skipped:
            log.warning("skipped corrupt checkpoint %d: %s", s, why)
        bundle.state = r.state
        tr = r.slots.get("trainer") or {"step": r.step}

        def load(name: str) -> Any:
            v = r.slots.get(name)
            if isinstance(v, bytes):  # pickled by an older pmd_jax: never unpickled here
                raise host_state.LegacyCheckpointError(
                    self.ckpt.directory / str(r.step) / name, self.ckpt.directory.parent)
            return v.load() if isinstance(v, host_state.StoredHostState) else v

        # ("fast_slow": the mode state's slot in checkpoints written before the mode registry)
        mode_state = load("mode_state") if r.slots.get("mode_state") else load("fast_slow")
        extras = {
            "step": int(tr["step"]),
            "data_cursor": r.slots["data_cursor"],
            "nonfinite_in_a_row": int(tr.get("nonfinite_in_a_row", 0)),
            "skipped_long_prompts": int(tr.get("skipped_long_prompts", 0)),
            "memory": load("memory"),
            "prefetch": load("prefetch"),
            "mode_state": mode_state,
        }
        return bundle, extras

    def close(self) -> None:
        """Ends orbax's background threads (a run refused at set-up exits without a thread
        left to fail at interpreter shutdown)."""
        self.ckpt.close()

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
        # (LoRA: the merged weights, the size of the base, and the PEFT adapter folder)
        base = getattr(bundle, "base", None)
        exported = (export_bytes(bundle.state.params) + (
            export_bytes(base) if base is not None else 0)) if export_hf else 0
        plan = disk_plan(self.ckpt.directory, bundle.state, slots, keep=self.ckpt._max_to_keep,
                         present=len(self.ckpt.committed_steps()), export=exported)
        plan.check()
        return plan.describe()


def build_checkpointer(cfg: RunConfig, run_dir: Path) -> RunCheckpointer:
    return RunCheckpointer(run_dir, int(cfg.train.keep_checkpoints))
