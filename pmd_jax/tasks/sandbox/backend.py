"""Which backend works here: probed once per process (``PMD_SANDBOX_BACKEND`` forces one)."""

from __future__ import annotations

import functools
import logging
import os

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
    return "rlimits"


@functools.cache
def available_backends() -> tuple[str, ...]:
    """Backends whose probe (a tiny program that checks its own isolation) succeeds."""
    out = []
    for b in BACKENDS:
        if b == "bwrap" and not BWRAP:
            continue
        if b in ("bwrap", "unshare") and os.geteuid() == 0 and not SETPRIV:
            continue
        if b == "unshare" and (not UNSHARE or os.geteuid() != 0):
            continue
        if not PRLIMIT:
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
            log.info("sandbox backend %s unavailable: %s", b, e)
            continue
        if not res.ok:
            log.info("sandbox backend %s unavailable: %s %s", b, res.reason, res.stderr[-300:])
            continue
        uid_s, net = res.stdout.decode().split()
        if os.geteuid() == 0 and int(uid_s) == 0:
            continue
        if b != "rlimits" and net not in ("nonet", "refused"):
            continue
        out.append(b)
    return tuple(out)


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
