"""One road for an episode: a problem's prompt -> generate -> decode -> verify -> counts.

Every place that has the policy attempt problems goes this way, and no other code builds a
:class:`~pmd_jax.sampling.base.SamplingParams`:

- the rollouts and the final KL's batch (``loop/rollout.py``): ``rollout``; ``seed``, step
- matched sampling's extra samples (``loop/teaching.py``): ``extra_demos``; ``seed``, step
- the check's replays (``loop/teaching.check_memory``): ``verify``; ``seed``,
  ``memory.verify.seed``, step
- MEL's replays (``modes/mel/lessons.py``): ``mel.replay``; ``seed``, step
- MEL's reflections: ``mel.reflection``; ``seed``, ``mel.reflection.seed``, step
- fast_slow's validation (``modes/fast_slow/pool.py``): ``fast_slow.val``; ``seed``, step
- fast_slow's rewrites: ``fast_slow.rewrite``; ``seed``, ``fast_slow.rewrite.seed``, step
- the memory's calls (``memory/calls.py``): ``memory.<call>``; the call's ``sampling.seed``,
  step
- evaluation (``loop/evaluate.py``): ``eval``; the evaluation seed (one of ``eval.seeds``)
- the probe (``probe/run.py``): ``probe.<what>``; ``seed``

(each line: the caller, the stream's ``purpose``, then what its draws depend on.)

A seed is :func:`~pmd_jax.sampling.seeds.derive_seed` of the purpose and those integers
(no process salt, no floats): the same config draws the same samples in every process and
every resumed leg. Within one generate() call the JAX sampler derives each row's key from the
seed, the prompt's index, the sample's index and the decode step, so a draw also depends on
where its prompt sits in the call (the caller's order, which each caller keeps fixed).

The parts of the road are separate because the trainer runs them at different times
(:func:`generate` in the background rollout thread, :func:`decode` on the main thread, the
verdicts after the batch is joined); :func:`attempt` runs them in one go for every other
caller and returns :class:`Attempts` with the token counts each caller reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pmd_jax.sampling.base import Messages, Rollouts, SamplingParams
from pmd_jax.sampling.seeds import derive_seed


# ----------------------------------------------------------------------------- prompts
def response_prefix(task: Any, problem: Any) -> str:
    """The text the task puts at the start of every response ("" for most tasks)."""
    fn = getattr(task, "response_prefix", None)
    return fn(problem) if fn is not None else ""


def user_text(messages: Messages) -> str:
    """The last user message of a task prompt (the problem as the memory and teacher see it)."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise ValueError("task prompt has no user message")
    return users[-1]


def encode(model: Any, task: Any, problem: Any, messages: Messages) -> tuple[str, list[int]]:
    """The response prefix of ``problem`` and the prompt tokens of ``messages`` ending in it
    (the chat template's generation prompt, then the prefix)."""
    pre = response_prefix(task, problem)
    return pre, model.encode_prompt(messages, pre)


# ----------------------------------------------------------------------------- sampling
def sampling_params(section: Any, *, n: int, stop_token_ids: Sequence[int], purpose: str,
                    seed_parts: Sequence[int | str], json_schema: str | None = None,
                    **override: Any) -> SamplingParams:
    """The SamplingParams of one stream: ``temperature``, ``top_p``, ``top_k`` (0 where the
    section has none) and ``max_tokens`` from the config ``section`` unless given in
    ``override``; the seed :func:`derive_seed` ``(purpose, *seed_parts)``."""
    unknown = set(override) - {"temperature", "top_p", "top_k", "max_tokens"}
    if unknown:
        raise TypeError(f"sampling_params: unknown override(s) {sorted(unknown)}")

    def pick(name: str, default: Any = None) -> Any:
        v = override.get(name)
        return v if v is not None else getattr(section, name, default)

    return SamplingParams(
        n=int(n), temperature=float(pick("temperature")), top_p=float(pick("top_p")),
        top_k=int(pick("top_k", 0)), max_tokens=int(pick("max_tokens")),
        stop_token_ids=tuple(int(t) for t in stop_token_ids),
        seed=derive_seed(purpose, *seed_parts), json_schema=json_schema)


