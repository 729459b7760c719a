"""The fast weights: a seeded pool of textual contexts, kept as a Pareto front over
per-problem validation reward, updated between steps (``ContextPool.update``)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pmd_jax import episode
from pmd_jax.episode import response_prefix, user_text
from pmd_jax.memory.sanitize import sanitize_text
from pmd_jax.modes.fast_slow.contexts import fit_lines as _fit
from pmd_jax.modes.fast_slow.contexts import (
    render_memory,
    rewrite_conversation,
    with_context,
)
from pmd_jax.modes.fast_slow.pareto import pareto_front
from pmd_jax.run import multihost
from pmd_jax.sampling.base import Messages, TextGenerator
from pmd_jax.sampling.seeds import derive_seed

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig

log = logging.getLogger(__name__)

STATE_VERSION = 1
# Per-step metrics (train records); the *_tokens ones count generation for the grid.
STAT_KEYS: tuple[str, ...] = (
    "fast_slow_updated", "fast_slow_pool_size", "fast_slow_candidates",
    "fast_slow_candidates_scored", "fast_slow_duplicates", "fast_slow_front_size",
    "fast_slow_best_val_reward", "fast_slow_context_tokens", "fast_slow_rewrite_tokens",
    "fast_slow_val_tokens", "fast_slow_generated_tokens", "fast_slow_rewrite_too_long",
)


@dataclasses.dataclass
class Candidate:
    """One context of the pool: its text, where it came from and its validation scores."""

    cid: int
    text: str
    source: str  # "seed" | "memory" | "rewrite"
    step: int  # the step whose update proposed it (-1: the seed)
    scores: list[float] | None = None  # mean reward per validation problem; None: unscored

    @property
    def mean(self) -> float:
        return float(np.mean(self.scores)) if self.scores else float("-inf")


class ContextPool:
    """The pool of K contexts (``fast_slow.pool_size``) and its validation problems.

    ``draw(step, position)`` picks the context of the ``position``-th problem of step
    ``step`` (uniform over the pool, seeded by (seed, step, position)) and records it;
    ``update`` proposes candidates, scores them on the validation problems with the current
    weights and keeps the Pareto front; ``deployed()`` is the best context by mean validation
    reward. ``state_dict`` / ``load_state_dict`` restore it exactly (the checkpoint's
    ``fast_slow`` slot).
    """

    def __init__(self, cfg: RunConfig, model: Any, task: Any, val_problems: Sequence[Any]) -> None:
        self.cfg, self.model, self.task = cfg, model, task
        self.fs = cfg.fast_slow
        self.val_problems = list(val_problems)
        self.candidates = [Candidate(0, str(self.fs.seed_context).strip(), "seed", -1)]
        self.next_id = 1
        self.draws: dict[int, dict[int, int]] = {}  # step -> problem position -> context id

    # ------------------------------------------------------------------ rollouts
    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng(derive_seed("fast_slow.draw", int(self.cfg.seed), *key))

    def draw(self, step: int, position: int) -> Candidate:
        c = self.candidates[int(self._rng(step, position).integers(len(self.candidates)))]
        self.draws.setdefault(int(step), {})[int(position)] = c.cid
        return c

    def messages(self, step: int, position: int, messages: Messages) -> Messages:
        return with_context(messages, self.draw(step, position).text)

    def deployed(self) -> Candidate:
        """The pool's best context (highest mean validation reward; the older on ties; the
        first when none is scored yet)."""
        best = self.candidates[0]
        for c in self.candidates[1:]:
            if c.mean > best.mean:
                best = c
        return best

    # ------------------------------------------------------------------ update
    def update(self, step: int, sb: Any, memory: Any, textgen: TextGenerator) -> dict[str, float]:
        """After step ``step``: new candidates from the memory and from a rewrite of a pool
        context, scored on the validation problems, the Pareto front kept (capped at K)."""
        fs = self.fs
        st = dict.fromkeys(STAT_KEYS, 0.0)
        self.draws = {s: d for s, d in self.draws.items() if s >= step - 1}
        if (step + 1) % int(fs.update_every) == 0:
            st["fast_slow_updated"] = 1.0
            new = self._memory_candidates(step, memory)
            new += self._rewrites(step, sb, textgen, st)
            known = {c.text for c in self.candidates}
            fresh = []
            for c in new:
                if c.text and c.text not in known:
                    known.add(c.text)
                    fresh.append(c)
            st["fast_slow_candidates"] = float(len(new))
            st["fast_slow_duplicates"] = float(len(new) - len(fresh))
            every = [*self.candidates, *fresh]
            todo = [c for c in every if c.scores is None or fs.rescore_pool]
            self._score(step, todo, textgen, st)
            st["fast_slow_candidates_scored"] = float(len(todo))
            # (every candidate is scored now: the unscored ones were in todo)
            keep, front = pareto_front([c.scores or [] for c in every], int(fs.pool_size))
            self.candidates = [every[i] for i in keep]
            st["fast_slow_front_size"] = float(front)
        st["fast_slow_pool_size"] = float(len(self.candidates))
        scored = [c.mean for c in self.candidates if c.scores]
        st["fast_slow_best_val_reward"] = max(scored) if scored else float("nan")
        st["fast_slow_context_tokens"] = float(np.mean(
            [self.model.count_tokens(c.text) for c in self.candidates]))
        st["fast_slow_generated_tokens"] = (st["fast_slow_rewrite_tokens"]
                                            + st["fast_slow_val_tokens"])
        return st

    def _new(self, text: str, source: str, step: int) -> Candidate:
        c = Candidate(self.next_id, text, source, int(step))
        self.next_id += 1
        return c

    def _memory_candidates(self, step: int, memory: Any) -> list[Candidate]:
        out = []
        for k in range(int(self.fs.memory_candidates)):
            text = render_memory(memory, self._rng(step, 1 << 20, k), int(self.fs.max_items),
                                 self.model.count_tokens, int(self.fs.max_context_tokens))
            if text:
                out.append(self._new(text, "memory", step))
        return out

    def _rewrites(self, step: int, sb: Any, textgen: TextGenerator,
                  st: dict[str, float]) -> list[Candidate]:
        """GEPA-style reflective mutations: a parent drawn from the pool (by how many validation
        problems it is best on, GEPA's rule; uniform before any score), shown this step's
        rollouts made with it (else any), rewritten by the policy."""

        fs = self.fs
        n = int(fs.rewrite_candidates)
        if n == 0 or not len(sb.rollouts):
            return []
        convs: list[Messages] = []
        rollouts = list(sb.rollouts)
        for k in range(n):
            rng = self._rng(step, 2 << 20, k)
            parent = self.candidates[int(rng.choice(len(self.candidates), p=self._weights()))]
            drawn = self.draws.get(int(step), {})
            idx = [i for i, r in enumerate(rollouts) if drawn.get(r.prompt_index) == parent.cid]
            idx = idx or list(range(len(rollouts)))
            pick = sorted(rng.permutation(len(idx))[: int(fs.rewrite_rollouts)].tolist())
            attempts = []
            for i in (idx[j] for j in pick):
                r, res = rollouts[i], sb.results[i]
                attempts.append((user_text(sb.messages[r.prompt_index]), sb.texts[i],
                                 float(res.reward), res.feedback or ""))
            conv = rewrite_conversation(parent.text, attempts, int(fs.rewrite_attempt_chars))
            while len(attempts) > 1 and not self._fits(conv):  # fewer attempts, then skip
                attempts.pop()
                conv = rewrite_conversation(parent.text, attempts, int(fs.rewrite_attempt_chars))
            if self._fits(conv):
                convs.append(conv)
            else:
                st["fast_slow_rewrite_too_long"] += 1.0
        r = fs.rewrite
        sp = episode.sampling_params(r, n=1, stop_token_ids=self.model.stop_token_ids,
                                     purpose="fast_slow.rewrite",
                                     seed_parts=(int(self.cfg.seed), int(r.seed), int(step)))
        replies = textgen.generate_replies(convs, sp) if convs else []
        out = []
        extra = tuple(getattr(self.model.tokenizer, "special_tokens", ()))
        for rs in replies:
            for rep in rs:
                st["fast_slow_rewrite_tokens"] += float(rep.num_tokens)
                text = sanitize_text(rep.text, 4000, extra, drop_thinking=True)
                text = _fit([ln for ln in text.splitlines() if ln.strip()],
                            self.model.count_tokens, int(fs.max_context_tokens))
                if text:
                    out.append(self._new(text, "rewrite", step))
        return out

    def _fits(self, conv: Messages) -> bool:
        """The rewrite prompt + its budget fit the sampler's context (rollout.max_context, else
        the model's), as ``build.build_sampler`` sizes it."""
        mc = getattr(self.model, "cfg", None)
        limit = int(self.cfg.rollout.max_context
                    or getattr(mc, "max_position_embeddings", 1 << 30))
        return len(self.model.encode_chat(conv)) + int(self.fs.rewrite.max_tokens) <= limit

    def _weights(self) -> np.ndarray:
        scored = [c for c in self.candidates if c.scores]
        if len(scored) < len(self.candidates) or not scored:
            return np.full(len(self.candidates), 1.0 / len(self.candidates))
        s = np.array([c.scores for c in self.candidates])
        w = (s >= s.max(axis=0)).sum(axis=1).astype(np.float64) + 1e-9
        return w / w.sum()

    def _score(self, step: int, todo: list[Candidate], textgen: TextGenerator,
               st: dict[str, float]) -> None:
        """Each candidate's mean reward per validation problem: ``fast_slow.val_samples``
        samples of every validation problem with the candidate in the prompt."""
        if not todo:
            return
        fs, task = self.fs, self.task
        probs = self.val_problems
        prefix = [response_prefix(task, p) for p in probs]
        prompts = [self.model.encode_prompt(with_context(task.prompt(p), c.text), pre)
                   for c in todo for p, pre in zip(probs, prefix, strict=True)]
        k = int(fs.val_samples)
        sp = episode.rollout_params(self.cfg, self.model, k, "fast_slow.val", int(step),
                                    max_tokens=int(fs.val_max_tokens) or None)
        att = episode.attempt(textgen.sampler, textgen, task, probs * len(todo), prompts, sp,
                              prefixes=prefix * len(todo))
        st["fast_slow_val_tokens"] += float(att.generated_tokens)
        rewards = att.grid(len(prompts), k, [float(x.reward) for x in att.results], np.float64)
        rewards = rewards.reshape(len(todo), len(probs), k)
        for c, sc in zip(todo, rewards.mean(axis=2), strict=True):
            c.scores = [float(x) for x in sc]

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "next_id": self.next_id,
                "candidates": [dataclasses.asdict(c) for c in self.candidates],
                "draws": {int(s): dict(d) for s, d in self.draws.items()},
                "val_ids": [str(p.id) for p in self.val_problems]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("version", -1)) != STATE_VERSION:
            raise ValueError(f"fast_slow pool state version {state.get('version')!r} != "
                             f"{STATE_VERSION}")
        ids = [str(p.id) for p in self.val_problems]
        if list(state["val_ids"]) != ids:
            raise ValueError("the checkpoint's fast_slow validation problems differ from this "
                             "run's (fast_slow.val_size, seed or task changed)")
        self.next_id = int(state["next_id"])
        self.candidates = [Candidate(**c) for c in state["candidates"]]
        self.draws = {int(s): {int(k): int(v) for k, v in d.items()}
                      for s, d in state["draws"].items()}


