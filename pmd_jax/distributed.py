"""Multi-process start-up: jax.distributed from environment variables.

- ``PMD_COORDINATOR=host:port PMD_NUM_PROCESSES=N PMD_PROCESS_ID=i``: explicit (GPU hosts,
  local multi-process tests on CPU).
- ``PMD_DISTRIBUTED=auto``: let JAX discover peers (TPU pod slices, SLURM).
- neither: single process.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("pmd_jax")


def maybe_initialize() -> bool:
    """Initialises jax.distributed when the environment asks for it; returns True if it did."""
    coord = os.environ.get("PMD_COORDINATOR")
    auto = os.environ.get("PMD_DISTRIBUTED", "") == "auto"
    if not coord and not auto:
        return False
    import jax

    if coord:
        try:
            n = int(os.environ["PMD_NUM_PROCESSES"])
            pid = int(os.environ["PMD_PROCESS_ID"])
        except (KeyError, ValueError) as e:
            raise RuntimeError(
                "PMD_COORDINATOR is set, so PMD_NUM_PROCESSES and PMD_PROCESS_ID must be "
                f"integers too ({e})"
            ) from None
        kw = {}
        if os.environ.get("PMD_LOCAL_DEVICE_IDS"):
            kw["local_device_ids"] = [
                int(x) for x in os.environ["PMD_LOCAL_DEVICE_IDS"].split(",")
            ]
        jax.distributed.initialize(
            coordinator_address=coord, num_processes=n, process_id=pid, **kw
        )
    else:
        jax.distributed.initialize()
    log.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),
    )
    return True
