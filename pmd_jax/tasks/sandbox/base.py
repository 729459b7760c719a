"""The sandbox's vocabulary: backend names, limits, a run's result, its error, the tools."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field

BACKENDS = ("bwrap", "unshare", "rlimits")


@dataclass(frozen=True)
class Limits:
    cpu_s: float = 10.0
    wall_s: float = 20.0
    memory_bytes: int = 1 << 30  # RLIMIT_AS per process
    tree_memory_bytes: int = 2 << 30  # cgroup limit for the whole tree (when available)
    nproc: int = 16
    nofile: int = 64
    fsize_bytes: int = 16 << 20
    output_bytes: int = 4 << 20  # stdout and stderr, each
    tmpfs_bytes: int = 64 << 20


@dataclass
class ExecResult:
    """Outcome of one sandboxed run.

    status: "ok" (exit 0), "exit_nonzero", "timeout" (wall), "cpu_limit", "memory_limit",
    "output_limit", "file_size_limit", "signal", "sandbox_error".
    """

    status: str
    returncode: int | None
    stdout: bytes
    stderr: bytes
    reason: str
    wall_s: float
    backend: str
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class SandboxError(RuntimeError):
    pass


# the tools the backends use (None where absent)
SETPRIV = shutil.which("setpriv")
BWRAP = shutil.which("bwrap")
UNSHARE = shutil.which("unshare")
PRLIMIT = shutil.which("prlimit")
