"""The evaluation's prompts (``pmd_jax.loop.evaluate.make_generate_fn``): every form of a problem's
prompt (memory-free, with the memory's context, with a fast_slow context) carries the task's
response prefix, and every returned text starts with it, as in training.

A memory-conditioned evaluation rewrites the user turn (``teaching.teacher_messages``); the
prefix was looked up by the original user text, so those prompts lost it: the embedded
default's ``memory_only`` cell scored 2 of 100 with its memory (97 replies without an answer
tag) against 29 memory-free.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from pmd_jax.loop.evaluate import make_generate_fn
from pmd_jax.sampling.base import Rollout, Rollouts, TextGenerator

PREFIX = "<answer>"


class Model:
    stop_token_ids = (0,)

    @staticmethod
    def encode_prompt(conv, prefix: str) -> list[int]:
        text = "".join(f"[{m['role']}]{m['content']}" for m in conv) + "[assistant]" + prefix
        return list(text.encode())

    @staticmethod
    def count_tokens(text: str) -> int:
        return len(text)


class Memory:
    config = types.SimpleNamespace(verify=types.SimpleNamespace(enabled=False))

    def teacher_context(self, pid: str, question: str):
        return types.SimpleNamespace(
            render=lambda count: f"Lessons for {pid}: read the passage.\n\n{question}")


def _decode(ids) -> str:
    return bytes(int(i) for i in ids).decode()


@pytest.mark.parametrize("form", ["plain", "memory", "context"])
def test_every_prompt_form_keeps_the_response_prefix(form):
    seen: list[str] = []

    def generate(prompts, params, *, progress=None):
        seen.extend(_decode(p) for p in prompts)
        return Rollouts([Rollout(i, 0, np.asarray(list(b"oxygen"), np.int32),
                                 np.zeros(6, np.float32), "stop") for i in range(len(prompts))])

    sampler = types.SimpleNamespace(generate=generate)
    cfg = types.SimpleNamespace(eval=types.SimpleNamespace(temperature=0.0, top_p=1.0,
                                                           max_tokens=8))
    convs = [[{"role": "system", "content": "Answer."}, {"role": "user", "content": q}]
             for q in ("Which gas?", "Which metal?")]
    prefixes = {"Which gas?": PREFIX, "Which metal?": PREFIX}
    kw = {"plain": {}, "context": {"context": "Guide."},
          "memory": {"memory": Memory(), "pid_by_text": {"Which gas?": "p0",
                                                         "Which metal?": "p1"}}}[form]
    gen = make_generate_fn(cfg, Model(), TextGenerator(sampler, None, _decode),
                           prefix_by_text=prefixes, **kw)
    out = gen(convs, 1, 0)
    assert out == [[PREFIX + "oxygen"], [PREFIX + "oxygen"]]
    assert len(seen) == 2 and all(s.endswith("[assistant]" + PREFIX) for s in seen)
    if form == "memory":
        assert "Lessons for p0" in seen[0] and "Lessons for p1" in seen[1]
    if form == "context":
        assert all("Guide." in s for s in seen)
