"""Command-line entry point.

    python -m pmd_jax.main --config=configs/smollm2_sciq.py [--config.rollout.n=4 ...]
    python -m pmd_jax.main --config=configs/olmo3.py --dry_run

The config is validated (unknown keys, impossible combinations, missing files) before any
model is loaded or any array is allocated.
"""

from __future__ import annotations

import logging
import os
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file in configs/ (ml_collections).", lock_config=True
)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Lower and compile the full-size step on abstract arrays; no weights."
)
_DRY_RUN_DEVICES = flags.DEFINE_integer(
    "dry_run_devices", 64, "Number of simulated CPU devices for --dry_run."
)


def _setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("absl", "jax._src", "orbax", "urllib3", "httpx", "sentence_transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str]) -> int:
    del argv
    _setup_logging()
    from pmd_jax.config import (
        ConfigError,
        apply_mode,
        setup_compilation_cache,
        validate_config,
    )

    cfg = _CONFIG.value
    if cfg is None:
        raise app.UsageError("--config=configs/<name>.py is required")
    if _DRY_RUN.value or cfg.get("dry_run", False):
        # Simulated devices must be configured before jax is imported anywhere.
        flags_env = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags_env:
            os.environ["XLA_FLAGS"] = (
                f"{flags_env} --xla_force_host_platform_device_count={_DRY_RUN_DEVICES.value}"
            ).strip()
        from pmd_jax.dry_run_step import dry_run_from_config

        dry_run_from_config(cfg)
        return 0
    cfg = apply_mode(cfg)
    try:
        validate_config(cfg)
    except ConfigError as e:
        logging.getLogger("pmd_jax").error("%s", e)
        return 2
    # Before anything compiles: a restarted run loads its programs from this cache.
    cache_dir = setup_compilation_cache(cfg.train)
    logging.getLogger("pmd_jax").info(
        "XLA compilation cache: %s", cache_dir or "off (train.compilation_cache_dir)")
    from pmd_jax.distributed import maybe_initialize

    maybe_initialize()
    from pmd_jax.trainer import Trainer

    Trainer(cfg).run()
    return 0


def run() -> None:
    app.run(lambda argv: sys.exit(main(argv)))


if __name__ == "__main__":
    run()
