"""The ``fast_slow`` section of the run config (``mode=fast_slow``, :mod:`pmd_jax.modes.fast_slow`):
every knob once, with its help. FST's setting is named in the help where the review gives it
(``../shared/docs/seed-fast-slow-review.txt``); where it does not, the value is ours."""

from __future__ import annotations

import dataclasses
from typing import Any

from pmd_jax.config.schema import Section, knob, section
from pmd_jax.memory.config import MemorySampling

DEFAULT_SEED_CONTEXT = ("Read the problem carefully, use what you know, and check your answer "
                        "before you give it.")


def _rewrite_sampling() -> MemorySampling:
    return MemorySampling(temperature=0.7, top_p=1.0, top_k=0, max_tokens=160, seed=0)


@dataclasses.dataclass(frozen=True)
class FastSlowConfig(Section):
    """Fast-Slow Training (FST, arXiv 2605.12484): a Pareto pool of textual contexts (fast
    weights) in the policy's prompt, GRPO on the weights (slow weights)."""

    pool_size: int = knob(4, "K: contexts kept in the pool (the Pareto front is cut to K). FST "
                          "sweeps K (review, Figure 9a).")
    val_size: int = knob(8, "Validation problems (drawn from the TRAIN split, disjoint from the "
                         "held-out evaluation problems) on which each candidate context is "
                         "scored; the per-problem rewards define the Pareto front.")
    val_samples: int = knob(1, "Samples per validation problem and candidate (its score is their "
                            "mean reward).")
    val_max_tokens: int = knob(0, "Response budget of a validation sample; 0 = "
                               "rollout.max_tokens.")
    val_in_train: bool = knob(False, "False: the validation problems are held out of the "
                              "training stream (GEPA's separate Pareto set); True: they are "
                              "also trained on.")
    update_every: int = knob(1, "Cycle length T: the pool is updated after every T-th step "
                             "(review, Figure 9c sweeps T; its headline T is not in the review).")
    memory_candidates: int = knob(1, "New candidates per update rendered from the memory's "
                                  "insight and behavior levels (ours: the memory's reflection "
                                  "feeds the pool).")
    rewrite_candidates: int = knob(1, "New candidates per update written by the policy as a "
                                   "reflective rewrite of a pool context from this step's "
                                   "rollouts, rewards and feedback (FST's fast loop is GEPA, "
                                   "review Figure 1 and Appendix A). 0 = memory renderings only.")
    rewrite_rollouts: int = knob(4, "Rollouts (text, reward, feedback) shown to a rewrite.")
    rewrite_attempt_chars: int = knob(800, "Each response shown to a rewrite is cut to this "
                                      "many characters (the problem too).")
    rewrite: MemorySampling = section(MemorySampling, "Sampling of the rewrite call (the policy "
                                      "writes it; seed offset by the step).",
                                      factory=_rewrite_sampling)
    rescore_pool: bool = knob(False, "True: every update scores the whole pool again with the "
                              "current weights; False: a context keeps the scores it got when "
                              "it entered (GEPA scores a candidate once).")
    max_context_tokens: int = knob(128, "Token budget of one context (memory items are dropped "
                                   "from the end, a rewrite is cut, to fit); the context is "
                                   "part of the student prompt, so rollout.max_prompt_tokens "
                                   "must leave room for it.")
    max_items: int = knob(8, "Memory items (behaviors, strategies, lessons) in one rendering.")
    seed_context: str = knob(DEFAULT_SEED_CONTEXT, "The pool's first context (GEPA starts from "
                             "a seed prompt).")

    def errors(self) -> list[str]:
        s = self
        errs: list[str] = []

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("pool_size", "val_size", "val_samples", "update_every", "rewrite_rollouts",
                     "rewrite_attempt_chars", "max_context_tokens", "max_items"):
            v = getattr(s, name)
            if not (is_int(v) and v >= 1):
                errs.append(f"fast_slow.{name} must be an int >= 1, got {v!r}")
        for name in ("val_max_tokens", "memory_candidates", "rewrite_candidates"):
            v = getattr(s, name)
            if not (is_int(v) and v >= 0):
                errs.append(f"fast_slow.{name} must be an int >= 0, got {v!r}")
        if (is_int(s.memory_candidates) and is_int(s.rewrite_candidates)
                and s.memory_candidates == s.rewrite_candidates == 0):
            errs.append("fast_slow.memory_candidates + fast_slow.rewrite_candidates must be "
                        ">= 1 (the pool would never change)")
        if not isinstance(s.seed_context, str) or not s.seed_context.strip():
            errs.append(f"fast_slow.seed_context must be a non-empty string, got "
                        f"{s.seed_context!r}")
        r = s.rewrite
        if not (isinstance(r.temperature, (int, float)) and r.temperature >= 0):
            errs.append(f"fast_slow.rewrite.temperature must be >= 0, got {r.temperature!r}")
        if not (isinstance(r.top_p, (int, float)) and 0 < r.top_p <= 1):
            errs.append(f"fast_slow.rewrite.top_p must be in (0, 1], got {r.top_p!r}")
        if not (is_int(r.max_tokens) and r.max_tokens >= 1):
            errs.append(f"fast_slow.rewrite.max_tokens must be >= 1, got {r.max_tokens!r}")
        return errs
