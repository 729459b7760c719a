"""The Sampler contract shared by the trainer, the memory's reflection calls and evaluation.

A sampler turns token-id prompts into sampled continuations. Implementations: the in-process
JAX sampler (embedded default) and the vLLM client (external server). Everything above this
module talks to ``Sampler`` only.

New weights reach a sampler in one of two ways, which the sampler names with
``share_weights()`` (``sampling/publish.py`` asks it, never probes attributes):

* ``"in_process"``: the sampler lives in the trainer's process and takes the param arrays
  themselves, ``set_params(params, version)``; ``release_params()`` drops them while nothing
  samples (the trainer does so during a train step that replaces them);
* ``"store"``: the sampler reads a committed version of the tensorstore weight store
  (``sampling/weight_store.py``) that the trainer published, ``set_weights(version)``.

Adding a backend: a module here with a class implementing the five methods of
:class:`Sampler` (errors are :class:`SamplerError`, a server's failures
:class:`SamplerServerError`); and one entry in ``sampling/backends.py:BACKENDS``
(its ``rollout.sampler`` name and how it is built; config validation reads the names there).
Publishing needs nothing new as long as it shares weights one of the two ways above.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

FinishReason = Literal["stop", "length"]


class SamplerError(RuntimeError):
    """A sampler could not serve a request (bad input, unreachable server, bad weights)."""


class SamplerServerError(SamplerError):
    """A sampler's server could not be started or reached, or answered with an error."""


# How a sampler takes new weights (see the module docstring).
WeightSharing = Literal["in_process", "store"]
WEIGHT_SHARING: tuple[WeightSharing, ...] = ("in_process", "store")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature=0`` means greedy; logprobs are then those at T=1."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    # Structured output: a JSON schema, as a JSON string (so the params stay hashable). When
    # set, every sampled token is one that the schema's grammar allows at that point, so the
    # text always parses and validates (finish reason "length" aside), and the returned
    # logprobs are those of the masked, renormalised distribution actually sampled from. A
    # sampler that cannot constrain its output raises SamplerError rather than ignore it.
    json_schema: str | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        if self.n < 1:
            raise SamplerError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise SamplerError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplerError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplerError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise SamplerError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as e:
                raise SamplerError(f"SamplingParams.json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise SamplerError("SamplingParams.json_schema must be a JSON object (a schema)")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplerError(
                    f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})"
                )


def schema_string(schema: dict) -> str:
    """The canonical ``SamplingParams.json_schema`` string of a schema dict."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


@dataclasses.dataclass
class Rollout:
    """One sampled continuation of one prompt."""

    prompt_index: int  # index into the list of prompts passed to generate()
    sample_index: int  # 0..n-1 within that prompt
    tokens: np.ndarray  # int32 [len], response tokens (stop token included if hit)
    logprobs: np.ndarray  # float32 [len], log p(token) at the sampling temperature
    finish_reason: FinishReason


@dataclasses.dataclass
class Rollouts:
    """All rollouts of one generate() call, ordered prompt-major: prompt 0 samples 0..n-1, ..."""

    items: list[Rollout]
    weights_version: int | None = None

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


@runtime_checkable
class Sampler(Protocol):
    """Generate ``params.n`` samples for each token-id prompt; swap weights by version.

    ``progress``, if given, is called with the number of rows (prompt x sample) finished each
    time some finish (a long request reports as it goes; at the latest once, at the end).

    Weights: ``share_weights()`` says how the sampler takes them ("in_process" or "store");
    an "in_process" sampler implements ``set_params`` and ``release_params``, a "store" one
    ``set_weights`` (the other methods raise :class:`SamplerError` saying which to use).
    """

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 progress: Callable[[int], None] | None = None) -> Rollouts: ...

    def share_weights(self) -> WeightSharing:
        """How this sampler takes new weights: "in_process" or "store"."""
        ...

    def set_params(self, params: Any, version: int, *, copy: bool = False) -> None:
        """Use the param pytree ``params`` (``models.decoder`` layout) as ``version``.

        ``copy=True``: the caller will delete (donate) these arrays, so the sampler must not
        keep references to them."""
        ...

    def release_params(self) -> None:
        """Drop the weights ``set_params`` gave (generate refuses until it gives new ones):
        the trainer calls it while a train step computes the weights that replace them."""
        ...

    def set_weights(self, version: int) -> None:
        """Load committed ``version`` from the weight store and use it."""
        ...


# A chat message list, e.g. [{"role": "system", "content": ...}, {"role": "user", ...}].
Messages = list[dict[str, str]]


@dataclasses.dataclass(frozen=True)
class TextReply:
    """One decoded response, why it ended ("length": cut at ``max_tokens``) and how many
    tokens were generated for it (0 when unknown)."""

    text: str
    finish_reason: FinishReason
    num_tokens: int = 0


class TextGenerator:
    """Chat-level adapter over a Sampler: messages in, decoded texts out.

    The memory's reflection calls and evaluation use this; they never see token ids.
    ``encode_chat`` renders messages with the model's chat template (generation prompt added)
    and returns token ids; ``decode`` turns response ids back into text.
    ``generate_replies`` also gives each response's finish reason; ``generate_texts`` only the
    texts.
    """

    def __init__(
        self,
        sampler: Sampler,
        encode_chat: Callable[[Messages], list[int]],
        decode: Callable[[Sequence[int]], str],
    ) -> None:
        self.sampler = sampler
        self.encode_chat = encode_chat
        self.decode = decode

    def generate_replies(self, conversations: Sequence[Messages], params: SamplingParams, *,
                         progress: Callable[[int], None] | None = None
                         ) -> list[list[TextReply]]:
        """Returns, for each conversation, ``params.n`` decoded responses with finish reasons
        (``progress``: see :class:`Sampler`)."""
        if not conversations:
            return []
        prompts = [self.encode_chat(m) for m in conversations]
        kw = {} if progress is None else {"progress": progress}
        rollouts = self.sampler.generate(prompts, params, **kw)
        out: list[list[TextReply]] = [[] for _ in conversations]
        for r in rollouts:
            out[r.prompt_index].append(
                TextReply(self.decode(r.tokens.tolist()), r.finish_reason, int(len(r.tokens))))
        return out

    def generate_texts(self, conversations: Sequence[Messages], params: SamplingParams, *,
                       progress: Callable[[int], None] | None = None) -> list[list[str]]:
        """Returns, for each conversation, ``params.n`` decoded responses."""
        return [[r.text for r in rs]
                for rs in self.generate_replies(conversations, params, progress=progress)]
