"""MEL's host-side work of a step: pairs, structured reflections, replays, lesson rows.

See :mod:`pmd_jax.modes.mel` for the method and where it follows the paper. Nothing here raises on
model output: a malformed reflection is counted and skipped. The metrics of a step
(:data:`STAT_KEYS`, all logged every step, 0 when nothing happened) satisfy
``mel_reflections == mel_malformed + mel_lessons_kept + mel_lessons_dropped``.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pmd_jax import episode
from pmd_jax.distill.batch import make_lesson_rows
from pmd_jax.episode import user_text
from pmd_jax.memory import parsing, prompts
from pmd_jax.memory.schemas import mel_reflection_schema, schema_param, validate
from pmd_jax.sampling.base import Messages, SamplingParams

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig
    from pmd_jax.modes.mel.config import MelConfig

STAT_KEYS = (
    "mel_problems_mixed",  # problems with at least one right and one wrong rollout
    "mel_pairs_found",  # right x wrong pairs of the step, before the caps
    "mel_pairs",  # pairs reflected on (mel.max_pairs_per_problem, mel.max_pairs)
    "mel_reflect_too_long",  # pairs skipped: prompt + mel.reflection.max_tokens > context
    "mel_reflections",  # reflection calls made (one per pair that fits)
    "mel_malformed",  # no JSON object, not the schema, or an unusable lesson: skipped
    "mel_json_error", "mel_schema_error",  # the two main kinds of malformed
    "mel_reflect_truncated",  # replies cut at mel.reflection.max_tokens
    "mel_quote_missing",  # split_point not a span of the wrong rollout
    "mel_replay_too_long",  # lessons dropped: replay prompt + budget > context
    "mel_lessons_replayed",  # lessons sent to replay
    "mel_lessons_kept", "mel_lessons_dropped",  # kept: a replay was right (or replays=0)
    "mel_replays",  # replay samples generated
    "mel_replays_correct",
    "mel_reflect_tokens", "mel_replay_tokens",  # generated tokens (grid: generation spent)
    "mel_generated_tokens",
)


@dataclasses.dataclass
class Lesson:
    """A lesson written for pair (problem ``problem_index``: rollouts ``right``, ``wrong``)."""

    problem_index: int
    right: int
    wrong: int
    text: str
    quoted: bool = True  # its split_point is a span of the wrong rollout
    kept: bool = False


@dataclasses.dataclass
class StepLessons:
    """What MEL made of one step: every parsed lesson (``kept`` marks the kept ones) and
    the step's metrics."""

    lessons: list[Lesson]
    stats: dict[str, float]

    @property
    def kept(self) -> list[Lesson]:
        return [x for x in self.lessons if x.kept]


# ----------------------------------------------------------------------------- pairs
def find_pairs(rewards: np.ndarray, threshold: float, per_problem: int = 1,
               max_pairs: int = 0) -> tuple[list[tuple[int, int, int]], int, int]:
    """``(pairs, found, mixed)`` for rewards ``[B, G]``: pairs ``(problem, right, wrong)``
    (reward >= ``threshold`` vs below), per problem in order (1st right x 1st wrong, 2nd x
    2nd, ..., then the remaining combinations), at most ``per_problem`` per problem and
    ``max_pairs`` in all (0 = no cap); ``found`` counts every right x wrong pair, ``mixed``
    the problems with both."""
    rewards = np.asarray(rewards, np.float64)
    out: list[tuple[int, int, int]] = []
    found = mixed = 0
    for i in range(rewards.shape[0]):
        ok = rewards[i] >= threshold
        rights, wrongs = np.flatnonzero(ok).tolist(), np.flatnonzero(~ok).tolist()
        if not rights or not wrongs:
            continue
        mixed += 1
        found += len(rights) * len(wrongs)
        diag = [(rights[k], wrongs[k]) for k in range(min(len(rights), len(wrongs)))]
        rest = [(r, w) for r in rights for w in wrongs if (r, w) not in diag]
        mine = diag + rest
        if per_problem:
            mine = mine[:per_problem]
        out.extend((i, r, w) for r, w in mine)
    if max_pairs:
        out = out[:max_pairs]
    return out, found, mixed


# ----------------------------------------------------------------------------- reflection
def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + " [...]"


def reflection_messages(mel: MelConfig, problem: str, right: str, wrong: str) -> Messages:
    """The contrastive reflection conversation of one pair."""
    user = prompts.MEL_REFLECTION_USER.format(
        problem=problem, right=_cut(right, mel.max_attempt_chars),
        wrong=_cut(wrong, mel.max_attempt_chars), split_chars=mel.split_point_max_chars,
        critique_chars=mel.critique_max_chars, lesson_min=mel.lesson_min_chars,
        lesson_max=mel.lesson_max_chars)
    return [{"role": "system", "content": prompts.MEL_REFLECTION_SYSTEM},
            {"role": "user", "content": user}]


