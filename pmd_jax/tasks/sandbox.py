"""Run untrusted Python programs in an isolated child process.

Candidate programs never run in the trainer's process. Each run is one child process tree with:

- limits: CPU time (RLIMIT_CPU), wall time (host-side deadline, then SIGKILL of the whole
  tree), memory (RLIMIT_AS per process, plus a cgroup memory limit for the whole tree when
  cgroups are writable), process count (RLIMIT_NPROC for a dedicated unprivileged uid, plus a
  cgroup pids limit when available), open files (RLIMIT_NOFILE), file size (RLIMIT_FSIZE),
  output size (the host stops reading and kills the tree past ``output_bytes``), no core
  dumps;
- an empty temporary working directory, a clean environment, no network, killed as a unit.

Backends, best first (``detect_backend()`` probes what actually works on this machine; the
environment variable ``PMD_SANDBOX_BACKEND`` forces one):

``bwrap``
    bubblewrap (Debian package ``bubblewrap``). New mount, pid, net, ipc and uts namespaces; a
    minimal read-only filesystem (``/usr`` and the Python installation only), tmpfs ``/sandbox``
    (cwd) and ``/tmp`` with a size cap, program files read-only under ``/code``. The Python
    installation and site-packages are bound after the tmpfs mounts, at their host paths, so a
    venv under /tmp, /root, a home directory or a conda prefix stays visible. When the host
    runs as root, the program itself runs as a dedicated unprivileged uid (``setpriv``), so
    RLIMIT_NPROC applies (it never applies to root) and it cannot signal host processes. When
    the host is not root, bwrap makes an unprivileged user namespace instead.
``unshare``
    util-linux ``unshare`` (root only): new net, pid, ipc, uts and mount namespaces, uid drop via
    ``setpriv``. The filesystem is the host's, protected only by permissions: the program can
    read world-readable files and write only world-writable directories.
``rlimits``
    No namespaces: rlimits, a new session, the uid drop when root, and a cleanup that kills
    every process of that uid. No network isolation. Used only when nothing else works.

Processes are confined to a pid namespace in the first two backends, so daemons (double
fork, setsid) die with the namespace when the run ends. After every run, whatever is left in
the run's cgroup (or, without cgroups, every process of the run's uid) is killed. The temp
directories and cgroups name their owner, so those of a host process that was SIGKILLed are
swept at the next process's first sandbox start (``sandbox_sweep``).

``run_python`` starts one sandbox per call. ``WarmPool`` starts sandboxes ahead of time, each
waiting for its job on stdin and used once; the code verifier uses it so that namespace and
interpreter start-up overlap with the previous job.

Not covered: this is not a defence against kernel exploits; the ``unshare`` and ``rlimits``
fallbacks leave the host filesystem readable (by permissions) and ``rlimits`` leaves the
network reachable (``backend_info()`` says so).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pmd_jax.tasks import sandbox_sweep

log = logging.getLogger(__name__)

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


_SETPRIV = shutil.which("setpriv")
_BWRAP = shutil.which("bwrap")
_UNSHARE = shutil.which("unshare")
_PRLIMIT = shutil.which("prlimit")

# Dedicated uids for sandboxed programs (root host only). One per concurrent run, from a
# range chosen by the host pid (re-chosen after a fork), so two host processes rarely share.
_UID_SLOTS = 32
_uid_lock = threading.Lock()
_uid_owner = -1
_uid_free: list[int] = []


def _uid_base(pid: int) -> int:
    return 200_000 + (pid % 40_000) * _UID_SLOTS


def _acquire_uid() -> int:
    global _uid_owner, _uid_free
    with _uid_lock:
        if _uid_owner != os.getpid():  # first use, or we are a forked child
            _uid_owner = os.getpid()
            base = _uid_base(_uid_owner)
            _uid_free = list(range(base, base + _UID_SLOTS))
        if not _uid_free:
            raise SandboxError(f"more than {_UID_SLOTS} concurrent sandbox runs in one process")
        return _uid_free.pop()


def _release_uid(uid: int) -> None:
    with _uid_lock:
        if _uid_owner == os.getpid() and uid not in _uid_free:
            _uid_free.append(uid)


# ----------------------------------------------------------------------------- cgroups


class _Cgroup:
    """A cgroup for one uid slot (v1 memory+pids hierarchies, or v2 unified) when writable.

    Created once per slot and reused (mkdir/rmdir per run costs tens of ms); the limits are
    rewritten and the OOM / pids-limit counters re-read as a baseline at every run; all
    groups are removed at exit. The name marks the owner (``sandbox_sweep.cgroup_name``), so
    the groups of a process that was killed are swept by the next one.
    """

    _by_uid: dict[int, _Cgroup] = {}
    _owner_pid = -1  # the process that made the groups in _by_uid (not a forked child)
    _lock = threading.Lock()

    def __init__(self, dirs: dict[str, Path]):
        self.dirs = dirs
        self._oom0 = 0
        self._pids0 = 0

    @classmethod
    def for_uid(cls, uid: int, limits: Limits) -> _Cgroup | None:
        base = _cgroup_bases()
        if not base:
            return None
        with cls._lock:
            if cls._owner_pid != os.getpid():  # a forked child: the parent's are not ours
                cls._by_uid, cls._owner_pid = {}, os.getpid()
            cg = cls._by_uid.get(uid)
            if cg is None:
                cg = cls._make(base, sandbox_sweep.cgroup_name(uid))
                if cg is None:
                    return None
                cls._by_uid[uid] = cg
        try:
            cg._set_limits(limits)
        except OSError as e:
            log.debug("cgroup limits failed: %s", e)
            return None
        cg._oom0, cg._pids0 = cg._oom_count(), cg._pids_count()
        return cg

    @classmethod
    def _make(cls, base: dict[str, Path], name: str) -> _Cgroup | None:
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

    def _pids_count(self) -> int:
        d = self.dirs.get("pids") or self.dirs.get("unified")
        try:
            if d is not None:
                for ln in (d / "pids.events").read_text().splitlines():
                    if ln.startswith("max"):
                        return int(ln.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        return 0

    def oom_killed(self) -> bool:
        return self._oom_count() > self._oom0

    def pids_limited(self) -> bool:
        return self._pids_count() > self._pids0

    def kill_all(self) -> int:
        def pids() -> set[int]:
            out: set[int] = set()
            for d in self.dirs.values():
                with contextlib.suppress(OSError, ValueError):
                    out |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
            return out

        return sandbox_sweep.kill_until_gone(pids, rounds=50, pause=0.005)

    def destroy(self) -> None:
        self.kill_all()
        for d in self.dirs.values():
            sandbox_sweep.rmdir_retry(d, tries=50)

    @classmethod
    def destroy_all(cls) -> None:
        with cls._lock:
            if cls._owner_pid == os.getpid():
                for cg in cls._by_uid.values():
                    cg.destroy()
            cls._by_uid.clear()


atexit.register(_Cgroup.destroy_all)


@functools.cache
def _cgroup_bases() -> dict[str, Path]:
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


# ----------------------------------------------------------------------------- backends


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
    import site

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
        _SETPRIV or "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
    ]


def _build_command(
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
            _BWRAP or "bwrap",
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
        if root:
            cmd += ["--", *_setpriv_args(uid), *argv]  # type: ignore[arg-type]
        else:
            cmd += ["--unshare-user", "--disable-userns", "--", *argv]
        return cmd, None, {}
    env = {**_SANDBOX_ENV, "HOME": work_dir, "TMPDIR": work_dir}
    if backend == "unshare":
        # a shell is the namespace's pid 1 and runs the program as pid 2: the kernel does not
        # deliver SIGXCPU / SIGKILL-on-hard-limit to a pid-namespace init
        cmd = [
            _UNSHARE or "unshare",
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
            "/bin/sh",
            "-c",
            '"$@"; exit $?',
            "sh",
            *argv,
        ]
        return cmd, work_dir, env
    if backend == "rlimits":
        cmd = ([*_setpriv_args(uid)] if root and _SETPRIV else []) + argv  # type: ignore[arg-type]
        return cmd, work_dir, env
    raise SandboxError(f"unknown sandbox backend {backend!r}; choose one of {BACKENDS}")


def _prlimit_args(limits: Limits) -> list[str]:
    cpu = max(1, int(limits.cpu_s + 0.999))
    nproc = limits.nproc
    if os.geteuid() != 0:
        # no dedicated uid: RLIMIT_NPROC counts every process of this user, so the limit is
        # set above what the user already runs (untested here: the dev machine runs as root)
        nproc += sandbox_sweep.user_process_count(os.geteuid())
    return [
        _PRLIMIT or "prlimit",
        f"--cpu={cpu}:{cpu + 1}",
        f"--as={limits.memory_bytes}",
        f"--nofile={limits.nofile}",
        f"--fsize={limits.fsize_bytes}",
        f"--nproc={nproc}",
        "--core=0",
        "--",
    ]


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
        if b == "bwrap" and not _BWRAP:
            continue
        if b in ("bwrap", "unshare") and os.geteuid() == 0 and not _SETPRIV:
            continue
        if b == "unshare" and (not _UNSHARE or os.geteuid() != 0):
            continue
        if not _PRLIMIT:
            continue
        probe = (
            "import os,socket\n"
            "s=socket.socket()\n"
            "try:\n s.connect(('127.0.0.1',1)); r='net'\n"
            "except OSError as e: r='refused' if e.errno==111 else 'nonet'\n"
            "print(os.getuid(), r)\n"
        )
        try:
            res = run_python(probe, backend=b, limits=Limits(wall_s=10.0))
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
        "uid_drop": os.geteuid() == 0 and bool(_SETPRIV),
        "network_isolated": b in ("bwrap", "unshare"),
        "filesystem_isolated": b == "bwrap",
        "pid_namespace": b in ("bwrap", "unshare"),
        "cgroup": sorted(_cgroup_bases()),
    }


# ----------------------------------------------------------------------------- running


@dataclass
class _Started:
    """A sandboxed process that has been started and may still be waiting for its stdin."""

    proc: subprocess.Popen
    tmp: str
    uid: int | None
    cg: _Cgroup | None
    backend: str
    limits: Limits


def _start(
    script: str,
    files: dict[str, str | bytes] | None,
    args: list[str] | None,
    limits: Limits,
    backend: str,
    python_flags: tuple[str, ...],
) -> _Started:
    sandbox_sweep.sweep_once(sweep_stale)  # the first start in a process sweeps
    tmp = sandbox_sweep.make_temp_dir()
    uid: int | None = None
    try:
        code_dir = os.path.join(tmp, "code")
        work_dir = os.path.join(tmp, "work")
        os.mkdir(code_dir)
        os.mkdir(work_dir)
        all_files = {"main.py": script, **(files or {})}
        for name, content in all_files.items():
            if "/" in name or name.startswith("."):
                raise SandboxError(f"bad sandbox file name {name!r}")
            data = content.encode("utf-8") if isinstance(content, str) else content
            with open(os.path.join(code_dir, name), "wb") as f:
                f.write(data)
            os.chmod(os.path.join(code_dir, name), 0o444)
        os.chmod(code_dir, 0o555)
        os.chmod(tmp, 0o755)
        os.chmod(work_dir, 0o1777)
        in_code = "/code" if backend == "bwrap" else code_dir
        argv = [interpreter_for(backend), *python_flags, f"{in_code}/main.py", *(args or [])]
        if not (backend == "rlimits" and os.geteuid() != 0):
            uid = _acquire_uid()
        cmd, cwd, env = _build_command(backend, argv, code_dir, work_dir, uid, limits)
        cmd = _prlimit_args(limits) + cmd
        cg = _Cgroup.for_uid(uid, limits) if uid is not None else None
        if cg is not None:
            # join the cgroup before exec, so nothing escapes it
            joins = " && ".join(f'echo $$ > "{p}"' for p in cg.procs_files())
            cmd = ["/bin/sh", "-c", f'{joins} && exec "$@"', "sh", *cmd]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
    except BaseException:
        if uid is not None:
            _release_uid(uid)
        sandbox_sweep.remove_tree(tmp)
        raise
    return _Started(proc, tmp, uid, cg, backend, limits)


def _cleanup(st: _Started) -> None:
    """Kill whatever is left of a run and release its uid and files."""
    _kill_tree(st.proc)
    with contextlib.suppress(ChildProcessError, OSError):
        if st.proc.returncode is None:
            os.waitpid(st.proc.pid, 0)
    for f in (st.proc.stdin, st.proc.stdout, st.proc.stderr):
        with contextlib.suppress(OSError):
            f.close()  # type: ignore[union-attr]
    # nothing of the run may outlive it (daemons, stopped processes)
    if st.cg is not None:
        st.cg.kill_all()
    elif st.uid is not None:
        sandbox_sweep.kill_uid(st.uid)
    if st.uid is not None:
        _release_uid(st.uid)
    sandbox_sweep.remove_tree(st.tmp)


def sweep_stale() -> sandbox_sweep.SweepReport:
    """Remove the sandbox temp dirs and cgroups of dead processes (see ``sandbox_sweep``)."""
    return sandbox_sweep.sweep(tempfile.gettempdir(), _cgroup_bases().values())


def _finish(
    st: _Started, stdin: bytes, limits: Limits | None = None, done_marker: bytes | None = None
) -> ExecResult:
    try:
        return _communicate(st.proc, stdin, limits or st.limits, st.backend, st.cg, done_marker)
    finally:
        _cleanup(st)


def run_python(
    script: str,
    *,
    files: dict[str, str | bytes] | None = None,
    stdin: bytes = b"",
    args: list[str] | None = None,
    limits: Limits = Limits(),
    backend: str | None = None,
    python_flags: tuple[str, ...] = ("-I", "-S"),
) -> ExecResult:
    """Run ``script`` (Python source) in a sandbox; never raises for program behaviour.

    ``files`` are written read-only next to the script (``/code`` in bwrap). The script's
    cwd is an empty writable temporary directory. ``-I -S`` by default: isolated mode, no
    site-packages (a runner may add them to sys.path itself).
    """
    backend = backend or detect_backend()
    try:
        st = _start(script, files, args, limits, backend, python_flags)
    except OSError as e:
        return ExecResult(
            "sandbox_error", None, b"", b"", f"sandbox failed to start: {e}", 0.0, backend
        )
    return _finish(st, stdin)


class WarmPool:
    """Sandboxes started ahead of time, each waiting for its job on stdin.

    Start-up (namespaces, interpreter, imports) overlaps with the previous job; isolation is
    unchanged: every job still gets its own fresh sandbox, used once. ``limits.wall_s`` and
    ``output_bytes`` can be set per job; the CPU and memory limits are the pool's.

    The waiting sandboxes are started by the pool's own long-lived thread: bwrap's
    ``--die-with-parent`` (PR_SET_PDEATHSIG) fires when the *thread* that started the child
    exits, so a sandbox pre-started by a short-lived worker (``verify_batch``'s executor)
    would be killed while it waits for its job.
    """

    def __init__(
        self,
        script: str,
        files: dict[str, str | bytes] | None,
        limits: Limits,
        size: int,
        backend: str | None = None,
        python_flags: tuple[str, ...] = ("-I", "-S"),
    ):
        self.script, self.files, self.limits = script, dict(files or {}), limits
        self.size = max(1, size)
        self.backend = backend or detect_backend()
        self.python_flags = python_flags
        self._ready: list[_Started] = []
        self._lock = threading.Lock()
        self._closed = False
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pmd-sandbox-pool")
        # stop the waiting sandboxes when the pool is collected or at interpreter exit
        self._finalizer = weakref.finalize(
            self, _discard_all, self._ready, self._lock, self._starter
        )

    def _new(self) -> _Started:
        return _start(self.script, self.files, None, self.limits, self.backend, self.python_flags)

    def run(
        self, stdin: bytes, limits: Limits | None = None, done_marker: bytes | None = None
    ) -> ExecResult:
        """Run one job. With ``done_marker``, the job is complete as soon as stdout holds a
        full line starting with it (the sandbox is then killed instead of waiting for its
        teardown); the marker should be a per-job secret (a nonce)."""
        try:
            st = self.acquire()
        except OSError as e:
            return ExecResult(
                "sandbox_error", None, b"", b"", f"sandbox failed to start: {e}", 0.0, self.backend
            )
        return _finish(st, stdin, limits, done_marker)

    def acquire(self) -> _Started:
        """A started sandbox, still waiting for its stdin, for a caller that talks to it
        itself (and must ``_cleanup`` it). The pool is refilled."""
        st = None
        with self._lock:
            while self._ready and st is None:
                cand = self._ready.pop(0)
                if cand.proc.poll() is None:
                    st = cand
                else:  # died while waiting (should not happen): discard
                    _cleanup(cand)
        if st is None:
            st = self._new()
        try:
            self.fill()
        except OSError:
            pass  # the next job starts its own
        return st

    def fill(self) -> None:
        with self._lock:
            while not self._closed and len(self._ready) < self.size:
                self._ready.append(self._starter.submit(self._new).result())

    def close(self) -> None:
        self._closed = True
        self._finalizer()


def _discard_all(
    ready: list[_Started], lock: threading.Lock, starter: ThreadPoolExecutor | None = None
) -> None:
    with lock:
        items = list(ready)
        ready.clear()
    for st in items:
        _cleanup(st)
    if starter is not None:
        starter.shutdown(wait=False)


def _communicate(
    proc: subprocess.Popen,
    stdin: bytes,
    limits: Limits,
    backend: str,
    cg: _Cgroup | None,
    done_marker: bytes | None = None,
) -> ExecResult:
    t0 = time.monotonic()
    out = bytearray()
    err = bytearray()
    cpu = 0.0
    over = None
    timed_out = False
    completed = False
    sel = selectors.DefaultSelector()
    assert proc.stdin and proc.stdout and proc.stderr
    os.set_blocking(proc.stdin.fileno(), False)
    pending = memoryview(stdin)
    if pending:
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    deadline = t0 + limits.wall_s
    open_reads = 2
    exited_at: float | None = None
    try:
        while open_reads:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                timed_out = True
                break
            if exited_at is None and _has_exited(proc.pid):
                exited_at = now
            if exited_at is not None and now - exited_at > _EXIT_GRACE_S:
                # the program is done; a leftover (daemon) still holds the pipes open
                break
            for key, _ in sel.select(timeout=min(left, 0.05 if exited_at else 0.25)):
                if key.fileobj is proc.stdin:
                    try:
                        n = os.write(proc.stdin.fileno(), pending[:65536])
                        pending = pending[n:]
                    except (BrokenPipeError, OSError):
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(proc.stdin)
                        with contextlib.suppress(OSError):
                            proc.stdin.close()
                    continue
                chunk = os.read(key.fileobj.fileno(), 65536)  # type: ignore[union-attr]
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_reads -= 1
                    continue
                buf: bytearray = key.data
                buf += chunk
                if len(buf) > limits.output_bytes:
                    del buf[limits.output_bytes :]
                    over = "stdout" if buf is out else "stderr"
                    break
                if done_marker and buf is out and _has_done_line(out, done_marker):
                    completed = True
                    break
            if over or completed:
                break
        if over or timed_out or completed:
            _kill_tree(proc)
        rc, cpu = _wait(proc, max(0.5, deadline - time.monotonic() + 1.0))
        if rc is None:
            timed_out = True
            _kill_tree(proc)
            rc, cpu = _wait(proc, None)
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                f.close()
        _kill_tree(proc)
    wall = time.monotonic() - t0
    if completed:
        return ExecResult(
            "ok",
            rc,
            bytes(out),
            bytes(err),
            "completed (done marker seen)",
            wall,
            backend,
            {"cpu_s": round(cpu, 4)},
        )
    status, reason = _classify(rc, bytes(err), timed_out, over, limits, cg, cpu)
    return ExecResult(
        status, rc, bytes(out), bytes(err), reason, wall, backend, {"cpu_s": round(cpu, 4)}
    )


_EXIT_GRACE_S = 0.25


def _has_done_line(out: bytearray, marker: bytes) -> bool:
    i = out.rfind(marker)
    return i >= 0 and (i == 0 or out[i - 1] == 10) and out.find(b"\n", i) >= 0


def _has_exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its rusage is read by _wait)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _wait(proc: subprocess.Popen, timeout: float | None) -> tuple[int | None, float]:
    """(return code, CPU seconds of the whole waited-for tree) via wait4; (None, 0) on timeout.

    The rusage of a reaped child includes its descendants that were reaped in turn (bwrap and
    unshare reap theirs), so CPU-limit kills are recognised in every backend.
    """
    end = None if timeout is None else time.monotonic() + timeout
    delay = 0.0005
    while True:
        try:
            pid, status, ru = os.wait4(proc.pid, 0 if end is None else os.WNOHANG)
        except ChildProcessError:
            return (proc.returncode if proc.returncode is not None else -9), 0.0
        if pid:
            rc = os.waitstatus_to_exitcode(status)
            proc.returncode = rc
            return rc, ru.ru_utime + ru.ru_stime
        if end is not None and time.monotonic() >= end:
            return None, 0.0
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def _kill_tree(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        proc.kill()


def _classify(
    rc: int | None,
    err: bytes,
    timed_out: bool,
    over: str | None,
    limits: Limits,
    cg: _Cgroup | None,
    cpu: float,
) -> tuple[str, str]:
    if over:
        return "output_limit", f"output limit exceeded: {over} passed {limits.output_bytes} bytes"
    if timed_out:
        return "timeout", f"wall-clock limit of {limits.wall_s:g}s exceeded"
    if cg is not None and cg.oom_killed():
        return "memory_limit", (
            f"memory limit exceeded (tree limit {limits.tree_memory_bytes >> 20} MiB)"
        )
    last = _last_line(err)
    if rc == 0:
        return "ok", "exited normally"
    sig = -rc if rc is not None and rc < 0 else (rc - 128 if rc is not None and rc > 128 else 0)
    if "MemoryError" in last:
        return "memory_limit", (
            f"memory limit exceeded (MemoryError; limit {limits.memory_bytes >> 20} MiB)"
        )
    if sig == signal.SIGXCPU or cpu >= 0.98 * max(1, int(limits.cpu_s + 0.999)):
        return "cpu_limit", f"CPU time limit of {limits.cpu_s:g}s exceeded"
    if sig == signal.SIGXFSZ:
        return "file_size_limit", f"file size limit of {limits.fsize_bytes} bytes exceeded"
    if sig == signal.SIGKILL:
        return "signal", "killed by SIGKILL"
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return "signal", f"killed by {name}"
    return "exit_nonzero", f"exit status {rc}" + (f": {last}" if last else "")


def _last_line(err: bytes) -> str:
    lines = [ln for ln in err.decode("utf-8", "replace").strip().splitlines() if ln.strip()]
    return lines[-1].strip()[:300] if lines else ""
