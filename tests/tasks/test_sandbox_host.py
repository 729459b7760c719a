"""The sandbox and the host: a venv's interpreter and site-packages inside the sandbox, and
hygiene (a killed verifier's temp dirs, cgroups and programs swept; live ones spared).
Split from test_sandbox.py (hostile programs), whose helpers it uses."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from pmd_jax.tasks import sandbox
from pmd_jax.tasks.sandbox import sweep as sandbox_sweep
from pmd_jax.tasks.sandbox.cgroups import cgroup_bases
from tests.tasks.test_sandbox import INFO, procs_with, run

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
        _see_the_running_environment(py, purelib)
        yield py
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _see_the_running_environment(py: str, purelib: str) -> None:
    """Make the probe venv see what this test process imports.

    ``--system-site-packages`` exposes the *base* interpreter's site-packages. When pytest
    itself runs from a venv (the README's ``python3.11 -m venv /tmp/x`` route), numpy, absl
    and the rest live in that outer venv, which a venv made from it does not see (venvs do
    not chain). Then: a ``.pth`` file lists the outer venv's site-packages, so the driver's
    host-side imports (pmd_jax and its dependencies) resolve as in this process; and numpy,
    which the sandboxed programs import, is copied into the probe venv's own site-packages,
    because a ``.pth`` entry outside the venv is not something the sandbox mounts.
    """
    import importlib.metadata
    import site

    probe = [py, "-c", "import numpy, absl"]
    if subprocess.run(probe, capture_output=True, timeout=60).returncode == 0:
        return  # CI: the packages are in the base interpreter's site-packages
    if sys.prefix == sys.base_prefix:
        pytest.fail("numpy/absl are importable here but not from a --system-site-packages venv")
    Path(purelib, "pmd-outer-env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    dist = importlib.metadata.distribution("numpy")
    base = Path(str(dist.locate_file("")))
    for top in sorted({Path(str(f)).parts[0] for f in dist.files or ()} - {".."}):
        src = base / top
        if src.is_dir():
            shutil.copytree(src, Path(purelib, top), symlinks=True)
    subprocess.run(probe, check=True, capture_output=True, timeout=60)


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
    # a name no host path can hold: the README's own venv is /tmp/x, which the sandbox binds
    scratch = f"/tmp/pmd-sbx-scratch-{uuid.uuid4().hex}"
    try:
        r = run(
            f"import os, sys\nopen({scratch!r}, 'w').write('ok')\n"
            f"print(open({scratch!r}).read(), os.path.exists({probe!r}))\n"
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


def test_removing_a_tree_never_changes_its_parents_mode(tmp_path, monkeypatch):
    """The system temp dir is shared: removing a sandbox dir must leave its mode (1777) alone,
    also when several processes sweep the same stale dir at once (the loser's ``rmdir`` of the
    top finds it gone) or when the top cannot be removed. It once became 0700, after which no
    backend that drops to the sandbox uid could open its own program under /tmp."""
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o1777)

    def tree(name: str) -> str:
        top = parent / name
        for i in range(30):
            (top / f"d{i}").mkdir(parents=True)
            (top / f"d{i}" / "f").write_text("x")
        (top / "d0").chmod(0o555)  # a read-only directory inside: made writable to empty it
        return str(top)

    for trial in range(20):  # real races: three removers of one tree
        top = tree(f"race{trial}")
        threads = [threading.Thread(target=sandbox_sweep.remove_tree, args=(top,)) for _ in "abc"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not os.path.lexists(top)
        assert parent.stat().st_mode & 0o7777 == 0o1777, f"race {trial} changed the parent"

    top = tree("stuck")  # the top's own rmdir fails (not empty: a writer inside still runs)
    real_rmdir = os.rmdir

    def rmdir(p, *a, **k):  # noqa: ANN001, ANN202
        if os.path.abspath(p) == top:
            raise OSError(39, "Directory not empty", p)
        return real_rmdir(p, *a, **k)

    monkeypatch.setattr(os, "rmdir", rmdir)
    sandbox_sweep.remove_tree(top)
    monkeypatch.undo()
    assert parent.stat().st_mode & 0o7777 == 0o1777
    assert os.listdir(top) == []  # everything inside went; the top is left for the next sweep


def test_no_working_backend_fails_before_any_compute(tmp_path, monkeypatch):
    """A machine where no backend passes its probe (here: no bwrap, and a system temp dir
    that the sandbox's uid cannot enter) makes a code task's run fail at start-up with the
    reason for each backend, instead of grading every program as failed."""
    from pmd_jax.config import base_config, freeze
    from pmd_jax.loop.build import build_task
    from pmd_jax.tasks.sandbox import backend as sandbox_backend

    private = tmp_path / "private-tmp"
    private.mkdir()
    private.chmod(0o700)
    monkeypatch.setattr(sandbox_backend, "BWRAP", None)
    if os.geteuid() == 0:
        monkeypatch.setattr(tempfile, "tempdir", str(private))
    else:  # without root nothing drops to another uid: take away what every backend needs
        monkeypatch.setattr(sandbox_backend, "PRLIMIT", None)

    def cfg(name: str, eval_task: str = ""):  # noqa: ANN202
        c = base_config()
        c.task.name = name
        c.task.eval_task = eval_task
        return freeze(c)

    sandbox.detect_backend.cache_clear()
    sandbox.available_backends.cache_clear()
    try:
        with pytest.raises(sandbox.SandboxError) as err:
            sandbox.detect_backend()
        msg = str(err.value)
        assert "no sandbox backend works" in msg
        assert "bwrap: bwrap is not installed" in msg
        assert "unshare:" in msg and "rlimits:" in msg
        if os.geteuid() == 0:
            # the outermost closed directory on the way (pytest's own base dir is 0700 too)
            closed = msg.split("\n")[-1].split(" has no search permission")[0]
            assert str(private).startswith(closed) and "for other users (mode 700)" in msg
            assert "Permission denied" in msg  # the probe's own stderr, for each backend
        with pytest.raises(sandbox.SandboxError, match="no sandbox backend works"):
            build_task(cfg("mbpp", "humaneval"), check_sandbox=True)  # as the trainer calls it
        assert build_task(cfg("sciq"), check_sandbox=True).name == "sciq"  # runs no code
        assert build_task(cfg("mbpp", "humaneval")).name  # config validation's call checks no
        # sandbox: it runs before jax.distributed is initialised, so it may not touch jax
    finally:
        monkeypatch.undo()
        sandbox.detect_backend.cache_clear()
        sandbox.available_backends.cache_clear()
    assert sandbox.detect_backend() in sandbox.available_backends()