def rollout_params(cfg: Any, model: Any, n: int, purpose: str, *parts: int,
                   **override: Any) -> SamplingParams:
    """An attempt at the run's problems as the rollouts sample them (``cfg.rollout``, the
    model's stop tokens), ``n`` samples each; the seed from the run's ``seed`` and ``parts``."""
    return sampling_params(cfg.rollout, n=n, stop_token_ids=model.stop_token_ids,
                           purpose=purpose, seed_parts=(int(cfg.seed), *parts), **override)


# ----------------------------------------------------------------------------- the road
def generate(sampler: Any, prompts: Sequence[Sequence[int]], params: SamplingParams,
             progress: Callable[[int], None] | None = None) -> Rollouts:
    """``params.n`` samples of each prompt (``progress``: rows finished, as they finish)."""
    if progress is None:
        return sampler.generate(prompts, params)
    return sampler.generate(prompts, params, progress=progress)


def decode(model: Any, rollouts: Rollouts, prefixes: Sequence[str]) -> list[str]:
    """Each rollout's text as the verifier reads it: its prompt's response prefix, then the
    decoded tokens."""
    return [prefixes[r.prompt_index] + model.decode(r.tokens.tolist()) for r in rollouts]


def grade(task: Any, problems: Sequence[Any], rollouts: Rollouts, texts: Sequence[str],
          split: str) -> list[Any]:
    """The task's result for each rollout (``problems``: one per prompt)."""
    return list(task.verify_batch([problems[r.prompt_index] for r in rollouts], list(texts),
                                  split))


@dataclasses.dataclass
class Attempts:
    """One call's attempts, in the sampler's (prompt-major) order."""

    rollouts: Rollouts
    texts: list[str]
    results: list[Any]
    prompt_tokens: int  # of the prompts sent (each once, whatever n)

    @property
    def sequences(self) -> int:
        return len(self.rollouts)

    @property
    def generated_tokens(self) -> int:
        return int(sum(len(r.tokens) for r in self.rollouts))

    def solved(self, threshold: float) -> list[bool]:
        """Whether each attempt's reward reaches ``threshold``."""
        return [float(r.reward) >= float(threshold) for r in self.results]

    def grid(self, prompts: int, n: int, values: Sequence[Any], dtype: Any) -> np.ndarray:
        """``values`` (one per attempt) placed at ``[prompt_index, sample_index]``."""
        out = np.zeros((prompts, n), dtype)
        for r, v in zip(self.rollouts, values, strict=True):
            out[r.prompt_index, r.sample_index] = v
        return out


def attempt(sampler: Any, model: Any, task: Any, problems: Sequence[Any],
            prompts: Sequence[Sequence[int]], params: SamplingParams, *, split: str = "train",
            prefixes: Sequence[str] | None = None,
            progress: Callable[[int], None] | None = None) -> Attempts:
    """Generate, decode and verify: ``params.n`` attempts at each ``problems[i]`` from
    ``prompts[i]`` (which must end in the problem's response prefix; ``prefixes`` default to
    the task's), graded on ``split``."""
    if len(problems) != len(prompts):
        raise ValueError(f"attempt: {len(problems)} problems but {len(prompts)} prompts")
    if not prompts:
        return Attempts(Rollouts([]), [], [], 0)
    pre = (list(prefixes) if prefixes is not None
           else [response_prefix(task, p) for p in problems])
    rollouts = generate(sampler, prompts, params, progress)
    texts = decode(model, rollouts, pre)
    results = grade(task, problems, rollouts, texts, split)
    return Attempts(rollouts, texts, results, int(sum(len(x) for x in prompts)))
