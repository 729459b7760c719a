"""Command-line entry point.

    python -m pmd_jax.main --config=configs/smollm2_sciq.py [--config.rollout.n=4 ...]
    python -m pmd_jax.main --config=configs/olmo3.py --dry_run
    python -m pmd_jax.main --config=configs/olmo3.py --dry_run --config.dry_run.target=v5p-64

The config is validated (unknown keys, impossible combinations, missing files) before any
model is loaded or any array is allocated: every problem is printed, one line each, and the
exit status is 2. A valid config this machine cannot run is one ``cannot start:`` line and
exit 2 as well: no vLLM server answering at rollout.vllm_url (asked before the model loads),
no room for two checkpoints on run_dir's disk (found once the train state exists, before the
first step). ``--config.a.b=none`` sets a nullable field (e.g. distill.loss.topk) to None.
The trainer gets the frozen, typed ``RunConfig`` (``pmd_jax.config.freeze``). Every knob
with its default and help text: ``python -m pmd_jax.config [prefix, e.g. distill.loss]``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from absl import flags
from ml_collections import config_flags

from pmd_jax.config.cache import setup_compilation_cache
from pmd_jax.config.cli import CONFIG_ERROR_EXIT, apply_taken, run_command
from pmd_jax.config.cli import report_errors as _report
from pmd_jax.config.cli import setup_logging as _setup_logging
from pmd_jax.config.modes import apply_mode
from pmd_jax.config.validate import (
    batch_plan_errors,
    config_errors,
    freeze,
    schema_errors,
    try_freeze,
)
from pmd_jax.distill.accumulate import MicrobatchError
from pmd_jax.dry_run.entry import dry_run_from_config
from pmd_jax.dry_run.hardware import get_target
from pmd_jax.loop.trainer import Trainer
from pmd_jax.models.config import ConfigError
from pmd_jax.models.hf_io import CheckpointError as ModelFolderError
from pmd_jax.models.tokenizer import TokenizerError
from pmd_jax.run import footprint
from pmd_jax.run.disk import DiskSpaceError
from pmd_jax.run.distributed import maybe_initialize
from pmd_jax.run.host_state import HostStateError, LegacyCheckpointError
from pmd_jax.run.sharding import ShardingError
from pmd_jax.sampling.backends import start_refusal

if TYPE_CHECKING:
    from pmd_jax.config.cli import CommandLine

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file in configs/ (ml_collections).", lock_config=True
)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Lower and compile the full-size step on abstract arrays; no weights "
    "(= --config.dry_run.enabled; with --config.dry_run.target=v5p-64|v5e-256|8xH100|8xH200: "
    "memory vs that hardware's HBM, FITS / DOES NOT FIT (exit 1), roofline step time).",
)
_DRY_RUN_DEVICES = flags.DEFINE_integer(
    "dry_run_devices", 64, "Number of simulated CPU devices for --dry_run."
)


_COMMAND_LINE: list[CommandLine] = []


def _refuse(msg: str) -> int:
    """A valid config this machine cannot run (no sampler server, no disk): one line, exit 2."""
    print(f"cannot start: {msg}", file=sys.stderr, flush=True)
    return CONFIG_ERROR_EXIT


def main(argv: list[str]) -> int:
    del argv
    _setup_logging()

    cfg = _CONFIG.value
    if cfg is None:
        return _report(["--config=configs/<name>.py is required"])
    # Problems check_command_line found (unknown keys, unparsable values) are reported
    # together with the config's own; its ``none`` values are set here.
    line = _COMMAND_LINE[-1] if _COMMAND_LINE else None
    pre_errs = list(line.errors) if line is not None else []
    if line is not None:
        apply_taken(cfg, line)
    if _DRY_RUN.value or cfg.dry_run.enabled or cfg.dry_run.target:  # a target implies it

        cfg = apply_mode(cfg)  # the loss, group size etc. a mode implies, as for a run
        dry_cfg, not_frozen = try_freeze(cfg)
        errs = pre_errs + schema_errors(cfg) + not_frozen + (
            batch_plan_errors(dry_cfg) if dry_cfg is not None else [])
        if errs or dry_cfg is None:
            return _report(errs)
        # Simulated devices must be configured before jax starts a backend (it reads XLA_FLAGS
        # then; importing it reads nothing, and no module starts one on import): a hardware
        # target's chip count, else --dry_run_devices (unless XLA_FLAGS already sets a count).
        target = cfg.dry_run.target
        flags_env = os.environ.get("XLA_FLAGS", "")
        if target or "xla_force_host_platform_device_count" not in flags_env:
            n = get_target(target).chips if target else _DRY_RUN_DEVICES.value
            kept = [f for f in flags_env.split() if "xla_force_host_platform_device_count" not in f]
            os.environ["XLA_FLAGS"] = " ".join(
                [*kept, f"--xla_force_host_platform_device_count={n}"])

        try:
            report = dry_run_from_config(dry_cfg)
        except (ConfigError, MicrobatchError, ShardingError) as e:
            # the model's shapes cannot be read, or the config does not fit the (simulated)
            # mesh: one line, exit 2
            return _refuse(str(e))
        # exit 1 when the train step or the decode step does not fit the target's HBM
        return 0 if report.get("fits", True) else 1
    # What the mode implies is set on the ConfigDict, then every problem is named at once;
    # the run reads the frozen, typed RunConfig (nothing changes it afterwards).
    errs = pre_errs + config_errors(apply_mode(cfg))
    if errs:
        return _report(errs)
    run_cfg = freeze(cfg)

    refusal = start_refusal(run_cfg)  # (e.g. no vLLM server answering)
    if refusal:
        return _refuse(refusal)
    # Before the big allocations: freed blocks of this size leave the heap (footprint).
    mib = run_cfg.train.malloc_mmap_threshold_mib
    if mib > 0 and not footprint.set_mmap_threshold(mib):
        logging.getLogger("pmd_jax").warning(
            "train.malloc_mmap_threshold_mib=%s not applied (no glibc mallopt here): freed "
            "heap blocks stay resident until the trainer's trims", mib)
    # Before anything compiles: a restarted run loads its programs from this cache.
    cache_dir = setup_compilation_cache(run_cfg.train)
    logging.getLogger("pmd_jax").info(
        "XLA compilation cache: %s", cache_dir or "off (train.compilation_cache_dir)")

    maybe_initialize()

    try:  # set-up finds what validation could not see without loading: one line, exit 2
        trainer = Trainer(run_cfg)
    except DiskSpaceError as e:
        return _refuse(str(e))
    except (ConfigError, ModelFolderError, TokenizerError, ShardingError) as e:
        return _report([str(e)])  # (e.g. a mesh the devices here cannot hold)
    try:
        trainer.run()
    except (LegacyCheckpointError, HostStateError) as e:  # (at the resume, before any step)
        return _refuse(str(e))
    return 0


def run() -> None:
    run_command(main, _COMMAND_LINE)


if __name__ == "__main__":
    run()
