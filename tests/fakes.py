"""Fakes and tiny model configs shared by the tests.

``FakeSampler`` implements the whole ``pmd_jax.sampling.base.Sampler`` contract: it records
every weight call and every ``generate`` request, and answers with deterministic token
rollouts (prompt[:2] + [sample index]; odd samples stop at the length limit).
``FakeModel`` (with ``CharTokenizer``: one token per character) is the host-side model the
loop's functions take, without a tokenizer file. ``HashEmbedder`` stands in for the memory's
sentence embedder. ``tiny_model_config`` is the random model a test builds for itself.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from pmd_jax.models.config import ModelConfig
from pmd_jax.sampling.base import Rollout, Rollouts, SamplingParams


def assert_same_tree(a: Any, b: Any, path: str = "") -> None:
    """Deep equality of host state (dicts in key order, lists, tuples, numpy arrays and
    scalars bit for bit, NaN equal to NaN), naming the path of the first difference."""
    import math

    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray | np.generic):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b), path
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), path
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, (path, a, b)


class FakeSampler:
    def __init__(self, sharing: str = "in_process") -> None:
        self.sharing = sharing
        self.calls: list[tuple[str, Any]] = []  # weight calls, in order
        self.params: list[SamplingParams] = []  # generate requests, in order

    def generate(self, prompts, params: SamplingParams, *, progress=None) -> Rollouts:
        self.params.append(params)
        items = []
        for i, p in enumerate(prompts):
            for s in range(params.n):
                toks = np.asarray(list(p[:2]) + [s], np.int32)
                items.append(Rollout(i, s, toks, np.zeros(len(toks), np.float32),
                                     "length" if s % 2 else "stop"))
        return Rollouts(items)

    def share_weights(self) -> str:
        return self.sharing

    def set_params(self, params: Any, version: int, *, copy: bool = False) -> None:
        self.calls.append(("set_params", (params, version, copy)))

    def release_params(self) -> None:
        self.calls.append(("release_params", None))

    def set_weights(self, version: int) -> None:
        self.calls.append(("set_weights", version))


class CharTokenizer:
    """One token per character (its code point); nothing special."""

    special_tokens: list[str] = []

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class FakeModel:
    """The host-side model (``pmd_jax.loop.build``'s) over ``CharTokenizer``: a chat is its
    messages' contents joined by newlines, a token count is a character count."""

    tokenizer = CharTokenizer()
    stop_token_ids: list[int] = []
    pad_id = 0

    def encode_chat(self, messages) -> list[int]:
        return self.tokenizer.encode("\n".join(m["content"] for m in messages))

    def encode_prompt(self, messages, prefix: str = "") -> list[int]:
        return self.encode_chat(messages) + self.tokenizer.encode(prefix)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def count_tokens(self, text: str) -> int:
        return len(text)


class HashEmbedder:
    """Deterministic unit vectors from a hash of the text (no model; stands in for MiniLM):
    ``dim`` numbers drawn from a generator seeded by the text's CRC-32."""

    def __init__(self, dim: int = 32, model_name: str = "test-hash-embedder") -> None:
        self.dim, self.model_name = dim, model_name

    def embed(self, texts, *, query: bool = False) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        v = np.stack([np.random.default_rng(zlib.crc32(t.encode())).standard_normal(self.dim)
                      for t in texts]).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)


# The tests' own tiny random models, by shape; a test passes only what it changes
# (``tiny_model_config(num_kv_heads=1)``, ``tiny_model_config("sampler", vocab_size=64)``).
TINY_SHAPES: dict[str, dict[str, Any]] = {
    # the train-step tests (distill, checkpoints, the dry run's mel step): width 16, 2 heads
    "step": dict(family="llama", vocab_size=48, hidden_size=16, intermediate_size=32,
                 num_layers=2, num_heads=2, num_kv_heads=2, head_dim=8),
    # the sampler tests: width 32, 4 heads over 2 KV heads, 256 positions
    "sampler": dict(family="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    max_position_embeddings=256),
}


def tiny_model_config(shape: str = "step", **overrides: Any) -> ModelConfig:
    """A 2-layer random Llama of ``TINY_SHAPES[shape]`` with ``overrides``."""
    return ModelConfig(**{**TINY_SHAPES[shape], **overrides})
