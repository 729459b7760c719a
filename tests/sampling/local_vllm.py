"""Start and stop a vLLM server on this machine, through ``launch/vllm_server.sh``.

Test and benchmark support (not part of the package): for tests and benchmarks that want the
external sampler without a separate terminal. The server binds to loopback on a free port,
logs to a file, and runs in its own process group so stopping it also stops the engine's
worker processes.

    with LocalVllmServer(hf_dir, extra_args=["--max-model-len", "512"]) as srv:
        sampler = VLLMSampler(srv.url, str(hf_dir), store_url=...)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from pmd_jax.sampling.base import SamplerServerError

REPO = Path(__file__).resolve().parents[2]
LAUNCH_SCRIPT = REPO / "launch" / "vllm_server.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_venv() -> Path:
    return Path(os.environ.get("PMD_VLLM_VENV", REPO / ".venv-vllm"))


def venv_available(venv: Path | None = None) -> bool:
    v = default_venv() if venv is None else Path(venv)
    return str(v) == "system" or (v / "bin" / "python").exists()


class LocalVllmServer:
    """One ``vllm serve`` process with our worker extension, on 127.0.0.1:<free port>."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        *,
        extra_args: Sequence[str] = (),
        dtype: str = "float32",
        venv: str | os.PathLike | None = None,
        port: int | None = None,
        log_path: str | os.PathLike | None = None,
        start_timeout_s: float = 900.0,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.extra_args = list(extra_args)
        self.dtype = dtype
        self.venv = Path(venv) if venv is not None else default_venv()
        self.port = int(port) if port is not None else free_port()
        self.log_path = Path(log_path) if log_path is not None else (
            Path(tempfile.mkdtemp(prefix="pmd-vllm-")) / "server.log")
        self.start_timeout_s = float(start_timeout_s)
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self) -> LocalVllmServer:
        """Start the server and wait until it is healthy; SamplerServerError (with the tail
        of its log) if it exits or is not healthy within ``start_timeout_s``."""
        if not venv_available(self.venv):
            raise SamplerServerError(
                f"no vLLM venv at {self.venv}: run launch/setup_vllm_venv.sh, or set "
                "PMD_VLLM_VENV (PMD_VLLM_VENV=system uses the vllm on PATH)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PMD_VLLM_PORT=str(self.port), PMD_VLLM_DTYPE=self.dtype,
                   PMD_VLLM_VENV=str(self.venv), PMD_VLLM_HOST="127.0.0.1")
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                ["bash", str(LAUNCH_SCRIPT), str(self.model_dir), *self.extra_args],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = t0 + self.start_timeout_s
        while not self.healthy():
            rc = self.proc.poll()
            if rc is not None or time.monotonic() > deadline:
                self.stop()
                why = f"exited with code {rc}" if rc is not None else (
                    f"not healthy after {self.start_timeout_s:.0f} s")
                raise SamplerServerError(
                    f"vLLM server for {self.model_dir} {why}; log {self.log_path}:\n"
                    f"{self.log_tail()}")
            time.sleep(2)
        self.start_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass

    def __enter__(self) -> LocalVllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