def quote_in(quote: str, text: str) -> bool:
    """``quote`` is a non-empty span of ``text`` (whitespace runs compared as one space)."""
    q = " ".join(quote.split())
    return bool(q) and q in " ".join(text.split())


def parse_reflection(reply: object, wrong: str, mel: MelConfig, counts: Counter,
                     extra_tokens: Sequence[str] = ()) -> tuple[str | None, bool]:
    """``(lesson, quoted)`` of one reply, or ``(None, False)`` when malformed (counted:
    ``json_error``, ``schema_error``, or the lesson unusable after sanitising)."""
    obj = parsing.extract_json_object(reply, counts)
    if obj is None:
        counts["malformed"] += 1
        return None, False
    if validate(obj, mel_reflection_schema(mel)):
        counts["schema_error"] += 1
        counts["malformed"] += 1
        return None, False
    lesson = parsing.clean_item(obj["lesson"], counts, max_chars=int(mel.lesson_max_chars),
                                min_chars=int(mel.lesson_min_chars), extra_tokens=extra_tokens)
    if lesson is None:
        counts["malformed"] += 1
        return None, False
    quoted = quote_in(obj["split_point"], wrong)
    if not quoted:
        counts["quote_missing"] += 1
    return lesson, quoted


def context_limit(cfg: RunConfig, model: Any) -> int:
    """Prompt + generation bound of the run's sampler (as ``build.build_sampler`` sizes it)."""
    mc = getattr(model, "cfg", None)
    return int(cfg.rollout.max_context or getattr(mc, "max_position_embeddings", 1 << 30))


def reflection_params(cfg: RunConfig, model: Any, step: int) -> SamplingParams:
    r, mel = cfg.mel.reflection, cfg.mel
    return episode.sampling_params(
        r, n=1, stop_token_ids=model.stop_token_ids, purpose="mel.reflection",
        seed_parts=(int(cfg.seed), int(r.seed), int(step)),
        json_schema=schema_param(mel_reflection_schema(mel)) if mel.structured_output else None)


def replay_params(cfg: RunConfig, model: Any, step: int) -> SamplingParams:
    mel = cfg.mel
    return episode.rollout_params(cfg, model, int(mel.replays), "mel.replay", int(step),
                                  temperature=float(mel.replay_temperature),
                                  max_tokens=int(mel.replay_max_tokens) or None)


def lesson_messages(task_messages: Messages, lesson: str) -> Messages:
    """The problem's prompt with the lesson after the problem (the replay's prompt)."""
    out = [dict(m) for m in task_messages]
    last = max(i for i, m in enumerate(out) if m["role"] == "user")
    out[last]["content"] = prompts.MEL_LESSON_TEMPLATE.format(problem=out[last]["content"],
                                                              lesson=lesson)
    return out


