"""A cgroup per uid slot: memory and pids limits for a run's whole process tree."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
from pathlib import Path

from pmd_jax.tasks.sandbox import sweep
from pmd_jax.tasks.sandbox.base import Limits

log = logging.getLogger(__name__)


class Cgroup:
    """A cgroup for one uid slot (v1 memory+pids hierarchies, or v2 unified) when writable.

    Created once per slot and reused (mkdir/rmdir per run costs tens of ms); the limits are
    rewritten and the OOM counter re-read as a baseline at every run; all
    groups are removed at exit. The name marks the owner (``sweep.cgroup_name``), so
    the groups of a process that was killed are swept by the next one.
    """

    _by_uid: dict[int, Cgroup] = {}
    _owner_pid = -1  # the process that made the groups in _by_uid (not a forked child)
    _lock = threading.Lock()

    def __init__(self, dirs: dict[str, Path]):
        self.dirs = dirs
        self._oom0 = 0

    @classmethod
    def for_uid(cls, uid: int, limits: Limits) -> Cgroup | None:
        base = cgroup_bases()
        if not base:
            return None
        with cls._lock:
            if cls._owner_pid != os.getpid():  # a forked child: the parent's are not ours
                cls._by_uid, cls._owner_pid = {}, os.getpid()
            cg = cls._by_uid.get(uid)
            if cg is None:
                cg = cls._make(base, sweep.cgroup_name(uid))
                if cg is None:
                    return None
                cls._by_uid[uid] = cg
        try:
            cg._set_limits(limits)
        except OSError as e:
            log.debug("cgroup limits failed: %s", e)
            return None
        cg._oom0 = cg._oom_count()
        return cg

    @classmethod
    def _make(cls, base: dict[str, Path], name: str) -> Cgroup | None:
        dirs: dict[str, Path] = {}
        try:
            for ctrl in ("unified", "memory", "pids"):
                if ctrl in base:
                    d = base[ctrl] / name
                    d.mkdir(exist_ok=True)
                    dirs[ctrl] = d
        except OSError as e:
            log.debug("cgroup setup failed: %s", e)
            cls(dirs).destroy()
            return None
        return cls(dirs)

    def _set_limits(self, limits: Limits) -> None:
        if "unified" in self.dirs:
            d = self.dirs["unified"]
            (d / "memory.max").write_text(str(limits.tree_memory_bytes))
            with contextlib.suppress(OSError):
                (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(limits.nproc + 8))
        if "memory" in self.dirs:
            (self.dirs["memory"] / "memory.limit_in_bytes").write_text(
                str(limits.tree_memory_bytes)
            )
        if "pids" in self.dirs:
            (self.dirs["pids"] / "pids.max").write_text(str(limits.nproc + 8))

    def charged(self) -> int:
        """Processes (and threads) the slot's pids counter still holds: a task is uncharged
        only when it is reaped, so a zombie nobody has reaped yet still counts."""
        for ctrl in ("unified", "pids"):
            if ctrl in self.dirs:
                with contextlib.suppress(OSError, ValueError):
                    return int((self.dirs[ctrl] / "pids.current").read_text())
        return 0

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def _oom_count(self) -> int:
        try:
            if "unified" in self.dirs:
                ev = (self.dirs["unified"] / "memory.events").read_text()
                return sum(
                    int(ln.split()[1]) for ln in ev.splitlines() if ln.split()[0] == "oom_kill"
                )
            if "memory" in self.dirs:
                for ln in (self.dirs["memory"] / "memory.oom_control").read_text().splitlines():
                    if ln.startswith("oom_kill "):
                        return int(ln.split()[1])
                return int((self.dirs["memory"] / "memory.failcnt").read_text())
        except (OSError, ValueError, IndexError):
            pass
        return 0

    def oom_killed(self) -> bool:
        return self._oom_count() > self._oom0

    def kill_all(self) -> int:
        def pids() -> set[int]:
            out: set[int] = set()
            for d in self.dirs.values():
                with contextlib.suppress(OSError, ValueError):
                    out |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
            return out

        return sweep.kill_until_gone(pids, rounds=50, pause=0.005)

    def destroy(self) -> None:
        self.kill_all()
        for d in self.dirs.values():
            sweep.rmdir_retry(d, tries=50)

    @classmethod
    def destroy_all(cls) -> None:
        with cls._lock:
            if cls._owner_pid == os.getpid():
                for cg in cls._by_uid.values():
                    cg.destroy()
            cls._by_uid.clear()


atexit.register(Cgroup.destroy_all)


@functools.cache
def cgroup_bases() -> dict[str, Path]:
    """Writable cgroup directories of this process, by controller; {} if none."""
    if os.geteuid() != 0 or os.environ.get("PMD_SANDBOX_NO_CGROUP"):
        return {}
    out: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {}
    root = Path("/sys/fs/cgroup")
    for ln in lines:
        parts = ln.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        rel = path.lstrip("/")
        if ctrls == "" and (root / "cgroup.controllers").exists():
            d = root / rel
            ctl = d / "cgroup.subtree_control"
            try:
                if {"memory", "pids"} <= set(ctl.read_text().split()):
                    out["unified"] = d
            except OSError:
                pass
        for c in ("memory", "pids"):
            if c in ctrls.split(","):
                d = root / c / rel
                if d.is_dir() and os.access(d, os.W_OK):
                    out[c] = d
    if "unified" in out and len(out) > 1:
        return {"unified": out["unified"]}
    # v1: verify that we can really create a child group
    for c, d in list(out.items()):
        probe = d / f"pmd-probe-{os.getpid()}"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError:
            del out[c]
    return out
