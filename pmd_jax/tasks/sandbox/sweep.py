"""Ownership markers for sandbox temp directories and cgroups, and the sweep of stale ones.

A sandbox run leaves two kinds of host state while it is alive: a temporary directory
(``<tmp>/pmd-sbx-...``, holding the program's files and, outside bwrap, its working
directory) and, when cgroups are writable, one cgroup per uid slot. The run's host process
removes both when the run ends, and its cgroups at exit; a host process that is SIGKILLed (an
OOM-killed or ``kill -9``'d trainer) cannot, and leaves them behind, sometimes with the
sandboxed program still running (the ``unshare`` and ``rlimits`` backends do not die with
their parent; bwrap does).

Every such object names its owner, the host process that made it:

- a temp directory is named ``pmd-sbx-p<pid>-t<start>-<random>`` and holds a marker file
  ``.pmd-sandbox-owner`` (JSON: pid, start time, pid namespace, boot id), written right after
  the directory is made and before anything else goes in;
- a cgroup is named ``pmd-sbx-p<pid>-t<start>-n<pidns>-u<uid>`` (cgroupfs holds no files of
  ours, so the name is the marker).

``<start>`` is the owner's start time (field 22 of ``/proc/<pid>/stat``, clock ticks after
boot), so a recycled pid is not taken for the owner.

``sweep()`` (run by ``sandbox`` at the first sandbox start of each process) removes the
objects whose owner is dead: it kills the processes still running in a stale cgroup and then
removes the cgroup, and kills the processes whose command line or working directory lies in a
stale temp directory and then removes the directory. It never touches an object without a
complete marker, an object owned by another user, or one whose owner lives in another pid
namespace (its pid cannot be checked from here). An owner counts as dead when its pid does
not exist, is a zombie, has another start time, or the marker is from an earlier boot. A
live owner's objects are never touched, so several processes using sandboxes at once can
sweep concurrently; two sweepers racing on the same stale object both tolerate the other
having removed it first.

The sandbox's uid pool keeps no state on disk (each host process draws uids from a range
chosen by its pid), so there is nothing of it to recover; the processes a dead owner left
running under those uids are found through its cgroups, or through its temp directory
(command line, working directory). This module also holds the other /proc scans of the
sandbox's cleanup (``kill_uid``, ``user_process_count``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "pmd-sbx-"
MARKER = ".pmd-sandbox-owner"
_TEMP_RE = re.compile(r"^pmd-sbx-p(\d+)-t(\d+)-[A-Za-z0-9_]+$")
_CGROUP_RE = re.compile(r"^pmd-sbx-p(\d+)-t(\d+)-n(\d+)-u(\d+)$")


@dataclass(frozen=True)
class Owner:
    """The host process that made a sandbox object."""

    pid: int
    start: int  # /proc/<pid>/stat field 22: start time in clock ticks after boot
    pidns: int  # inode of the owner's pid namespace
    boot: str  # /proc/sys/kernel/random/boot_id when the object was made


@dataclass
class SweepReport:
    """What one sweep removed."""

    temp_dirs: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    killed: int = 0

    def __bool__(self) -> bool:
        return bool(self.temp_dirs or self.cgroups or self.killed)


def proc_start_time(pid: int) -> int | None:
    """Start time of a live process (clock ticks after boot); None if gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after its last ')'
    rest = data[data.rfind(b")") + 2 :].split()
    try:
        state, start = rest[0], int(rest[19])
    except (IndexError, ValueError):
        return None
    return None if state in (b"Z", b"X", b"x") else start


def _pidns_inode(pid: int | str = "self") -> int:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return 0


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


_owner_lock = threading.Lock()
_owner: Owner | None = None


def current_owner() -> Owner:
    """This process as an owner (recomputed after a fork)."""
    global _owner
    with _owner_lock:
        if _owner is None or _owner.pid != os.getpid():
            pid = os.getpid()
            _owner = Owner(pid, proc_start_time(pid) or 0, _pidns_inode(), _boot_id())
        return _owner


def owner_alive(owner: Owner) -> bool:
    """Whether ``owner`` may still be running. True when it cannot be checked from here."""
    if owner.boot and owner.boot != _boot_id():
        return False  # made before the last reboot
    if owner.pidns != _pidns_inode() or not owner.start:
        return True  # another pid namespace (its pid means nothing here), or no start time
    return proc_start_time(owner.pid) == owner.start


