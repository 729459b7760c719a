"""The sandbox side of grading: the harness script (``code_runner.py``) and how it starts.

``_harness`` gives the script and files a sandbox runs (the compiled harness when the sandbox
uses the host's own interpreter); ``make_pool`` pre-starts harness sandboxes that wait for
their job on stdin (``framed``: an 8-byte length, then the marshal payload).
"""

from __future__ import annotations

import functools
import marshal
import os
import site
from importlib import resources

from pmd_jax.tasks import sandbox

MAX_WALL_S = 120.0


@functools.cache
def _runner_source() -> str:
    return resources.files("pmd_jax.tasks").joinpath("code_runner.py").read_text("utf-8")


_RUNNER_LOADER = (
    "import marshal, os\n"
    "exec(marshal.loads(open(os.path.join(os.path.dirname(__file__), 'runner.bin'), 'rb')"
    ".read()))\n"
)


@functools.cache
def _runner_code() -> bytes:
    return marshal.dumps(compile(_runner_source(), "code_runner.py", "exec"))


def site_paths() -> list[str]:
    return [p for p in site.getsitepackages() if os.path.isdir(p)]


def harness(backend: str) -> tuple[str, dict[str, str | bytes]]:
    """(main script, extra files) of the test harness for a backend."""
    if sandbox.interpreter_for(backend) == sandbox.python_executable():
        # same interpreter inside: ship the compiled harness, skip compiling it per program
        return _RUNNER_LOADER, {"runner.bin": _runner_code()}
    return _runner_source(), {}


def make_pool(size: int, backend: str | None = None) -> sandbox.WarmPool:
    """Pre-started harness sandboxes (the payload goes in on stdin, length first)."""
    b = backend or sandbox.detect_backend()
    script, files = harness(b)
    return sandbox.WarmPool(
        script, files, sandbox.Limits(cpu_s=MAX_WALL_S, wall_s=MAX_WALL_S), size=size, backend=b
    )


def framed(payload: dict) -> bytes:
    data = marshal.dumps(payload)
    return len(data).to_bytes(8, "big") + data
