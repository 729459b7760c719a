"""Fakes shared by the tests: a ``Sampler`` that needs no model.

``FakeSampler`` implements the whole ``pmd_jax.sampling.base.Sampler`` contract: it records
every weight call and every ``generate`` request, and answers with deterministic token
rollouts (prompt[:2] + [sample index]; odd samples stop at the length limit).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pmd_jax.sampling.base import Rollout, Rollouts, SamplingParams


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
