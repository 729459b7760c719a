"""Hostile programs against the sandbox: each must be contained and reported with a reason.

The fork bombs are bounded: they run only when a process-count containment really applies
here (a dropped uid under RLIMIT_NPROC or a cgroup pids limit); otherwise the test is skipped
with a message rather than running an unbounded fork bomb on a shared machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from pmd_jax.tasks import sandbox
from pmd_jax.tasks.sandbox import Limits, run_python
from pmd_jax.tasks.sandbox import sweep as sandbox_sweep
from pmd_jax.tasks.sandbox.cgroups import cgroup_bases

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


def test_fork_bomb():
    if not nproc_contained():
        pytest.skip(
            "no process-count containment here (root without uid drop and no pids "
            "cgroup): not running a fork bomb"
        )
    src = (
        "import os\nn=0\nwhile True:\n    try:\n        os.fork(); n+=1\n"
        "    except OSError:\n        break\nprint('forks', n)\nimport time; time.sleep(0.5)"
    )
    t0 = time.time()
    r = run(src)
    assert time.time() - t0 < LIM.wall_s + 5
    # contained: either the bomb hit the limit and exited, or the tree was killed
    assert r.status in ("ok", "exit_nonzero", "timeout", "signal", "cpu_limit"), r.reason


def test_fork_bomb_counted_limit():
    if not nproc_contained():
        pytest.skip("no process-count containment here: not running a fork bomb")
    src = (
        "import os,time\nn=0\nfor _ in range(200):\n    try:\n        pid=os.fork()\n"
        "    except OSError:\n        break\n    if pid==0:\n"
        "        time.sleep(3); os._exit(0)\n"
        "    n+=1\nprint(n)"
    )
    r = run(src)
    assert r.ok, r.reason
    assert int(r.stdout) < LIM.nproc + 8  # the process limit really bites


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


def test_kill_parent():
    src = (
        "import os,signal\nfor t in (os.getppid(), 1):\n    try:\n"
        "        os.kill(t, signal.SIGKILL)\n    except OSError as e:\n        print('no', t)\n"
        "print('alive')"
    )
    r = run(src)
    assert r.status in ("ok", "signal", "exit_nonzero")
    assert os.getpid() > 0  # we are still here


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
    import sys

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


# ----------------------------------------------------------------------------- host python

REPO = str(Path(__file__).resolve().parents[2])

# Run with a venv's interpreter: a sandboxed program imports numpy (the system site-packages)
# and a module that exists only in the venv's own site-packages, directly and through the
# code verifier's harness. Prints one JSON line.
_VENV_DRIVER = r"""
import json, site, sys
from pmd_jax.tasks import sandbox
from pmd_jax.tasks.code import run_tests

backend = sys.argv[1]
paths = site.getsitepackages()
prog = (
    f"import sys\nsys.path[:0] = {paths!r}\nimport numpy, pmd_venv_probe\n"
    "print(numpy.__version__, pmd_venv_probe.WHERE)"
)
r = sandbox.run_python(prog, backend=backend, limits=sandbox.Limits(wall_s=30))
tests = {"kind": "stdin", "inputs": ["3\n"], "outputs": ["9\n"], "time_limit": 5.0,
         "fn_name": "", "setup": ""}
