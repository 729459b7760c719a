"""Which backend works here: probed once per process (``PMD_SANDBOX_BACKEND`` forces one)."""

from __future__ import annotations

import functools
import logging
import os
import stat
import tempfile

from pmd_jax.tasks.sandbox.base import (
    BACKENDS,
    BWRAP,
    PRLIMIT,
    SETPRIV,
    UNSHARE,
    Limits,
    SandboxError,
)
from pmd_jax.tasks.sandbox.cgroups import cgroup_bases
from pmd_jax.tasks.sandbox.process import run_once

log = logging.getLogger(__name__)


@functools.cache
def detect_backend() -> str:
    """The best backend that really runs a program here (probed once per process)."""
    forced = os.environ.get("PMD_SANDBOX_BACKEND")
    if forced:
        if forced not in BACKENDS:
            raise SandboxError(f"PMD_SANDBOX_BACKEND={forced!r} is not one of {BACKENDS}")
        return forced
    for b in available_backends():
        return b
    raise SandboxError(no_backend_message())


@functools.cache
def available_backends() -> tuple[str, ...]:
    """Backends whose probe (a tiny program that checks its own isolation) succeeds."""
    out = []
    _FAILED.clear()
    for b in BACKENDS:
        if b == "bwrap" and not BWRAP:
            _FAILED[b] = "bwrap is not installed"
            continue
        if b in ("bwrap", "unshare") and os.geteuid() == 0 and not SETPRIV:
            _FAILED[b] = "setpriv (util-linux) is not installed: no way to drop root"
            continue
        if b == "unshare" and (not UNSHARE or os.geteuid() != 0):
            _FAILED[b] = "needs root and unshare (util-linux)"
            continue
        if not PRLIMIT:
            _FAILED[b] = "prlimit (util-linux) is not installed"
            continue
        probe = (
            "import os,socket\n"
            "s=socket.socket()\n"
            "try:\n s.connect(('127.0.0.1',1)); r='net'\n"
            "except OSError as e: r='refused' if e.errno==111 else 'nonet'\n"
            "print(os.getuid(), r)\n"
        )
        try:
            res = run_once(probe, None, b"", None, Limits(wall_s=10.0), b, ("-I", "-S"))
        except Exception as e:  # noqa: BLE001 - a failing probe only disables a backend
            _FAILED[b] = f"probe failed: {e}"
            log.info("sandbox backend %s unavailable: %s", b, e)
            continue
        if not res.ok:
            _FAILED[b] = f"probe failed: {res.reason} {res.stderr[-300:]!r}"
            log.info("sandbox backend %s unavailable: %s %s", b, res.reason, res.stderr[-300:])
            continue
        uid_s, net = res.stdout.decode().split()
        if os.geteuid() == 0 and int(uid_s) == 0:
            _FAILED[b] = "its program still ran as root"
            continue
        if b != "rlimits" and net not in ("nonet", "refused"):
            _FAILED[b] = "its program could reach the network"
            continue
        out.append(b)
    return tuple(out)


_FAILED: dict[str, str] = {}  # why each backend is unavailable (filled by available_backends)


def untraversable_temp_dirs() -> list[str]:
    """The system temp dir and its parents that the sandbox's uid cannot enter (no search
    permission for others). Backends that drop root run the program from a directory there,
    so without a filesystem namespace (bwrap) it cannot open its own files."""
    out = []
    d = os.path.abspath(tempfile.gettempdir())
    while True:
        try:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                out.append(d)
        except OSError:
            pass
        parent = os.path.dirname(d)
        if parent == d:
            return out[::-1]
        d = parent


def no_backend_message() -> str:
    """Why no sandbox backend works here, and what would fix it."""
    lines = [f"  {b}: {_FAILED.get(b, 'not probed')}" for b in BACKENDS]
    msg = ("no sandbox backend works on this machine, so model-written code cannot be run "
           "(and code tasks cannot be graded):\n" + "\n".join(lines))
    closed = untraversable_temp_dirs() if os.geteuid() == 0 else []
    if closed:
        msg += (f"\n{closed[0]} has no search permission for other users "
                f"(mode {stat.S_IMODE(os.stat(closed[0]).st_mode):o}): the sandbox's uid cannot "
                "reach its program there. Give it its usual mode (chmod 1777 for a system "
                "temp dir), set TMPDIR to a world-searchable directory, or install bwrap.")
    return msg


def backend_info() -> dict:
    """Which backend is active and what it isolates (for logs and run reports)."""
    b = detect_backend()
    return {
        "backend": b,
        "available": list(available_backends()),
        "root_host": os.geteuid() == 0,
        "uid_drop": os.geteuid() == 0 and bool(SETPRIV),
        "network_isolated": b in ("bwrap", "unshare"),
        "filesystem_isolated": b == "bwrap",
        "pid_namespace": b in ("bwrap", "unshare"),
        "cgroup": sorted(cgroup_bases()),
    }
