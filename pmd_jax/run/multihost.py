"""The co-evolution loop across JAX processes (TPU pod slices, multi-GPU hosts).

Every host of a pod slice is a JAX process (``pmd_jax.run.distributed``). The loop splits its
work in two kinds, and this module holds the few tools that keep the processes in step.

* **SPMD work, on every process with the same inputs**: the jitted sampler's rollout call,
  the train step, publishing weights to the in-process sampler, the KL-to-initial forward,
  checkpoint saves and restores (orbax coordinates a multi-process save: every process
  writes the array shards it owns, process 0 the metadata). Inputs are host data that every
  process computes identically: problems come from the same seeded ``ProblemStream``,
  prompts from the same tokenizer, the rollout seed from ``derive_seed("rollout", cfg.seed,
  step)`` (``sampling/seeds.py``: no per-process salt). The sampler's
  outputs are global arrays; :func:`to_host` pulls them with ``process_allgather`` when they
  are not fully addressable, so every process decodes the very same tokens and log-probs.
* **Leader work, on process 0 alone**: verifying rollouts (a sandbox whose timing, and so
  whose timeouts, is not deterministic), updating the memory (its reflections, the embedder,
  clustering), building the teacher prompts, evaluation, and writing every file (metrics,
  TensorBoard, plots, memory.jsonl / memory.html, eval results, the HF export, the memory's
  checkpoint slot). The memory exists on process 0 only, so there is one memory, never a
  copy that could drift. Process 0 then broadcasts what the others need (rewards, verifier
  results, the train batch's host arrays, the metrics) with :func:`broadcast_object`.

The catch is that leader work *uses the SPMD sampler*: a reflection or an evaluation prompt
is a jitted, sharded generate call, which every process must enter with the same inputs.
:func:`lead` solves this with a small request loop: process 0 runs the leader function with
its ``TextGenerator`` on a :class:`LeaderSampler`, which first broadcasts each generate
request (prompts and ``SamplingParams``); the other processes wait in :func:`lead` for
requests, run the same generate call (discarding the result) and return when process 0
broadcasts the function's result (or its failure, which they re-raise naming process 0).
Nothing but these requests crosses the boundary, so the followers never need the memory,
the task's verifier or the evaluation code paths to be deterministic.

Why not run the memory everywhere? It would need every process to agree bit for bit on
embeddings (sentence-transformers on each host's CPU), k-means and sandbox outcomes, and a
single disagreement changes a teacher prompt, hence a batch shape, hence deadlocks the train
step. Why not split verification by process? It would be faster with many rollouts, but the
sandbox is a small share of a step next to sampling and training, and one owner is simpler
to get right; :func:`broadcast_object` is all a split would need to gather the results.

Broadcasts go through ``jax.experimental.multihost_utils.broadcast_one_to_all`` (a psum over
all devices), so they ride the same collectives as the train step (gloo on CPU, NCCL/ICI on
accelerators). Byte buffers are padded to a power of two so the broadcast program is
compiled for a handful of sizes only.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

log = logging.getLogger("pmd_jax")

_MIN_BYTES = 1024


class FollowerError(RuntimeError):
    """Process 0 failed inside leader work; the other processes stop with its message."""


def process_count() -> int:
    return jax.process_count()


def is_main() -> bool:
    return jax.process_index() == 0


def to_host(x: Any) -> np.ndarray:
    """A (possibly sharded, multi-process) array as one full numpy array on every process.

    Arrays whose shards all live on this process (single process, or fully replicated) are
    read directly; others are gathered with ``process_allgather`` (a collective: every
    process must call it for the same array at the same point)."""

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def gather_tree(tree: Any, keep: bool = True) -> Any:
    """:func:`to_host` on every leaf of a pytree (a collective with several processes).

    ``keep=False``: take part in the gathers but keep nothing (returns None), for processes
    that do not write the result: their host memory holds one leaf at a time."""

    if keep:
        return jax.tree.map(to_host, tree)
    for leaf in jax.tree.leaves(tree):
        to_host(leaf)
    return None


def _bucket(n: int) -> int:
    return max(_MIN_BYTES, 1 << max(0, int(n) - 1).bit_length())


def broadcast_object(obj: Any = None) -> Any:
    """Process 0's picklable ``obj``, returned on every process (a collective).

    The object is pickled to bytes on process 0; its length goes first (int32, so one
    broadcast is limited to 2 GiB), then the bytes, as a uint8 array padded to a power of two.
    The other processes' ``obj`` is ignored. With one process ``obj`` is returned as is."""

    if jax.process_count() == 1:
        return obj

    main = jax.process_index() == 0
    data = pickle.dumps(obj, protocol=5) if main else b""
    if len(data) >= 2**31:
        raise ValueError(f"broadcast_object: {len(data)} bytes is over the 2 GiB limit")
    n = int(multihost_utils.broadcast_one_to_all(np.asarray(len(data), np.int32)))
    buf = np.zeros((_bucket(n),), np.uint8)
    if main:
        buf[:n] = np.frombuffer(data, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return pickle.loads(out[:n].astype(np.uint8).tobytes())


class LeaderSampler:
    """Wraps a sampler for leader work: on process 0, inside :func:`lead`, every
    ``generate`` call is first broadcast to the other processes (which run it too).

    Outside :func:`lead` (and with one process) it is the wrapped sampler; other attributes
    are the wrapped sampler's."""

    def __init__(self, sampler: Any) -> None:
        self.inner = sampler
        self.leading = False

    def generate(self, prompts: Any, params: Any, **kw: Any) -> Any:
        if self.leading:
            # Callbacks (``progress``) stay here: they report on process 0's own call.
            sent = {k: v for k, v in kw.items() if not callable(v)}
            broadcast_object(("generate", [list(map(int, p)) for p in prompts], params, sent))
        return self.inner.generate(prompts, params, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def lead(fn: Callable[[], Any], sampler: LeaderSampler | None, what: str) -> Any:
    """Runs ``fn`` on process 0 and returns its result on every process (see the module
    docstring). ``sampler``: the :class:`LeaderSampler` that ``fn`` generates with (its
    requests are served by the other processes); ``what`` names the work in errors.

    With one process this is ``fn()``."""

    if jax.process_count() == 1:
        return fn()
    if jax.process_index() == 0:
        if sampler is not None:
            sampler.leading = True
        try:
            result = fn()
        except BaseException as e:
            if sampler is not None:
                sampler.leading = False
            broadcast_object(("error", f"{type(e).__name__}: {e}"))
            raise
        if sampler is not None:
            sampler.leading = False
        broadcast_object(("done", result))
        return result
    served = 0
    while True:
        msg = broadcast_object()
        kind = msg[0]
        if kind == "generate":
            if sampler is None:
                raise FollowerError(f"{what}: process 0 sent a generate request, but this "
                                    "process has no sampler to serve it")
            _, prompts, params, kw = msg
            try:
                sampler.inner.generate(prompts, params, **kw)
            except Exception as e:  # noqa: BLE001 - process 0 saw the same error (same inputs)
                log.warning("%s: generate request %d failed here too: %s", what, served, e)
            served += 1
        elif kind == "done":
            return msg[1]
        elif kind == "error":
            raise FollowerError(f"{what} failed on process 0: {msg[1]}")
        else:
            raise FollowerError(f"{what}: unknown message {kind!r} from process 0")
