"""The command line of one run, by backend: bwrap's filesystem, the uid drop, the rlimits."""

from __future__ import annotations

import contextlib
import functools
import os
import site
import sys

from pmd_jax.tasks.sandbox import sweep
from pmd_jax.tasks.sandbox.base import (
    BACKENDS,
    BWRAP,
    PRLIMIT,
    SETPRIV,
    UNSHARE,
    Limits,
    SandboxError,
)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


_BWRAP_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# bwrap mount points of ours: a Python root there cannot be bound (or would hide them)
_BWRAP_RESERVED = ("/", "/proc", "/dev", "/tmp", "/sandbox", "/code")


@functools.cache
def _python_mounts() -> tuple[tuple[str, str], ...]:
    """(host path, sandbox path) pairs that make the interpreter work inside bwrap.

    Covers the installation (``sys.prefix`` of a venv, ``sys.base_prefix``, the exec
    prefixes, the real executable's directory) and ``site.getsitepackages()``, wherever they
    live. Each is bound at its real path (so symlinks inside bound trees resolve as on the
    host), and also at its unresolved path when that differs and would not otherwise exist
    inside (e.g. a venv reached through a symlinked directory). Paths under ``/usr`` (and the
    other system dirs) or inside another bound tree are left out; parents come first.
    """

    islink = os.path.islink
    cands = [sys.base_prefix, sys.prefix, sys.exec_prefix, sys.base_exec_prefix]
    cands.append(os.path.dirname(os.path.realpath(sys.executable)))
    with contextlib.suppress(Exception):
        cands += site.getsitepackages()
    cands = [os.path.normpath(c) for c in cands if c and os.path.isabs(c) and os.path.isdir(c)]
    kept = ["/usr"] + [p for p in _BWRAP_SYSTEM_DIRS if os.path.isdir(p) and not os.path.islink(p)]
    out: list[tuple[str, str]] = []
    for real in sorted({os.path.realpath(c) for c in cands}):
        if real in _BWRAP_RESERVED or any(_under(real, k) for k in kept):
            continue
        kept.append(real)
        out.append((real, real))
    for c in sorted(set(cands)):
        real = os.path.realpath(c)
        top = os.sep + c.split(os.sep)[1]
        if c == real or c in _BWRAP_RESERVED or (top in _BWRAP_SYSTEM_DIRS and islink(top)):
            continue  # already bound, or reached through a symlink the sandbox also has
        if any(_under(c, k) for k in kept):
            continue  # inside a bound tree: resolves there as on the host
        kept.append(c)
        out.append((real, c))
    return tuple(out)


def python_executable() -> str:
    """The real interpreter (not a shim such as pyenv's, which would need $HOME etc.)."""
    return os.path.realpath(sys.executable)


def _world_readable(path: str) -> bool:
    """True if every directory above ``path`` is o+x and ``path`` itself is o+r."""
    p = os.path.realpath(path)
    parts = p.split(os.sep)
    for i in range(2, len(parts)):
        d = os.sep.join(parts[:i]) or os.sep
        try:
            if not os.stat(d).st_mode & 0o001:
                return False
        except OSError:
            return False
    try:
        return bool(os.stat(p).st_mode & 0o004)
    except OSError:
        return False


def interpreter_for(backend: str) -> str:
    """The interpreter a backend runs programs with.

    bwrap mounts the host interpreter's installation into a fresh root, so it is always
    usable. Without bwrap the program runs as an unprivileged uid on the host filesystem; if
    the host interpreter lives under a private directory (e.g. pyenv under /root), a
    world-readable system ``python3`` is used instead (stdlib only: the host's site-packages
    are not readable then). Raises SandboxError when there is none.
    """
    exe = python_executable()
    if backend == "bwrap" or os.geteuid() != 0:
        return exe
    stdlib = os.path.join(
        sys.base_prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "os.py"
    )
    if _world_readable(exe) and _world_readable(stdlib):
        return exe
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/python3"):
        if os.path.exists(cand) and _world_readable(cand):
            return cand
    raise SandboxError(
        f"backend {backend}: the interpreter {exe} is not readable by an unprivileged uid and "
        "no world-readable python3 exists"
    )


