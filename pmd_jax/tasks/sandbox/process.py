"""One sandboxed process: start it, talk to it (stdin, bounded output, deadline), classify
how it ended, and remove everything it left."""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pmd_jax.tasks.sandbox import sweep
from pmd_jax.tasks.sandbox.base import ExecResult, Limits, SandboxError
from pmd_jax.tasks.sandbox.cgroups import Cgroup, cgroup_bases
from pmd_jax.tasks.sandbox.command import build_command, interpreter_for, prlimit_args
from pmd_jax.tasks.sandbox.uids import acquire_uid, release_uid

T = TypeVar("T")
log = logging.getLogger(__name__)
_DRAIN_S = 2.0  # how long a finished run's slot may take to be uncharged


@dataclass
class Started:
    """A sandboxed process that has been started and may still be waiting for its stdin."""

    proc: subprocess.Popen
    tmp: str
    uid: int | None
    cg: Cgroup | None
    backend: str
    limits: Limits


def start(
    script: str,
    files: dict[str, str | bytes] | None,
    args: list[str] | None,
    limits: Limits,
    backend: str,
    python_flags: tuple[str, ...],
) -> Started:
    sweep.sweep_once(sweep_stale)  # the first start in a process sweeps
    tmp = sweep.make_temp_dir()
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
            uid = acquire_uid()
        cmd, cwd, env = build_command(backend, argv, code_dir, work_dir, uid, limits)
        cmd = prlimit_args(limits) + cmd
        cg = Cgroup.for_uid(uid, limits) if uid is not None else None
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
            release_uid(uid)
        sweep.remove_tree(tmp)
        raise
    return Started(proc, tmp, uid, cg, backend, limits)


def cleanup(st: Started) -> None:
    """Kill whatever is left of a run and release its uid and files."""
    kill_tree(st.proc, st.backend)
    with contextlib.suppress(ChildProcessError, OSError):
        if st.proc.returncode is None:
            os.waitpid(st.proc.pid, 0)
    for f in (st.proc.stdin, st.proc.stdout, st.proc.stderr):
        with contextlib.suppress(OSError):
            f.close()  # type: ignore[union-attr]
    # nothing of the run may outlive it (daemons, stopped processes)
    if st.cg is not None:
        st.cg.kill_all()
        # and the slot goes back with its whole pids.max: a killed task stays charged until
        # it is reaped, which can trail the kill (seen once in CI: one task still charged
        # right after a run that ended normally)
        cg = st.cg
        if _poll(lambda: cg.charged() == 0 or None, _DRAIN_S) is None:
            log.warning(
                "sandbox slot %s still holds %d processes %.0f s after its run was reaped "
                "(zombies of a parent that does not reap them); its next runs have fewer "
                "processes",
                st.uid,
                cg.charged(),
                _DRAIN_S,
            )
    elif st.uid is not None:
        sweep.kill_uid(st.uid)
    if st.uid is not None:
        release_uid(st.uid)
    sweep.remove_tree(st.tmp)


def sweep_stale() -> sweep.SweepReport:
    """Remove the sandbox temp dirs and cgroups of dead processes (see ``sweep``)."""
    return sweep.sweep(tempfile.gettempdir(), cgroup_bases().values())


def finish(
    st: Started, stdin: bytes, limits: Limits | None = None, done_marker: bytes | None = None
) -> ExecResult:
    try:
        return _communicate(st.proc, stdin, limits or st.limits, st.backend, st.cg, done_marker)
    finally:
        cleanup(st)


def run_once(
    script: str,
    files: dict[str, str | bytes] | None,
    stdin: bytes,
    args: list[str] | None,
    limits: Limits,
    backend: str,
    python_flags: tuple[str, ...],
) -> ExecResult:
    """Start one sandbox, feed it ``stdin`` and collect the result (``run_python`` with its
    backend chosen); a sandbox that fails to start is a "sandbox_error" result."""
    try:
        st = start(script, files, args, limits, backend, python_flags)
    except OSError as e:
        return ExecResult(
            "sandbox_error", None, b"", b"", f"sandbox failed to start: {e}", 0.0, backend
        )
    return finish(st, stdin)


def _communicate(
    proc: subprocess.Popen,
    stdin: bytes,
    limits: Limits,
    backend: str,
    cg: Cgroup | None,
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
            kill_tree(proc, backend)
        rc, cpu = wait(proc, max(0.5, deadline - time.monotonic() + 1.0))
        if rc is None:
            timed_out = True
            kill_tree(proc, backend)
            rc, cpu = wait(proc, None)
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                f.close()
        kill_tree(proc, backend)
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
    """Whether the child has exited, without reaping it (its rusage is read by wait)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def wait(proc: subprocess.Popen, timeout: float | None) -> tuple[int | None, float]:
    """(return code, CPU seconds of the whole waited-for tree) via wait4; (None, 0) on timeout.

    The rusage of a reaped child includes its descendants that were reaped in turn (bwrap and
    unshare reap theirs), so CPU-limit kills are recognised in every backend.
    """

    def reaped() -> tuple[int, float] | None:
        try:
            pid, status, ru = os.wait4(proc.pid, 0 if timeout is None else os.WNOHANG)
        except ChildProcessError:
            return (proc.returncode if proc.returncode is not None else -9), 0.0
        if not pid:
            return None
        proc.returncode = os.waitstatus_to_exitcode(status)
        return proc.returncode, ru.ru_utime + ru.ru_stime

    return _poll(reaped, timeout) or (None, 0.0)


def _poll(check: Callable[[], T | None], timeout: float | None) -> T | None:
    """``check()`` until it returns something other than None, sleeping 0.5 ms doubling to
    20 ms between calls; None once ``timeout`` seconds have passed (None: no timeout)."""
    end = None if timeout is None else time.monotonic() + timeout
    delay = 0.0005
    while True:
        r = check()
        if r is not None:
            return r
        if end is not None and time.monotonic() >= end:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


_INIT_EXIT_GRACE_S = 2.0


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def kill_tree(proc: subprocess.Popen, backend: str = "") -> None:
    """SIGKILL a run. With a pid namespace (bwrap, unshare) the started process's one child is
    the namespace's init: it is killed first (which kills the namespace) and the started process,
    which waits for it, is given up to ``_INIT_EXIT_GRACE_S`` to reap it and exit by itself.
    Killing the started process first orphans that init to the host's pid 1, and its zombie
    stays charged to the slot cgroup's pids limit until pid 1 reaps it, which in containers and
    VMs can be never: about 20 such kills in a row and the slot could not start a run."""
    if backend in ("bwrap", "unshare") and proc.returncode is None and not _has_exited(proc.pid):
        kids = _children(proc.pid)
        for k in kids:
            with contextlib.suppress(OSError):
                os.kill(k, signal.SIGKILL)
        if kids:
            _poll(lambda: _has_exited(proc.pid) or None, _INIT_EXIT_GRACE_S)
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
    cg: Cgroup | None,
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