recs, _ = run_tests(
    "import numpy as np, pmd_venv_probe\nprint(int(np.int64(int(input())) ** 2))",
    tests, [0], backend=backend,
)
print(json.dumps({
    "prefix": sys.prefix, "site": paths, "pmd_jax": sandbox.__file__, "status": r.status,
    "reason": r.reason, "stdout": r.stdout.decode(), "stderr": r.stderr.decode()[-2000:],
    "runner": recs[0],
}))
"""


@pytest.fixture(scope="module")
def tmp_venv():
    """A venv under the system temp directory (``--system-site-packages``, so numpy is
    there), holding a module of its own, importable only if the venv itself is visible."""
    root = tempfile.mkdtemp(prefix="pmd-test-venv-")
    os.chmod(root, 0o755)  # like a user's venv: readable by the sandbox's uid
    venv = os.path.join(root, "venv")
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv],
            check=True,
            timeout=120,
        )
        py = os.path.join(venv, "bin", "python")
        purelib = subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
        Path(purelib, "pmd_venv_probe.py").write_text("WHERE = __file__\n")
        yield py
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("backend", sandbox.BACKENDS)
def test_venv_under_tmp_is_visible_in_sandbox(tmp_venv, backend):
    """Issue 14.2: bwrap mounted a fresh /tmp over a venv living there (numpy, and every
    non-stdlib import, then failed in the sandbox and solutions were graded wrong)."""
    if backend not in INFO["available"]:
        pytest.skip(f"sandbox backend {backend} does not work on this machine")
    if sandbox.interpreter_for(backend) != sandbox.python_executable():
        pytest.skip(
            f"backend {backend} runs programs with the world-readable system python "
            f"({sandbox.interpreter_for(backend)}): the host interpreter is not readable by "
            "the sandbox uid, so no venv built on it can be used there"
        )
    import numpy

    proc = subprocess.run(
        [tmp_venv, "-c", _VENV_DRIVER, backend],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the setting really is a venv under the temp directory, running this checkout
    tmp = os.path.realpath(tempfile.gettempdir())
    assert os.path.realpath(out["prefix"]).startswith(tmp + os.sep), out["prefix"]
    assert out["pmd_jax"].startswith(REPO), out["pmd_jax"]
    assert any(p.startswith(out["prefix"]) for p in out["site"]), out["site"]
    assert out["status"] == "ok", (out["reason"], out["stderr"])
    version, where = out["stdout"].split()
    assert version == numpy.__version__
    assert where.startswith(out["prefix"] + os.sep)
    assert out["runner"]["passed"], out["runner"]


def test_bwrap_tmp_stays_private_and_writable_over_python_mounts(tmp_venv):
    """The binds of the Python installation leave /tmp a fresh writable tmpfs otherwise."""
    if "bwrap" not in INFO["available"]:
        pytest.skip("bwrap does not work on this machine")
    probe = tempfile.mkdtemp(prefix="pmd-test-hidden-")
    try:
        r = run(
            "import os, sys\nopen('/tmp/x', 'w').write('ok')\n"
            f"print(open('/tmp/x').read(), os.path.exists({probe!r}))\n"
            "try:\n    open(sys.prefix + '/pwned', 'w')\nexcept OSError:\n    print('ro')",
            backend="bwrap",
        )
    finally:
        os.rmdir(probe)
    assert r.ok, (r.reason, r.stderr)
    assert r.stdout.split() == [b"ok", b"False", b"ro"]


# ----------------------------------------------------------------------------- hygiene

# A verifier whose sandboxed job sleeps (as pid of a process named by argv[2]); a pooled
# sandbox waits for the next job meanwhile. The test SIGKILLs this process.
_VERIFIER = r"""
import sys
from pmd_jax.tasks import sandbox
backend, marker = sys.argv[1], sys.argv[2] + "-job"  # this process's argv lacks "-job"
pool = sandbox.WarmPool("import sys\nexec(sys.stdin.read())", None,
                        sandbox.Limits(cpu_s=5, wall_s=120), size=1, backend=backend)
job = ("import os, sys\nos.execv(sys.executable, [sys.executable, '-c', "
       f"'import time; time.sleep(60)', {marker!r}])")
