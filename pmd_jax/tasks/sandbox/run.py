"""The two ways to run a program: ``run_python`` (one sandbox per call) and ``WarmPool``
(sandboxes started ahead of time, each used once)."""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

from pmd_jax.tasks.sandbox.backend import detect_backend
from pmd_jax.tasks.sandbox.base import ExecResult, Limits
from pmd_jax.tasks.sandbox.process import Started, cleanup, finish, run_once, start


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
    return run_once(script, files, stdin, args, limits, backend or detect_backend(), python_flags)


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
        self._ready: list[Started] = []
        self._lock = threading.Lock()
        self._closed = False
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pmd-sandbox-pool")
        # stop the waiting sandboxes when the pool is collected or at interpreter exit
        self._finalizer = weakref.finalize(
            self, _discard_all, self._ready, self._lock, self._starter
        )

    def _new(self) -> Started:
        return start(self.script, self.files, None, self.limits, self.backend, self.python_flags)

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
        return finish(st, stdin, limits, done_marker)

    def acquire(self) -> Started:
        """A started sandbox, still waiting for its stdin, for a caller that talks to it
        itself (and must ``cleanup`` it). The pool is refilled."""
        st = None
        with self._lock:
            while self._ready and st is None:
                cand = self._ready.pop(0)
                if cand.proc.poll() is None:
                    st = cand
                else:  # died while waiting (should not happen): discard
                    cleanup(cand)
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
    ready: list[Started], lock: threading.Lock, starter: ThreadPoolExecutor | None = None
) -> None:
    with lock:
        items = list(ready)
        ready.clear()
    for st in items:
        cleanup(st)
    if starter is not None:
        starter.shutdown(wait=False)