# ----------------------------------------------------------------------------- markers


def make_temp_dir(root: str | None = None) -> str:
    """A new private temp directory that names this process as its owner (name and marker)."""
    me = current_owner()
    path = tempfile.mkdtemp(prefix=f"{PREFIX}p{me.pid}-t{me.start}-", dir=root)
    try:
        fd = os.open(os.path.join(path, MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": me.pid, "start": me.start, "pidns": me.pidns, "boot": me.boot}, f)
    except BaseException:
        remove_tree(path)
        raise
    return path


def read_temp_marker(path: str) -> Owner | None:
    """The owner of a temp directory made by ``make_temp_dir``; None without a valid marker.

    Only a real directory (not a symlink) of this user whose marker is a regular file of this
    user, with a pid and start time that agree with the directory's name, has an owner.
    """
    m = _TEMP_RE.match(os.path.basename(path))
    if m is None:
        return None
    euid = os.geteuid()
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != euid:
            return None
        fd = os.open(os.path.join(path, MARKER), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            mst = os.fstat(f.fileno())
            if not stat.S_ISREG(mst.st_mode) or mst.st_uid != euid or mst.st_size > 4096:
                return None
            d = json.loads(f.read())
        owner = Owner(int(d["pid"]), int(d["start"]), int(d["pidns"]), str(d["boot"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if (owner.pid, owner.start) != (int(m.group(1)), int(m.group(2))):
        return None
    return owner


def cgroup_name(uid: int) -> str:
    """Name of this process's cgroup for uid slot ``uid``."""
    me = current_owner()
    return f"{PREFIX}p{me.pid}-t{me.start}-n{me.pidns}-u{uid}"


def parse_cgroup_name(name: str) -> Owner | None:
    """The owner named by a cgroup's name; None if it is not one of ours.

    cgroups do not survive a reboot, so the boot is the current one.
    """
    m = _CGROUP_RE.match(name)
    if m is None:
        return None
    return Owner(int(m.group(1)), int(m.group(2)), int(m.group(3)), _boot_id())


# ----------------------------------------------------------------------------- removal


def remove_tree(path: str) -> None:
    """Remove a directory tree, also when some of its directories are read-only (0555).

    Only directories inside the tree are ever made writable: the tree's own parent (the
    system temp dir, shared with every user of the machine) is never touched, also when
    removing the top fails (another process's sweep removed it first, or it is not empty).
    """
    top = os.path.abspath(path)

    def onerror(func, p, exc_info) -> None:  # noqa: ANN001 - shutil's callback signature
        if isinstance(exc_info[1], FileNotFoundError):
            return  # already gone (a concurrent sweep of the same stale directory)
        if func in (os.unlink, os.rmdir, os.remove):
            parent = os.path.dirname(os.path.abspath(p))
            if os.path.commonpath([top, parent]) != top:
                return  # the top itself: its parent is not ours to change
            with contextlib.suppress(OSError):
                os.chmod(parent, 0o700)
            with contextlib.suppress(OSError):
                func(p)
        elif func in (os.scandir, os.listdir, os.open):
            with contextlib.suppress(OSError):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)

    if os.path.islink(path):
        return
    shutil.rmtree(path, onerror=onerror)
    if os.path.lexists(path):  # a non-root owner could not list a 0555 directory first time
        shutil.rmtree(path, ignore_errors=True)


def _cgroup_pids(d: Path) -> set[int]:
    try:
        return {int(x) for x in (d / "cgroup.procs").read_text().split()}
    except (OSError, ValueError):
        return set()


def _remove_cgroup(d: Path) -> int:
    """Kill every process in cgroup ``d``, then remove it. Returns how many were killed."""
    n = kill_until_gone(lambda: _cgroup_pids(d) - {os.getpid()}, rounds=200, pause=0.005)
    rmdir_retry(d, tries=100)
    return n


def rmdir_retry(d: Path, tries: int, pause: float = 0.01) -> None:
    """Remove the (cgroup) directory ``d``, retrying while its killed processes linger."""
    for _ in range(tries):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(pause)


def _procs_in(paths: list[str]) -> set[int]:
    """Processes whose command line or working directory lies inside one of ``paths``."""
    needles = [p.encode() + b"/" for p in paths]
    me = os.getpid()
    out: set[int] = set()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read() + b"\0"
        except OSError:
            continue
        try:
            cwd = os.readlink(f"/proc/{d}/cwd").encode() + b"/"
        except OSError:
            cwd = b""
        if any(n in cmd or cwd.startswith(n) for n in needles):
            out.add(int(d))
    return out


def kill_until_gone(find: Callable[[], set[int]], rounds: int, pause: float) -> int:
    """SIGKILL the pids ``find()`` returns until it returns none (at most ``rounds`` times,
    ``pause`` seconds apart: a fork may land between two reads). Returns how many signals."""
    n = 0
    for _ in range(rounds):
        pids = find()
        if not pids:
            break
        for p in pids:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
                n += 1
        time.sleep(pause)
    return n


def _kill_procs_in(paths: list[str]) -> int:
    return kill_until_gone(lambda: _procs_in(paths), rounds=20, pause=0.01)


def kill_uid(uid: int) -> int:
    """SIGKILL every process whose real uid is ``uid`` (root only). Returns how many."""
    if os.geteuid() != 0:
        return 0
    n = 0
    for _ in range(3):
        found = False
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/status") as f:
                    for line in f:
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) == uid:
                                os.kill(int(d), signal.SIGKILL)
                                found = True
                                n += 1
                            break
            except (OSError, ValueError):
                continue
        if not found:
            break
        time.sleep(0.01)
    return n


def user_process_count(uid: int) -> int:
    """How many processes run as ``uid`` (the owner of their /proc entry)."""
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def stale_temp_dirs(root: str | None = None) -> list[str]:
    """Temp directories under ``root`` (default: the system temp dir) whose owner is dead."""
    root = root or tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return []
    out = []
    for n in names:
        path = os.path.join(root, n)
        owner = read_temp_marker(path)
        if owner is not None and not owner_alive(owner):
            out.append(path)
    return out


def stale_cgroups(bases: Iterable[Path]) -> list[Path]:
    """Cgroups directly under ``bases`` whose owner is dead (only in our pid namespace)."""
    out = []
    for base in bases:
        try:
            names = [n for n in os.listdir(base) if n.startswith(PREFIX)]
        except OSError:
            continue
        for n in names:
            owner = parse_cgroup_name(n)
            if owner is not None and not owner_alive(owner) and (base / n).is_dir():
                out.append(base / n)
    return out


def sweep(tmp_root: str | None = None, cgroup_bases: Iterable[Path] = ()) -> SweepReport:
    """Remove the sandbox cgroups and temp directories left behind by dead owners.

    The processes still running in them are SIGKILLed first. Safe to run while other live
    processes use sandboxes: only objects with a complete marker naming a dead owner go.
    """
    report = SweepReport()
    if not current_owner().start:
        log.warning("sandbox sweep skipped: /proc/<pid>/stat is unreadable, so is liveness")
        return report
    for cg in stale_cgroups(cgroup_bases):
        report.killed += _remove_cgroup(cg)
        if not cg.exists():
            report.cgroups.append(str(cg))
    dirs = stale_temp_dirs(tmp_root)
    if dirs:
        report.killed += _kill_procs_in(dirs)
        for d in dirs:
            remove_tree(d)
            if not os.path.lexists(d):
                report.temp_dirs.append(d)
    if report:
        log.warning(
            "sandbox sweep: removed %d stale temp dirs and %d cgroups of dead processes, "
            "killed %d leftover processes",
            len(report.temp_dirs),
            len(report.cgroups),
            report.killed,
        )
    return report


_swept_pid = -1
_sweep_lock = threading.Lock()


def sweep_once(run: Callable[[], SweepReport]) -> None:
    """``run()`` (a sweep) once per process, at its first sandbox start; never raises."""
    global _swept_pid
    if _swept_pid == os.getpid():
        return
    with _sweep_lock:
        if _swept_pid == os.getpid():
            return
        _swept_pid = os.getpid()
        try:
            run()
        except Exception as e:  # noqa: BLE001 - hygiene must not stop grading
            log.warning("sandbox sweep failed: %s", e)