pool.run(job.encode())
"""

_SWEEPER = (
    "from pmd_jax.tasks import sandbox\nr = sandbox.run_python('print(1)')\nassert r.ok, r.reason\n"
)


def _temp_dirs_of(pid: int) -> list[str]:
    return sorted(glob.glob(os.path.join(tempfile.gettempdir(), f"pmd-sbx-p{pid}-t*")))


def _cgroups_of(pid: int) -> list[str]:
    return sorted(
        p for b in cgroup_bases().values() for p in glob.glob(f"{b}/pmd-sbx-p{pid}-t*")
    )


def _wait_gone(marker: str, timeout: float = 3.0) -> list[int]:
    end = time.time() + timeout
    while procs_with(marker) and time.time() < end:
        time.sleep(0.05)
    return procs_with(marker)


@pytest.mark.parametrize(
    "backend,cgroups", [(b, True) for b in sandbox.BACKENDS] + [("rlimits", False)]
)
def test_sweep_after_verifier_killed(backend, cgroups):
    """Issue 14.3: a SIGKILLed verifier's temp dirs, cgroups and still-running sandboxed
    program are removed at the next process's first sandbox start; unmarked directories and
    a live process's ones are left alone."""
    if backend not in INFO["available"]:
        pytest.skip(f"sandbox backend {backend} does not work on this machine")
    if cgroups and not INFO["cgroup"]:
        pytest.skip("no writable cgroups here (the cgroup-less case runs separately)")
    env = {**os.environ, "PYTHONPATH": REPO, "PMD_SANDBOX_BACKEND": backend}
    if not cgroups:
        env["PMD_SANDBOX_NO_CGROUP"] = "1"
    tag = f"pmd-sleeper-{uuid.uuid4().hex}"
    marker = tag + "-job"  # in the sandboxed program's command line only
    child = subprocess.Popen(
        [sys.executable, "-c", _VERIFIER, backend, tag],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    decoys: list[str] = []
    cg_decoys: list[Path] = []
    try:
        end = time.time() + 30
        while not (procs_with(marker) and len(_temp_dirs_of(child.pid)) >= 2):
            assert child.poll() is None, child.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
            assert time.time() < end, "the verifier's sandboxed job never started"
            time.sleep(0.05)
        dirs, cgs = _temp_dirs_of(child.pid), _cgroups_of(child.pid)
        assert len(dirs) == 2  # the running job's and the pooled one's
        assert bool(cgs) == cgroups
        child.kill()
        child.wait()
        # the leftovers: everything, and (not bwrap: it dies with its parent) the program
        assert all(os.path.isdir(p) for p in dirs + cgs)
        assert all(os.path.exists(os.path.join(d, sandbox_sweep.MARKER)) for d in dirs)
        if backend != "bwrap":
            assert procs_with(marker), "the sandboxed program did not outlive its verifier"
        # not ours to remove: no marker (even with a dead owner's name), or a live owner
        decoys = [
            tempfile.mkdtemp(prefix="pmd-sbx-"),
            os.path.join(tempfile.gettempdir(), f"pmd-sbx-p{child.pid}-t1-nomarker"),
            sandbox_sweep.make_temp_dir(),
        ]
        os.mkdir(decoys[1])
        for b in cgroup_bases().values():
            for name in (f"pmd-sbx-{child.pid}-7", sandbox_sweep.cgroup_name(999_999)):
                (b / name).mkdir()
                cg_decoys.append(b / name)
        sweeper = subprocess.run(
            [sys.executable, "-c", _SWEEPER],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sweeper.returncode == 0, sweeper.stderr[-2000:]
        assert _wait_gone(marker) == [], "the dead verifier's sandboxed program still runs"
        assert [p for p in dirs + cgs if os.path.lexists(p)] == []
        assert all(os.path.isdir(d) for d in decoys)
        assert all(c.is_dir() for c in cg_decoys)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for p in procs_with(marker):
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        for d in decoys:
            sandbox_sweep.remove_tree(d)
        for c in cg_decoys:
            with contextlib.suppress(OSError):
                c.rmdir()


def test_sweep_spares_live_sandboxes():
    """Sweeps while other processes' sandboxes run leave them untouched and working."""
    tags = [f"pmd-live-{uuid.uuid4().hex}" for _ in range(2)]
    markers = [t + "-job" for t in tags]  # in the sandboxed programs' command lines only
    src = (
        "import sys\nfrom pmd_jax.tasks import sandbox\n"
        "r = sandbox.run_python('import time\\ntime.sleep(2)\\nprint(\"done\")', "
        "args=[sys.argv[1] + '-job'], limits=sandbox.Limits(wall_s=30))\n"
        "print(r.status, r.stdout)"
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    kids = [
        subprocess.Popen(
            [sys.executable, "-c", src, t], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
        )
        for t in tags
    ]
    try:
        end = time.time() + 30
        while not all(procs_with(m) for m in markers):
            assert time.time() < end and all(k.poll() is None for k in kids)
            time.sleep(0.05)
        mine = [p for k in kids for p in _temp_dirs_of(k.pid) + _cgroups_of(k.pid)]
        assert mine
        reports = [sandbox.sweep_stale() for _ in range(3)]
        swept = {p for r in reports for p in r.temp_dirs + r.cgroups}
        assert not swept & set(mine)
        assert all(os.path.isdir(p) for p in mine)
        assert all(procs_with(m) for m in markers)
        outs = [k.communicate(timeout=30)[0] for k in kids]
        assert all(o.strip() == "ok b'done\\n'" for o in outs), outs
    finally:
        for k in kids:
            if k.poll() is None:
                k.kill()
                k.wait()


def test_owner_liveness_and_markers(tmp_path):
    """A recycled pid (other start time), a zombie-free dead pid, an earlier boot: dead; a
    live owner, or one in another pid namespace: not touched; forged markers: no owner."""
    me = sandbox_sweep.current_owner()
    assert sandbox_sweep.owner_alive(me)
    assert not sandbox_sweep.owner_alive(dataclasses.replace(me, start=me.start + 1))
    assert not sandbox_sweep.owner_alive(dataclasses.replace(me, boot="not-this-boot"))
    assert sandbox_sweep.owner_alive(dataclasses.replace(me, start=1, pidns=me.pidns + 1))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert sandbox_sweep.proc_start_time(dead.pid) is None
    assert not sandbox_sweep.owner_alive(dataclasses.replace(me, pid=dead.pid))
    # a marker must match the directory's name, be a regular file, in a real directory
    d = sandbox_sweep.make_temp_dir(str(tmp_path))
    assert sandbox_sweep.read_temp_marker(d) == me
    assert sandbox_sweep.parse_cgroup_name(sandbox_sweep.cgroup_name(5)) == me
    other = tmp_path / f"pmd-sbx-p{dead.pid}-t{me.start}-x"
    other.mkdir()
    (other / sandbox_sweep.MARKER).write_text(Path(d, sandbox_sweep.MARKER).read_text())
    assert sandbox_sweep.read_temp_marker(str(other)) is None  # names another pid
    link = tmp_path / f"pmd-sbx-p{me.pid}-t{me.start}-link"
    link.symlink_to(d)
    assert sandbox_sweep.read_temp_marker(str(link)) is None
    assert sandbox_sweep.stale_temp_dirs(str(tmp_path)) == []
    assert sandbox_sweep.parse_cgroup_name(f"pmd-sbx-{me.pid}-5") is None
