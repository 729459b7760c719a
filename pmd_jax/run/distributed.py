"""Multi-process start-up: jax.distributed from environment variables.

- ``PMD_COORDINATOR=host:port PMD_NUM_PROCESSES=N PMD_PROCESS_ID=i``: explicit (GPU hosts,
  local multi-process tests on CPU).
- ``PMD_DISTRIBUTED=auto``: let JAX discover peers (TPU pod slices, SLURM).
- neither: single process.

Failure detection (optional, seconds, passed to ``jax.distributed.initialize``):
``PMD_HEARTBEAT_TIMEOUT_S`` (jax's ``heartbeat_timeout_seconds``, default 100: a process whose
peer stopped answering for this long is terminated by jax with an error naming the dead task),
``PMD_INIT_TIMEOUT_S`` (``initialization_timeout``, default 300: how long to wait for every
process to join) and ``PMD_SHUTDOWN_TIMEOUT_S`` (``shutdown_timeout_seconds``, default 300).
"""

from __future__ import annotations

import logging
import os
from typing import TypedDict

import jax

log = logging.getLogger("pmd_jax")


class _Timeouts(TypedDict, total=False):
    """The ``jax.distributed.initialize`` timeouts the environment sets (seconds)."""

    heartbeat_timeout_seconds: int
    initialization_timeout: int
    shutdown_timeout_seconds: int


def _seconds(env: str) -> int | None:
    """``env`` as a whole number of seconds >= 1; None when unset or empty."""
    v = os.environ.get(env, "").strip()
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        n = -1
    if n < 1:
        raise RuntimeError(f"{env}={v!r} must be a whole number of seconds >= 1")
    return n


def _timeouts() -> _Timeouts:
    out: _Timeouts = {}
    if (n := _seconds("PMD_HEARTBEAT_TIMEOUT_S")) is not None:
        out["heartbeat_timeout_seconds"] = n
    if (n := _seconds("PMD_INIT_TIMEOUT_S")) is not None:
        out["initialization_timeout"] = n
    if (n := _seconds("PMD_SHUTDOWN_TIMEOUT_S")) is not None:
        out["shutdown_timeout_seconds"] = n
    return out


def maybe_initialize() -> bool:
    """Initialises jax.distributed when the environment asks for it; returns True if it did."""
    coord = os.environ.get("PMD_COORDINATOR")
    auto = os.environ.get("PMD_DISTRIBUTED", "") == "auto"
    if not coord and not auto:
        return False

    timeouts = _timeouts()
    if coord:
        try:
            n = int(os.environ["PMD_NUM_PROCESSES"])
            pid = int(os.environ["PMD_PROCESS_ID"])
        except (KeyError, ValueError) as e:
            raise RuntimeError(
                "PMD_COORDINATOR is set, so PMD_NUM_PROCESSES and PMD_PROCESS_ID must be "
                f"integers too ({e})"
            ) from None
        local_ids = None
        if os.environ.get("PMD_LOCAL_DEVICE_IDS"):
            local_ids = [int(x) for x in os.environ["PMD_LOCAL_DEVICE_IDS"].split(",")]
        jax.distributed.initialize(
            coordinator_address=coord, num_processes=n, process_id=pid,
            local_device_ids=local_ids, **timeouts,
        )
    else:
        jax.distributed.initialize(**timeouts)
    log.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),
    )
    return True