def _bwrap_fs_args(tmpfs_bytes: int) -> list[str]:
    """The sandbox's filesystem: system dirs, /proc, /dev, fresh /sandbox and /tmp, Python.

    The Python installation is bound after the tmpfs mounts, so a venv or interpreter that
    lives under /tmp (or any other path) stays visible, read-only, on top of the fresh /tmp.
    """
    args = ["--ro-bind", "/usr", "/usr"]
    for p in _BWRAP_SYSTEM_DIRS:
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    args += ["--proc", "/proc", "--dev", "/dev"]
    for d in ("/sandbox", "/tmp"):
        args += ["--perms", "1777", "--size", str(tmpfs_bytes), "--tmpfs", d]
    made: set[str] = {"/tmp", "/sandbox"}
    for src, dest in _python_mounts():
        # bwrap would create the parents of a bind with the host's modes; /root is 0700,
        # which would hide e.g. a pyenv interpreter (and its libpython RUNPATH) from the uid
        parts = dest.split(os.sep)
        for i in range(2, len(parts)):
            d = os.sep.join(parts[:i])
            if d not in made:
                made.add(d)
                args += ["--perms", "0755", "--dir", d]
        args += ["--ro-bind", src, dest]
    return args


_SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def _setpriv_args(uid: int) -> list[str]:
    return [
        SETPRIV or "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
    ]


def _init_shell(argv: list[str]) -> list[str]:
    """A shell as the pid namespace's init, running ``argv`` as pid 2 and exiting with its
    status: the kernel does not deliver SIGXCPU / SIGKILL-on-hard-limit to a namespace's
    init, and the program cannot signal its init from inside the namespace."""
    return ["/bin/sh", "-c", '"$@"; exit $?', "sh", *argv]


def build_command(
    backend: str,
    argv: list[str],
    code_dir: str,
    work_dir: str,
    uid: int | None,
    limits: Limits,
) -> tuple[list[str], str | None, dict[str, str]]:
    """(command, cwd for Popen, env for Popen) for a backend. ``argv`` uses sandbox paths."""
    root = os.geteuid() == 0
    if backend == "bwrap":
        cmd = [
            BWRAP or "bwrap",
            *_bwrap_fs_args(limits.tmpfs_bytes),
            "--ro-bind",
            code_dir,
            "/code",
            "--unshare-net",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--chdir",
            "/sandbox",
        ]
        env_args: list[str] = []
        for k, v in {**_SANDBOX_ENV, "HOME": "/sandbox", "TMPDIR": "/tmp"}.items():
            env_args += ["--setenv", k, v]
        cmd += env_args
        # --as-pid-1 with a shell as the namespace's init: bwrap's own init would be left a
        # zombie of the host's pid 1 at every run (the outer bwrap exits on the status the
        # init reports, without reaping it), and each such zombie stays charged to the slot
        # cgroup's pids.max until pid 1 reaps it; where pid 1 reaps late (containers, VMs),
        # about 20 runs in a row failed with "bwrap: Can't fork for pid 1". Now the outer
        # bwrap waits for its one child, the shell, which the kernel reaps its namespace for.
        cmd.append("--as-pid-1")
        if root:
            cmd += ["--", *_setpriv_args(uid), *_init_shell(argv)]  # type: ignore[arg-type]
        else:
            cmd += ["--unshare-user", "--disable-userns", "--", *_init_shell(argv)]
        return cmd, None, {}
    env = {**_SANDBOX_ENV, "HOME": work_dir, "TMPDIR": work_dir}
    if backend == "unshare":
        cmd = [
            UNSHARE or "unshare",
            "--net",
            "--pid",
            "--fork",
            "--kill-child",
            "--ipc",
            "--uts",
            "--mount",
            "--mount-proc",
            "--",
            *_setpriv_args(uid),  # type: ignore[arg-type]
            *_init_shell(argv),
        ]
        return cmd, work_dir, env
    if backend == "rlimits":
        cmd = ([*_setpriv_args(uid)] if root and SETPRIV else []) + argv  # type: ignore[arg-type]
        return cmd, work_dir, env
    raise SandboxError(f"unknown sandbox backend {backend!r}; choose one of {BACKENDS}")


def prlimit_args(limits: Limits) -> list[str]:
    cpu = max(1, int(limits.cpu_s + 0.999))
    nproc = limits.nproc
    if os.geteuid() != 0:
        # no dedicated uid: RLIMIT_NPROC counts every process of this user, so the limit is
        # set above what the user already runs (untested here: the dev machine runs as root)
        nproc += sweep.user_process_count(os.geteuid())
    return [
        PRLIMIT or "prlimit",
        f"--cpu={cpu}:{cpu + 1}",
        f"--as={limits.memory_bytes}",
        f"--nofile={limits.nofile}",
        f"--fsize={limits.fsize_bytes}",
        f"--nproc={nproc}",
        "--core=0",
        "--",
    ]
