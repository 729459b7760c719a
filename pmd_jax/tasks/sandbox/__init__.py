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

When no backend passes its probe, ``detect_backend()`` raises ``SandboxError`` naming each
backend's reason (a code task's run checks this at start-up:
``build.build_task(check_sandbox=True)``): there is no silent fallback under which every
program would fail.

Processes are confined to a pid namespace in the first two backends, so daemons (double
fork, setsid) die with the namespace when the run ends. There a shell is the namespace's init
and the program is its pid 2 (bwrap with ``--as-pid-1``, not bwrap's own init), and a kill
stops that init first, so the started process reaps it: a zombie left to the host's pid 1
would stay charged to the slot cgroup's pids limit until pid 1 reaped it, which in containers
and VMs is late or never. After every run, whatever is left in
the run's cgroup (or, without cgroups, every process of the run's uid) is killed. The temp
directories and cgroups name their owner, so those of a host process that was SIGKILLed are
swept at the next process's first sandbox start (``sweep``).

``run_python`` starts one sandbox per call. ``WarmPool`` starts sandboxes ahead of time, each
waiting for its job on stdin and used once; the code verifier uses it so that namespace and
interpreter start-up overlap with the previous job.

Not covered: this is not a defence against kernel exploits; the ``unshare`` and ``rlimits``
fallbacks leave the host filesystem readable (by permissions) and ``rlimits`` leaves the
network reachable (``backend_info()`` says so).

Layout (one job per module): ``base`` (backend names, ``Limits``, ``ExecResult``,
``SandboxError``, the tools' paths), ``backend`` (detection and ``backend_info``), ``uids``
(the uid pool), ``cgroups`` (per-slot cgroups), ``command`` (each backend's command line, the
rlimits, the interpreter), ``process`` (start, I/O, classification, cleanup of one run),
``run`` (``run_python`` and ``WarmPool``), ``sweep`` (leftovers of dead processes).
"""

from pmd_jax.tasks.sandbox.backend import available_backends, backend_info, detect_backend
from pmd_jax.tasks.sandbox.base import BACKENDS, ExecResult, Limits, SandboxError
from pmd_jax.tasks.sandbox.command import interpreter_for, python_executable
from pmd_jax.tasks.sandbox.process import sweep_stale
from pmd_jax.tasks.sandbox.run import WarmPool, run_python

__all__ = [
    "BACKENDS",
    "ExecResult",
    "Limits",
    "SandboxError",
    "WarmPool",
    "available_backends",
    "backend_info",
    "detect_backend",
    "interpreter_for",
    "python_executable",
    "run_python",
    "sweep_stale",
]
