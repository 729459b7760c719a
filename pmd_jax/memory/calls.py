"""The memory's model calls: their SamplingParams, the replies, and the per-call counts.

Every reflection, cluster-summary, behavior-extraction and evolution call goes through
:func:`call_params` (the schema is sent when ``memory.structured_output`` is on, with the
memory's stop tokens) and :func:`generate_first` (one reply per conversation), and its
replies are counted under :data:`CALL_COUNTS`:

- ``reflections``: replies expected (one per conversation; a missing one counts too);
- ``parsed`` / ``json_error`` / ``schema_error``: exactly one per reply (memory/parsing.py),
  so ``reflections == parsed + json_error + schema_error``;
- ``truncated``: replies whose finish reason was "length" (cut at ``max_tokens``), whatever
  they parsed to;
- ``generated_tokens`` (:data:`COUNT_KEYS`, not a reply count): the tokens the sampler
  generated for the replies, so a run's generation spent on reflection is on record beside
  its rollouts'.

The insight level logs them bare (``reflections``, ``parsed``, ...); the behavior round under
``behavior/`` (all its calls) and ``behavior/<call>/`` per call type (``summary``,
``extraction``, ``evolution``). :func:`zero_counts` gives every such key at 0, so a step
where no call ran still logs them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pmd_jax import episode
from pmd_jax.memory.schemas import Schema, schema_param
from pmd_jax.sampling.base import Messages, SamplingParams

CALL_COUNTS = ("reflections", "parsed", "json_error", "schema_error", "truncated")
COUNT_KEYS = (*CALL_COUNTS, "generated_tokens")  # every per-call key, reply counts first
BEHAVIOR_CALLS = ("summary", "extraction", "evolution")


def call_params(call: str, sampling_cfg: Any, step: int, memory_cfg: Any, schema: Schema
                ) -> SamplingParams:
    """SamplingParams of one memory call named ``call`` (``insight``, ``summary``,
    ``extraction``, ``evolution``): ``sampling_cfg`` (temperature, top_p, top_k, max_tokens,
    seed; the sampling seed is ``derive_seed("memory.<call>", seed, step)``), the memory's
    stop tokens, and the schema when ``memory_cfg.structured_output`` is on."""
    return episode.sampling_params(
        sampling_cfg, n=1, stop_token_ids=memory_cfg.stop_token_ids, purpose=f"memory.{call}",
        seed_parts=(int(sampling_cfg.seed), int(step)),
        json_schema=schema_param(schema) if memory_cfg.structured_output else None)


def generate_first(generator: Any, conversations: Sequence[Messages], params: SamplingParams,
                   counts: Counter) -> list[str]:
    """The first reply text of each conversation; counts ``reflections`` and ``truncated``.

    ``generator``: a TextGenerator (``generate_replies``: texts with finish reasons), anything
    with ``generate_texts`` only (finish reasons unknown, never counted truncated), or None
    (no replies). A missing or malformed reply becomes "" (counted ``missing_reply``; it will
    count as a ``json_error`` when parsed).
    """
    n = len(conversations)
    replies: object = []
    if generator is not None and n:
        gen_replies = getattr(generator, "generate_replies", None)
        if gen_replies is not None:
            replies = gen_replies(conversations, params)
        else:
            replies = generator.generate_texts(conversations, params)
    out: list[str] = []
    for i in range(n):
        counts["reflections"] += 1
        try:
            r = replies[i]  # type: ignore[index]
            first = r[0] if isinstance(r, (list, tuple)) and r else r
        except (IndexError, KeyError, TypeError):
            first = None
        text = first if isinstance(first, str) else getattr(first, "text", None)
        if not isinstance(text, str):
            counts["missing_reply"] += 1
            text = ""
        if getattr(first, "finish_reason", None) == "length":
            counts["truncated"] += 1
        if first is not None:  # every reply the sampler generated for it (n of them)
            every = r if isinstance(r, (list, tuple)) else [r]
            counts["generated_tokens"] += sum(int(getattr(x, "num_tokens", 0) or 0)
                                              for x in every)
        out.append(text)
    return out


def zero_counts() -> dict[str, int]:
    """Every per-call count key of one memory update, at 0."""
    out = {k: 0 for k in COUNT_KEYS}
    out.update({f"behavior/{k}": 0 for k in COUNT_KEYS})
    out.update({f"behavior/{c}/{k}": 0 for c in BEHAVIOR_CALLS for k in COUNT_KEYS})
    return out


class TimedGenerator:
    """Wraps a TextGenerator and records the seconds spent generating (for stats).

    ``generate_replies`` answers with the wrapped generator's ``generate_replies`` (texts and
    finish reasons) or, for a generator that has only ``generate_texts``, with its texts.
    """

    def __init__(self, gen: Any) -> None:
        self.gen = gen
        self.seconds = 0.0

    def generate_replies(self, conversations: Sequence[Messages], params: SamplingParams) -> Any:
        if self.gen is None:
            return []
        t = time.perf_counter()
        try:
            fn = getattr(self.gen, "generate_replies", None) or self.gen.generate_texts
            return fn(conversations, params)
        finally:
            self.seconds += time.perf_counter() - t