# ----------------------------------------------------------------------------- the trainer's
def validation_problems(cfg: RunConfig, model: Any, task: Any, train_problems: Sequence[Any],
                        eval_problems: Sequence[Any]) -> list[Any]:
    """``fast_slow.val_size`` training problems in a seeded order: none whose problem text is
    an evaluation problem's, none whose prompt with a full context would exceed
    rollout.max_prompt_tokens."""
    fs = cfg.fast_slow
    held_out = {user_text(task.prompt(p)) for p in eval_problems}
    room = int(cfg.rollout.max_prompt_tokens) - int(fs.max_context_tokens) - 8
    order = np.random.default_rng([int(cfg.seed) % (2**32), 0xF57, 0xFA]).permutation(
        len(train_problems))
    out = []
    for i in order:
        p = train_problems[int(i)]
        msgs = task.prompt(p)
        if user_text(msgs) in held_out:
            continue
        if len(model.encode_prompt(with_context(msgs, " "), response_prefix(task, p))) > room:
            continue
        out.append(p)
        if len(out) == int(fs.val_size):
            return out
    raise ValueError(f"fast_slow.val_size={fs.val_size}: only {len(out)} training problems are "
                     "outside the evaluation set and short enough for a context of "
                     f"fast_slow.max_context_tokens={fs.max_context_tokens}")


def build_pool(cfg: RunConfig, model: Any, task: Any, train_problems: Sequence[Any],
               eval_problems: Sequence[Any]) -> ContextPool:
    """The run's pool (mode=fast_slow; its hooks into the loop: ``fast_slow/mode.py``)."""

    if multihost.process_count() > 1:
        raise ValueError("mode=fast_slow is single-process only (the pool lives in one "
                         "process and the rollout prompts read it)")
    val = validation_problems(cfg, model, task, train_problems, eval_problems)
    log.info("fast_slow: %d validation problems, pool of at most %d contexts", len(val),
             cfg.fast_slow.pool_size)
    return ContextPool(cfg, model, task, val)
