"""Hostile programs against the sandbox: each must be contained and reported with a reason.

The fork bombs are bounded: they run only when a process-count containment really applies
here (a dropped uid under RLIMIT_NPROC or a cgroup pids limit); otherwise the test is skipped
with a message rather than running an unbounded fork bomb on a shared machine. Where they run
they must be stopped by that containment (fork fails with EAGAIN) within ``process_bound()``
processes, counted by the bomb's own processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from pmd_jax.tasks import sandbox
from pmd_jax.tasks.sandbox import Limits, run_python

LIM = Limits(
    cpu_s=2,
    wall_s=6,
    memory_bytes=512 << 20,
    tree_memory_bytes=1 << 30,
    nproc=16,
    nofile=64,
    fsize_bytes=4 << 20,
    output_bytes=1 << 20,
    tmpfs_bytes=32 << 20,
)
INFO = sandbox.backend_info()
BACKEND = INFO["backend"]


def nproc_contained() -> bool:
    return bool(INFO["uid_drop"] or "pids" in INFO["cgroup"] or "unified" in INFO["cgroup"])


def process_bound() -> int:
    """The most processes a program may have at once: RLIMIT_NPROC = ``nproc`` for the
    dedicated uid where the uid is dropped (it also counts the namespace's init shell), else
    the slot cgroup's ``pids.max`` = ``nproc + 8`` (which also counts bwrap)."""
    return LIM.nproc if INFO["uid_drop"] else LIM.nproc + 8


def run(src: str, backend: str = BACKEND, **kw) -> sandbox.ExecResult:
    return run_python(src, backend=backend, limits=kw.pop("limits", LIM), **kw)


def procs_with(marker: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        out.append(int(d))
            except OSError:
                pass
    return out


def test_backend_reported():
    assert BACKEND in sandbox.BACKENDS
    assert BACKEND in INFO["available"] or BACKEND == "rlimits"
    r = run("print('hello')")
    assert r.ok and r.stdout == b"hello\n" and r.backend == BACKEND


def test_uid_and_privileges_dropped():
    if os.geteuid() != 0:
        pytest.skip("host is not root: no uid drop to check")
    r = run(
        "import os\nprint(os.getuid(), os.geteuid())\n"
        "try:\n os.setuid(0); print('ROOT')\nexcept PermissionError: print('denied')"
    )
    assert r.ok, r.reason
    uid, euid, res = r.stdout.decode().split()
    assert int(uid) != 0 and int(euid) != 0 and res == "denied"


# ----------------------------------------------------------------------------- hostile kinds


# Every process forks until fork fails; then it prints how many children it made and holds
# its slot (a child sleeps until the run is torn down, so no slot frees up for a later fork),
# and the first process, after 2 s for the others to report, lets the error end the program.
FORK_BOMB = """\
import os, time
first, forks = os.getpid(), 0
try:
    while True:
        if os.fork():
            forks += 1
        else:
            forks = 0
finally:
    print("forks", forks, flush=True)
    time.sleep(2 if os.getpid() == first else 60)
"""


def test_fork_bomb() -> None:
    """A fork bomb is stopped by the process-count containment itself: fork fails with EAGAIN
    (the program ends on the uncaught BlockingIOError, well before the wall-clock limit), and
    the processes it made, each reporting its own forks, are at most ``process_bound()``."""
    if not nproc_contained():
        pytest.skip(
            "no process-count containment here (root without uid drop and no pids "
            "cgroup): not running a fork bomb"
        )
    t0 = time.time()
    r = run(FORK_BOMB)
    assert time.time() - t0 < LIM.wall_s + 5
    assert r.status == "exit_nonzero" and "BlockingIOError" in r.reason, (r.status, r.reason)
    forks = [int(ln.split()[1]) for ln in r.stdout.decode().splitlines()]
    # one line per process: the first one plus every child the others report
    assert len(forks) == sum(forks) + 1 >= 2, forks
    assert len(forks) <= process_bound(), (len(forks), process_bound(), forks)


def test_fork_bomb_counted_limit() -> None:
    """Children that hold their slot (sleep 3 s) while the parent forks up to 200: the loop is
    ended by fork failing with EAGAIN (not by the 200), after at most ``process_bound()`` - 1
    children. The program catches the error and exits normally, so the run is "ok"."""
    if not nproc_contained():
        pytest.skip("no process-count containment here: not running a fork bomb")
    src = (
        "import errno,os,time\nn=0\nerr=None\nfor _ in range(200):\n    try:\n"
        "        pid=os.fork()\n    except OSError as e:\n"
        "        err=errno.errorcode[e.errno]\n        break\n    if pid==0:\n"
        "        time.sleep(3); os._exit(0)\n"
        "    n+=1\nprint(n, err)"
    )
    r = run(src)
    assert r.ok, r.reason
    n, err = r.stdout.decode().split()
    assert err == "EAGAIN", r.stdout  # the process limit really bites
    assert 1 <= int(n) <= process_bound() - 1, (n, process_bound())


def test_thread_bomb():
    if not nproc_contained():
        pytest.skip("no process-count containment here")
    src = (
        "import threading,time\nn=0\ntry:\n    for _ in range(500):\n"
        "        threading.Thread(target=time.sleep, args=(2,), daemon=True).start(); n+=1\n"
        "except RuntimeError:\n    pass\nprint(n)"
    )
    r = run(src)
    assert r.ok, r.reason
    assert int(r.stdout) < LIM.nproc + 8


def test_infinite_loop():
    r = run("while True:\n    pass")
    assert r.status in ("cpu_limit", "timeout"), r.reason
    assert "limit" in r.reason


def test_sleep_past_wall_limit():
    t0 = time.time()
    r = run("import time\ntime.sleep(60)")
    assert r.status == "timeout" and "wall-clock" in r.reason
    assert time.time() - t0 < LIM.wall_s + 3


def test_allocate_10gb():
    r = run("x = bytearray(10 * 1024**3)\nprint(len(x))")
    assert r.status == "memory_limit", (r.status, r.reason)
    assert "memory" in r.reason


def test_allocate_incrementally():
    r = run("xs=[]\nwhile True:\n    xs.append(bytearray(50 * 1024**2))")
    assert r.status == "memory_limit", (r.status, r.reason)


def test_memory_across_processes():
    if not (INFO["cgroup"]):
        pytest.skip(
            "no memory cgroup here: RLIMIT_AS alone does not bound a process tree, "
            "not allocating across processes on a shared machine"
        )
    src = (
        "import os,time\nfor _ in range(6):\n    if os.fork()==0:\n"
        "        try:\n            x=bytearray(400*1024**2)\n            time.sleep(3)\n"
        "        finally:\n            os._exit(0)\n"
        "time.sleep(4)\nprint('survived')"
    )
    r = run(
        src,
        limits=Limits(
            cpu_s=4, wall_s=8, memory_bytes=512 << 20, tree_memory_bytes=1 << 30, nproc=16
        ),
    )
    # 6 x 400 MiB > 1 GiB tree limit: the OOM killer must have intervened
    assert r.status == "memory_limit", (r.status, r.reason)


def test_network_connect_localhost():
    if not INFO["network_isolated"]:
        pytest.skip(f"backend {BACKEND} has no network isolation")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    got = []

    def accept():
        t_end = time.time() + 4
        while time.time() < t_end:
            try:
                c, _ = srv.accept()
                got.append(c)
                return
            except OSError:
                continue

    th = threading.Thread(target=accept)
    th.start()
    src = (
        f"import socket\ns=socket.socket()\ns.settimeout(2)\n"
        f"s.connect(('127.0.0.1', {port}))\nprint('CONNECTED')"
    )
    r = run(src)
    th.join()
    srv.close()
    assert not got, "the sandboxed program reached a host socket"
    assert r.status == "exit_nonzero" and b"CONNECTED" not in r.stdout
    assert "Error" in r.reason


def test_network_external():
    if not INFO["network_isolated"]:
        pytest.skip(f"backend {BACKEND} has no network isolation")
    r = run("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\nprint('OUT')")
    assert r.status == "exit_nonzero" and b"OUT" not in r.stdout


def test_write_outside_temp_dir(tmp_path):
    target = tmp_path / "pwned.txt"
    r = run(f"open({str(target)!r}, 'w').write('x')\nprint('WROTE')")
    assert not target.exists()
    assert r.status == "exit_nonzero" and b"WROTE" not in r.stdout
    assert "Error" in r.reason


def test_cwd_is_empty_and_writable():
    r = run("import os\nprint(os.listdir('.'))\nopen('f','w').write('ok')\nprint(open('f').read())")
    assert r.ok, r.reason
    assert r.stdout.decode().split() == ["[]", "ok"]


def test_read_host_file(tmp_path):
    if not INFO["filesystem_isolated"]:
        pytest.skip(f"backend {BACKEND} shares the host filesystem (read-only by permissions)")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    secret.chmod(0o644)
    r = run(f"print(open({str(secret)!r}).read())")
    assert b"TOPSECRET" not in r.stdout and r.status == "exit_nonzero"


def test_read_parent_environment(monkeypatch):
    monkeypatch.setenv("PMD_TEST_SECRET", "s3cr3t-value")
    src = (
        "import os\nprint(dict(os.environ))\n"
        "for p in ('/proc/%d/environ' % os.getppid(), '/proc/1/environ'):\n"
        "    try:\n        print(open(p,'rb').read())\n    except OSError as e:\n"
        "        print('denied', p)"
    )
    r = run(src)
    assert b"s3cr3t-value" not in r.stdout
    assert r.ok, r.reason


# Runs one program through run_python in a separate host process (the sandbox's caller),
# so that this test process outlives a sandbox that fails to protect its caller. Its
# arguments: the limits (JSON), the backend, the program, the program's arguments; the
# caller's own pid is appended to them.
_CALLER = """\
import json, os, sys
from pmd_jax.tasks.sandbox import Limits, run_python
r = run_python(sys.argv[3], backend=sys.argv[2], limits=Limits(**json.loads(sys.argv[1])),
               args=[*sys.argv[4:], str(os.getpid())])
print(json.dumps({"status": r.status, "reason": r.reason, "stdout": r.stdout.decode()}))
"""


def test_kill_parent() -> None:
    """The program SIGKILLs its parent, pid 1, a host process (a sleeping child of this test
    process) and the host process that called ``run_python`` (a separate process here, so
    this test outlives it). Contained (a pid namespace and/or the dedicated uid), both host
    processes are out of its reach (no such pid in the namespace, or EPERM for the uid): the
    sleeper is still alive and the caller returns the result. The program must have tried all
    four and lived on to print 'alive' (in a namespace its parent is the init, which ignores
    signals from inside), or the first check would prove nothing."""
    if not (INFO["pid_namespace"] or os.geteuid() != 0 or INFO["uid_drop"]):
        pytest.skip("program would run as root on the host's pids: killing them is not safe")
    src = (
        "import os, signal, sys\n"
        "for name, pid in (('sleeper', int(sys.argv[1])), ('caller', int(sys.argv[2])),\n"
        "                  ('parent', os.getppid()), ('init', 1)):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n        print(name, 'sent')\n"
        "    except OSError as e:\n        print(name, type(e).__name__)\n"
        "print('alive')"
    )
    sleeper = os.fork()
    if sleeper == 0:
        time.sleep(30)
        os._exit(0)
    try:
        root = str(Path(sandbox.__file__).resolve().parents[3])  # the pmd_jax imported here
        caller = subprocess.run(
            [sys.executable, "-c", _CALLER, json.dumps(dataclasses.asdict(LIM)), BACKEND, src,
             str(sleeper)],
            capture_output=True, timeout=60, cwd=root, env={**os.environ, "PYTHONPATH": root},
        )
        sleeper_alive = os.waitpid(sleeper, os.WNOHANG) == (0, 0)
        assert sleeper_alive and caller.returncode == 0, (
            f"the program killed host processes: sleeper alive {sleeper_alive}, caller exit "
            f"status {caller.returncode} {caller.stderr[-300:]!r}")
        r = json.loads(caller.stdout)
        # it did try all four kills and lived on (so the check above is not vacuous)
        tried = sorted(ln.split()[0] for ln in r["stdout"].splitlines()[:-1])
        assert (r["status"], tried, r["stdout"].splitlines()[-1]) == (
            "ok", ["caller", "init", "parent", "sleeper"], "alive"), r
    finally:
        with contextlib.suppress(OSError):
            os.kill(sleeper, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(sleeper, 0)


def test_kill_everything():
    if not (os.geteuid() != 0 or INFO["uid_drop"]):
        pytest.skip("program would run as root without a uid drop: kill(-1) is not safe here")
    host_child = os.fork()
    if host_child == 0:
        time.sleep(20)
        os._exit(0)
    try:
        r = run(
            "import os,signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n"
            "    pass\nprint('done')"
        )
        assert r.status in ("ok", "signal", "exit_nonzero")
        pid, _ = os.waitpid(host_child, os.WNOHANG)
        assert pid == 0, "a host process was killed by the sandboxed program"
    finally:
        os.kill(host_child, signal.SIGKILL)
        os.waitpid(host_child, 0)


def test_killpg_host_group():
    r = run(
        "import os,signal\ntry:\n    os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)\n"
        "except OSError as e:\n    print('denied')\nprint('x')"
    )
    assert r.status in ("ok", "signal", "exit_nonzero")


def test_huge_stdout():
    t0 = time.time()
    r = run("import sys\nwhile True:\n    sys.stdout.write('y'*65536)")
    assert r.status == "output_limit" and "output limit" in r.reason
    assert len(r.stdout) <= LIM.output_bytes
    assert time.time() - t0 < LIM.wall_s + 3


def test_huge_stderr():
    r = run("import sys\nwhile True:\n    sys.stderr.write('z'*65536)")
    assert r.status == "output_limit" and "stderr" in r.reason


def test_huge_file():
    r = run("f=open('big','wb')\nwhile True:\n    f.write(b'0'*(1<<20))")
    assert r.status in ("file_size_limit", "exit_nonzero"), (r.status, r.reason)
    assert "limit" in r.reason or "No space" in r.reason or "File too large" in r.reason


def test_many_open_files():
    r = run("fs=[]\nwhile True:\n    fs.append(open('/dev/null'))")
    assert r.status == "exit_nonzero" and "Too many open files" in r.reason


def test_raise_own_limits():
    r = run(
        "import resource\nresource.setrlimit(resource.RLIMIT_NPROC, (10**6, 10**6))\n"
        "print('RAISED')"
    )
    assert b"RAISED" not in r.stdout and r.status == "exit_nonzero"


def test_daemon_double_fork_is_killed():
    marker = f"pmd-daemon-{uuid.uuid4().hex}"
    src = (
        "import os,sys,time\nif os.fork()==0:\n    os.setsid()\n    if os.fork()==0:\n"
        "        time.sleep(60)\n        os._exit(0)\n    os._exit(0)\nprint('parent done')"
    )
    r = run(src, args=[marker])
    assert r.ok, r.reason
    time.sleep(0.3)
    assert procs_with(marker) == [], "a daemon outlived its sandbox run"


def test_daemon_survives_timeout_kill():
    marker = f"pmd-daemon-{uuid.uuid4().hex}"
    src = (
        "import os,time\nif os.fork()==0:\n    os.setsid()\n    time.sleep(60)\n"
        "    os._exit(0)\ntime.sleep(60)"
    )
    r = run(src, args=[marker], limits=Limits(cpu_s=2, wall_s=2))
    assert r.status == "timeout"
    time.sleep(0.3)
    assert procs_with(marker) == []


def test_segfault():
    r = run("import ctypes\nctypes.string_at(0)")
    assert r.status == "signal" and "SIGSEGV" in r.reason


def test_deep_recursion():
    r = run("import sys\nsys.setrecursionlimit(10**8)\ndef f(n): return f(n+1)\nf(0)")
    # a segfault, or the limits, depending on how fast the stack grows under load
    assert r.status in ("signal", "memory_limit", "exit_nonzero", "cpu_limit", "timeout"), r.reason


def test_non_utf8_output():
    r = run("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\x80 ok')")
    assert r.ok and r.stdout == b"\xff\xfe\x80 ok"


def test_stdin_passed():
    r = run("import sys\nprint(sys.stdin.read().upper())", stdin=b"abc" * 50000)
    assert r.ok and r.stdout.strip() == b"ABC" * 50000


def test_syntax_error():
    r = run("def f(:\n")
    assert r.status == "exit_nonzero" and "SyntaxError" in r.reason


# ----------------------------------------------------------------------------- fallbacks

_OTHER = [b for b in INFO["available"] if b != BACKEND]


@pytest.mark.parametrize("backend", _OTHER or ["none"])
def test_fallback_backends_contain_basics(backend):
    if backend == "none":
        pytest.skip("only one sandbox backend works here")
    assert run("print(1)", backend=backend).ok
    assert run("while True: pass", backend=backend).status in (
        "cpu_limit",
        "timeout",
        "exit_nonzero",
    )
    assert run("x=bytearray(10*1024**3)", backend=backend).status == "memory_limit"
    r = run("import os\nprint(dict(os.environ))", backend=backend)
    assert b"PMD_" not in r.stdout
    marker = f"pmd-daemon-{uuid.uuid4().hex}"
    run(
        "import os,time\nif os.fork()==0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)",
        backend=backend,
        args=[marker],
    )
    time.sleep(0.3)
    assert procs_with(marker) == []


def test_interpreter_is_the_hosts():

    r = run("import sys\nprint(sys.version)")
    assert r.ok, r.reason
    if BACKEND == "bwrap" or os.geteuid() != 0:
        # same build: stdlib and libpython of the host installation, not a system fallback
        assert r.stdout.decode().strip() == sys.version
    else:
        assert r.stdout.decode().startswith(f"{sys.version_info[0]}.")


def test_numpy_importable_in_code_runner():
    from pmd_jax.tasks.code import run_tests

    tests = {
        "kind": "stdin",
        "inputs": ["3\n"],
        "outputs": ["9\n"],
        "time_limit": 5.0,
        "fn_name": "",
        "setup": "",
    }
    recs, res = run_tests("import numpy as np\nprint(int(np.int64(int(input())) ** 2))", tests, [0])
    if BACKEND != "bwrap" and sandbox.interpreter_for(BACKEND) != sandbox.python_executable():
        pytest.skip("fallback interpreter without the host's site-packages")
    assert recs[0]["passed"], recs


def test_warm_pool_sandboxes_are_single_use():
    pool = sandbox.WarmPool("import sys\nexec(sys.stdin.read())", None, LIM, size=2)
    try:
        marker = f"pmd-daemon-{uuid.uuid4().hex}"
        job1 = (
            "import os, sys, time\nopen('left.txt', 'w').write('x')\n"
            "open(os.environ.get('TMPDIR', '/tmp') + '/left2.txt', 'w').write('x')\n"
            f"if os.fork() == 0:\n    os.setsid()\n    sys.argv.append({marker!r})\n"
            f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)',"
            f" {marker!r}])\nprint('job1')"
        )
        r1 = pool.run(job1.encode())
        assert r1.ok and r1.stdout == b"job1\n", r1.reason
        time.sleep(0.3)
        assert procs_with(marker) == [], "a daemon of a pooled job outlived it"
        r2 = pool.run(
            b"import os\nprint(os.path.exists('left.txt'), "
            b"os.path.exists(os.environ.get('TMPDIR', '/tmp') + '/left2.txt'))"
        )
        assert r2.ok and r2.stdout == b"False False\n"
        r3 = pool.run(b"import time\ntime.sleep(30)", dataclasses.replace(LIM, wall_s=1.0))
        assert r3.status == "timeout"
    finally:
        pool.close()



def _charged_slots() -> dict[int, str]:
    """Slot cgroups of this process whose pids counter is not zero."""
    from pmd_jax.tasks.sandbox.cgroups import Cgroup

    out = {}
    for uid, cg in Cgroup._by_uid.items():
        if "pids" in cg.dirs:
            n = (cg.dirs["pids"] / "pids.current").read_text().strip()
            if n != "0":
                out[uid] = n
    return out


def test_a_waiting_sandbox_is_charged_and_its_cleanup_uncharges_it():
    """The slot's pids counter (what ``cleanup`` waits on before the uid goes back) counts a
    started sandbox's processes and is zero once it is cleaned up."""
    if not nproc_contained() or BACKEND == "rlimits":
        pytest.skip("no pid namespace or no cgroup pids counter here")
    pool = sandbox.WarmPool("import sys\nexec(sys.stdin.read())", None, LIM, size=1)
    try:
        st = pool.acquire()
        assert st.cg is not None
        cg = st.cg
        # (the started shell joins the slot's cgroup itself, then execs the backend)
        up = sandbox.process._poll(lambda: cg.charged() >= 2 or None, 10.0)
        assert up, cg.charged()  # bwrap or unshare, the init shell, python
        sandbox.process.cleanup(st)
        assert st.cg.charged() == 0
    finally:
        pool.close()


def test_runs_in_a_row_leave_nothing_charged():
    """Every run must be reaped by the time it returns, however it ended. bwrap's own namespace
    init used to be left a zombie of the host's pid 1 at every run (and, after that fix, at
    every killed run: timeout, output limit, warm-pool job done), charged to the slot cgroup's
    pids.max until pid 1 reaped it; where pid 1 reaps late, the 21st run in a row failed with
    "bwrap: Can't fork for pid 1" (seen in CI). More runs than the pids limit, then kills."""
    if not nproc_contained() or BACKEND == "rlimits":
        pytest.skip("no pid namespace or no cgroup pids counter here")
    base = _charged_slots()
    for i in range(LIM.nproc + 8 + 6):
        r = run(f"print({i})")
        assert (r.status, r.stdout) == ("ok", f"{i}\n".encode()), (i, r.status, r.stderr)
        assert _charged_slots() == base, i
    quick = dataclasses.replace(LIM, wall_s=0.5)
    for i in range(3):
        r = run("while True:\n    pass", limits=quick)
        assert r.status == "timeout", (r.status, r.stderr)
        r = run("import sys\nwhile True:\n    sys.stdout.write('y'*65536)")
        assert r.status == "output_limit", (r.status, r.stderr)
        assert _charged_slots() == base, i
    pool = sandbox.WarmPool("import sys\nexec(sys.stdin.read())", None, LIM, size=2)
    try:
        for i in range(LIM.nproc + 8 + 6):
            marker = f"done-{uuid.uuid4().hex}"
            job = f"print({i})\nprint({marker!r}, flush=True)\nimport time\ntime.sleep(30)"
            r = pool.run(job.encode(), done_marker=marker.encode())
            assert r.status == "ok" and r.stdout.startswith(f"{i}\n".encode()), (i, r)
    finally:
        pool.close()
    assert _charged_slots() == base
