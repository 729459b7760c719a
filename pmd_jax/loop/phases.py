"""The loop's phase plumbing: each phase of a step timed (with the process's peak RSS after
it, and the C heap's freed pages handed back), and a retry with backoff for phases that call
a sampler server. The trainer (``pmd_jax.loop.trainer``) wraps its phases in these."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from pmd_jax.run import footprint
from pmd_jax.sampling.base import SamplerError

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """The run cannot continue (repeated non-finite losses, unreachable sampler, ...)."""


@contextlib.contextmanager
def timed(times: dict[str, float], name: str) -> Iterator[None]:
    """Adds the block's wall time to ``times["time_<name>"]`` and records the peak RSS after
    it (``rss_peak_gib_after_<name>``)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[f"time_{name}"] = times.get(f"time_{name}", 0.0) + time.perf_counter() - t0
        # The process's peak RSS once this phase is done: the phase where it jumps is the one
        # that sets the run's memory need.
        times[f"rss_peak_gib_after_{name}"] = footprint.peak_rss_gib()
        # What the phase freed (temporaries, compiler memory, replaced weights) goes back to
        # the kernel instead of staying resident in the C heap under the next phase's peak.
        footprint.release_free_memory()


def retry(fn, what: str, retries: int, base_delay: float = 2.0):
    """Calls ``fn`` with exponential backoff on SamplerError/ConnectionError/TimeoutError."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except (SamplerError, ConnectionError, TimeoutError) as e:
            if attempt == retries:
                raise TrainingError(f"{what} failed after {retries + 1} attempts: {e}") from e
            delay = base_delay * 2**attempt
            log.warning("%s failed (%s); retrying in %.0fs", what, e, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