# ----------------------------------------------------------------------------- the step
def run_step(cfg: RunConfig, model: Any, task: Any, sampler: Any, sb: Any) -> StepLessons:
    """Reflections on the step's contrastive pairs and the replay filter, for the verified
    rollouts ``sb`` (a trainer StepBatch). ``sampler``: the run's (the policy), token level;
    ``model``: encode_chat / encode_prompt / decode / stop_token_ids / tokenizer."""
    mel, g = cfg.mel, int(cfg.rollout.n)
    thr = float(cfg.teacher_prompt.success_threshold)
    stats = {k: 0.0 for k in STAT_KEYS}
    pairs, found, mixed = find_pairs(sb.rewards, thr, int(mel.max_pairs_per_problem),
                                     int(mel.max_pairs))
    stats.update(mel_problems_mixed=float(mixed), mel_pairs_found=float(found),
                 mel_pairs=float(len(pairs)))
    extra = tuple(getattr(model.tokenizer, "special_tokens", ()) or ())
    counts: Counter = Counter()
    lessons: list[Lesson] = []
    t0 = time.perf_counter()
    limit = context_limit(cfg, model)
    rp = reflection_params(cfg, model, sb.step)
    ids = [model.encode_chat(reflection_messages(
        mel, user_text(sb.messages[i]), sb.texts[i * g + r], sb.texts[i * g + w]))
        for i, r, w in pairs]
    fits = [len(x) + rp.max_tokens <= limit for x in ids]
    stats["mel_reflect_too_long"] = float(len(pairs) - sum(fits))
    pairs = [pr for pr, ok in zip(pairs, fits, strict=True) if ok]
    ids = [x for x, ok in zip(ids, fits, strict=True) if ok]
    if pairs:
        rollouts = episode.generate(sampler, ids, rp)
        first: dict[int, Any] = {}
        for ro in rollouts:
            first.setdefault(ro.prompt_index, ro)
            stats["mel_reflect_tokens"] += len(ro.tokens)
        for k, (i, r, w) in enumerate(pairs):
            ro = first.get(k)
            if ro is not None and ro.finish_reason == "length":
                counts["truncated"] += 1
            reply = model.decode(ro.tokens.tolist()) if ro is not None else None
            wrong = sb.texts[i * g + w]
            text, quoted = parse_reflection(reply, wrong, mel, counts, extra)
            if text is not None:
                lessons.append(Lesson(i, r, w, text, quoted))
    stats["time_mel_reflect"] = time.perf_counter() - t0
    stats.update(mel_reflections=float(len(pairs)), mel_malformed=float(counts["malformed"]),
                 mel_json_error=float(counts["json_error"]),
                 mel_schema_error=float(counts["schema_error"]),
                 mel_reflect_truncated=float(counts["truncated"]),
                 mel_quote_missing=float(counts["quote_missing"]))
    t0 = time.perf_counter()
    todo = [x for x in lessons if x.quoted or mel.keep_unquoted]
    if int(mel.replays) == 0:
        for x in todo:
            x.kept = True
    elif todo:
        _replay(cfg, model, task, sampler, sb, todo, limit, stats)
    stats["time_mel_replay"] = time.perf_counter() - t0
    kept = sum(x.kept for x in lessons)
    stats["mel_lessons_kept"] = float(kept)
    stats["mel_lessons_dropped"] = float(len(lessons) - kept)
    stats["mel_generated_tokens"] = stats["mel_reflect_tokens"] + stats["mel_replay_tokens"]
    return StepLessons(lessons, stats)


def _replay(cfg: RunConfig, model: Any, task: Any, sampler: Any, sb: Any, todo: list[Lesson],
            limit: int, stats: dict[str, float]) -> None:
    """``mel.replays`` samples of each lesson's problem with the lesson in its prompt,
    verified like rollouts; marks the lessons with a right sample ``kept``."""
    thr = float(cfg.teacher_prompt.success_threshold)
    pp = replay_params(cfg, model, sb.step)
    probs = [sb.problems[x.problem_index] for x in todo]
    prefixes = [episode.response_prefix(task, p) for p in probs]
    ids = [model.encode_prompt(lesson_messages(sb.messages[x.problem_index], x.text), pre)
           for x, pre in zip(todo, prefixes, strict=True)]
    fits = [len(x) + pp.max_tokens <= limit for x in ids]
    stats["mel_replay_too_long"] = float(len(todo) - sum(fits))
    todo, probs, prefixes, ids = ([v for v, ok in zip(seq, fits, strict=True) if ok]
                                  for seq in (todo, probs, prefixes, ids))
    if not todo:
        return
    att = episode.attempt(sampler, model, task, probs, ids, pp, prefixes=prefixes)
    stats["mel_replay_tokens"] += att.generated_tokens
    for ro, ok in zip(att.rollouts, att.solved(thr), strict=True):
        if ok:
            stats["mel_replays_correct"] += 1
            todo[ro.prompt_index].kept = True
    stats["mel_replays"] = float(att.sequences)
    stats["mel_lessons_replayed"] = float(len(todo))


def lesson_rows(cfg: RunConfig, model: Any, task: Any, sb: Any, lessons: Sequence[Lesson],
                row_multiple: int = 1) -> dict[str, np.ndarray]:
    """The kept lessons as the train batch's lesson arrays (``distill.batch.LESSON_KEYS``):
    each the problem's chat prompt (generation prompt, no response prefix) followed by the
    lesson's tokens (at most ``mel.lesson_max_tokens``). ``L`` is ``row_multiple`` (the mesh's
    batch axes) x the next power of two >= the lessons, so a run compiles few shapes."""

    prompts_ = [model.encode_chat(sb.messages[x.problem_index]) for x in lessons]
    toks = [model.tokenizer.encode(x.text)[: int(cfg.mel.lesson_max_tokens)] for x in lessons]
    m = max(1, int(row_multiple))
    rows = m
    while rows < len(lessons):
        rows *= 2
    return make_lesson_rows(prompts_, toks, pad_id=model.pad_id, rows=rows)
