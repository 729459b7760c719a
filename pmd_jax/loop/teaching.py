"""The teacher side of a step: from the verified rollouts to the train batch.

After the rollouts are verified (``Trainer.verify``) the loop calls, in order:

1. :func:`update_memory`: the rollouts as memory records, one memory update (its reflections
   generate through the sampler); returns the memory's metrics.
2. :func:`train_rows`: each rollout's teacher context (:func:`build_teacher_contexts`:
   the demonstration chosen by :func:`select_demonstrations`, the verifier's feedback, the
   memory's sections), rendered into the teacher's prompt (:func:`teacher_messages`), beside
   the student's prompt and the response: the update rows, which ``distill.assemble`` turns
   into the host-side batch the train step takes.

Nothing numeric happens here beyond host-side bookkeeping.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pmd_jax import episode
from pmd_jax.distill.assemble import TrainRows, assemble, fixed_lengths
from pmd_jax.episode import response_prefix, user_text
from pmd_jax.memory.context import TeacherContext
from pmd_jax.memory.sanitize import sanitize_text
from pmd_jax.memory.types import RolloutRecord
from pmd_jax.memory.verify import JOINT, Proposal, check_before_use
from pmd_jax.modes import get_mode
from pmd_jax.sampling.base import Messages, TextGenerator

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig


# ----------------------------------------------------------------------------- prompts
def teacher_messages(student_messages: Messages, user_text: str) -> Messages:
    """The teacher conversation: system messages kept, the user turn replaced (SDPO 1.5)."""
    out = [dict(m) for m in student_messages if m["role"] == "system"]
    out.append({"role": "user", "content": user_text})
    return out


# ----------------------------------------------------------------------------- memory update
def update_memory(cfg: RunConfig, memory: Any, step: int, sb: Any, task: Any,
                  textgen: TextGenerator) -> dict[str, Any]:
    """One memory update from step ``step``'s verified rollouts ``sb`` (a trainer StepBatch);
    returns the memory's metrics (``reflect_seconds``: time spent generating)."""

    records = []
    for r, text, res in zip(sb.rollouts, sb.texts, sb.results, strict=True):
        p = sb.problems[r.prompt_index]
        records.append(RolloutRecord(
            problem_id=str(p.id), problem_text=user_text(sb.messages[r.prompt_index]),
            step=int(step),
            rollout_index=int(r.sample_index), response_text=text, reward=float(res.reward),
            feedback=res.feedback or "", leak_strings=list(task.gold_leak_strings(p)),
        ))
    st = memory.update(step, records, textgen)
    out: dict[str, Any] = {"reflect_seconds": st.seconds.get("generation", 0.0),
                           "memory_frozen": float(st.frozen)}
    for k, v in st.counts.items():
        out[f"memory_{k}"] = float(v)
    s = memory.stats()
    out["memory_experiences"] = float(s.get("experience_records", 0))
    out["memory_insights"] = float(s.get("strategies", 0) + s.get("lessons", 0))
    out["memory_behaviors"] = float(s.get("behaviors", 0))
    for k in ("strategies", "lessons", "clusters"):  # the levels' parts, for the size plot
        out[f"memory_{k}"] = float(s.get(k, 0))
    return out


# ----------------------------------------------------------------------------- teacher contexts
def select_demonstrations(
    rewards: np.ndarray, threshold: float, exclude_self: bool = True
) -> np.ndarray:
    """For rewards [B, G], the index of the demonstration each rollout's teacher sees, or -1.

    The demonstration is the first successful rollout (reward >= threshold) of the same group;
    with ``exclude_self`` a rollout never gets its own attempt (SDPO's
    ``dont_reprompt_on_self_success``), so a lone success gets -1.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [groups, rollouts], got shape {rewards.shape}")
    success = rewards >= threshold
    b, g = rewards.shape
    out = np.full((b, g), -1, dtype=np.int64)
    for i in range(b):
        wins = np.flatnonzero(success[i])
        for j in range(g):
            cands = wins[wins != j] if exclude_self else wins
            if cands.size:
                out[i, j] = int(cands[0])
    return out


def build_teacher_contexts(cfg: RunConfig, model: Any, task: Any, memory: Any,
                           sb: Any, sampler: Any = None,
                           stats: dict[str, float] | None = None) -> list[Any]:
    """One TeacherContext per rollout (prompt-major), following the mode's rules. With
    ``memory.verify.enabled`` the memory items go through the check before use
    (:func:`check_memory`, replays through ``sampler``) and only admitted ones stay;
    ``stats`` receives the check's counts and costs."""

    tp = cfg.teacher_prompt
    limits = cfg.memory.context  # the memory's own limits apply to SDPO's reprompt too
    g = cfg.rollout.n
    demos = select_demonstrations(sb.rewards, tp.success_threshold,
                                  tp.dont_reprompt_on_self_success)
    extra = tuple(model.tokenizer.special_tokens)
    spare: list[str | None] = [None] * len(sb.problems)
    if int(tp.extra_demo_samples) > 0:
        if sampler is None:
            raise ValueError("teacher_prompt.extra_demo_samples needs a sampler")
        spare, spare_stats = extra_demonstrations(cfg, model, task, sb, sampler)
        if stats is not None:
            stats.update(spare_stats)
    out = []
    for idx, r in enumerate(sb.rollouts):
        i, j = r.prompt_index, r.sample_index
        p = sb.problems[i]
        user = user_text(sb.messages[i])
        d = demos[i, j]
        sibling = sb.texts[i * g + d] if d >= 0 else spare[i]
        fb = sb.results[idx].feedback if tp.include_feedback else None
        if fb and tp.feedback_only_without_solution and sibling:
            fb = None
        if memory is not None:
            ctx = memory.teacher_context(str(p.id), user, sibling, fb,
                                         student_response=sb.texts[idx], step=int(sb.step))
        else:  # sdpo: the reprompt template with only the demonstration and feedback
            succ = (sanitize_text(sibling, int(limits.max_attempt_chars), extra,
                                  drop_thinking=True) if sibling else None)
            ctx = TeacherContext(
                problem_text=user, successful_attempt=succ or None,
                successful_attempt_source="sibling" if succ else None,
                feedback=(sanitize_text(fb, int(limits.max_feedback_chars), extra)
                          if fb else None),
                signal_rule="sdpo", max_tokens=int(tp.max_tokens),
            )
        out.append(ctx)
    if memory is not None and memory.config.verify.enabled:
        if sampler is None:
            raise ValueError("memory.verify.enabled needs a sampler for the replays")
        counts = check_memory(cfg, model, task, memory, sb, out, sampler)
        if stats is not None:
            stats.update(counts)
    return out


def extra_demonstrations(cfg: RunConfig, model: Any, task: Any, sb: Any, sampler: Any
                         ) -> tuple[list[str | None], dict[str, float]]:
    """``teacher_prompt.extra_demo_samples`` more samples of each problem's student prompt
    (verified, not trained on): each problem's first success, or None; and their costs."""
    tp = cfg.teacher_prompt
    params = episode.rollout_params(cfg, model, int(tp.extra_demo_samples), "extra_demos",
                                    int(sb.step))
    att = episode.attempt(sampler, model, task, sb.problems, sb.student_prompts, params)
    found: list[str | None] = [None] * len(sb.problems)
    for ro, text, ok in zip(att.rollouts, att.texts, att.solved(tp.success_threshold),
                            strict=True):
        if found[ro.prompt_index] is None and ok:
            found[ro.prompt_index] = text
    return found, {
        "extra_demo_sequences": float(att.sequences),
        "extra_demo_generated_tokens": float(att.generated_tokens),
        "extra_demo_prompt_tokens": float(att.prompt_tokens),
        "extra_demo_found_fraction": float(np.mean([f is not None for f in found])),
    }


# ----------------------------------------------------------------------------- check before use
def memory_prompt(cfg: RunConfig, model: Any, task: Any, problem: Any, messages: Messages,
                  items: Sequence[tuple[str, Any]] = (), successful_attempt: str | None = None
                  ) -> list[int]:
    """The prompt tokens of an attempt at ``problem`` with memory text in its prompt: the
    teacher's reprompt template (the problem, then ``items``, each ``(section, value)`` of a
    list section such as ``("lessons", text)`` or ``("behaviors", (name, instruction))``, and
    ``successful_attempt`` under "Correct solution:"), cut to the teacher's token budget, as
    the user turn of the task's conversation ``messages``, with the task's response prefix.
    The check's replays and the memory probe (pmd_jax/probe) attempt problems this way; with
    no items it is SDPO's reprompt without a demonstration."""

    ctx = TeacherContext(problem_text=user_text(messages), signal_rule="sdpo",
                         truncation_order=tuple(cfg.memory.context.truncation_order),
                         successful_attempt=successful_attempt or None)
    for k, (section, value) in enumerate(items):
        ctx.add_item(section, value, f"item{k}")
    budget = int(min(cfg.teacher_prompt.max_tokens, cfg.memory.context.max_tokens))
    msgs = teacher_messages(messages, ctx.render(model.count_tokens, budget))
    return model.encode_prompt(msgs, response_prefix(task, problem))


def check_memory(cfg: RunConfig, model: Any, task: Any, memory: Any, sb: Any, ctxs: list[Any],
                 sampler: Any) -> dict[str, float]:
    """The check before use (memory/verify.py) on this step's teacher contexts: the items
    proposed for each problem are tested by paired replays where due, then every context
    keeps only admitted items. The replays are also attempts at the problem, graded by the
    verifier: with ``memory.verify.replays_as_demonstrations`` a row shown no success (no
    sibling's, no remembered one) is shown its problem's first successful replay, as SDPO
    shows a sibling's: a baseline arm's, else one from the arm of an item the check admitted
    (an item arm's replay of an item not admitted is never shown: its text would reach the
    teacher through the door the check closes). Returns the step's counts and costs
    (``verify_*``)."""

    g = cfg.rollout.n
    nprob = len(sb.problems)
    props: list[list[Proposal]] = [[] for _ in range(nprob)]
    seen: list[set[str]] = [set() for _ in range(nprob)]
    levels = {"strategies": "insight", "lessons": "insight", "behaviors": "behavior"}
    for idx, ctx in enumerate(ctxs):
        i = idx // g
        for section, keys in ctx.item_keys.items():
            for key, value in zip(keys, ctx.section(section), strict=True):
                if key not in seen[i]:
                    seen[i].add(key)
                    props[i].append(Proposal(key, levels.get(section, section), section,
                                             value))
    cost = {"verify_sequences": 0, "verify_generated_tokens": 0, "verify_prompt_tokens": 0}
    params = episode.rollout_params(cfg, model, int(cfg.memory.verify.replays), "verify",
                                    int(cfg.memory.verify.seed), int(sb.step))
    found: dict[int, str] = {}  # problem index -> its first successful baseline replay's text
    # (problem index, section, item) -> the first success of that item's arm: shown only if
    # the check admits the item (an item the check has not admitted reaches no teacher, not
    # even through a replay its text produced)
    item_found: dict[tuple[int, str, Any], str] = {}

    def run_arms(arms: list[Any]) -> list[list[tuple[bool, bool]]]:
        prompts, probs = [], []
        for i, section, value in arms:
            prob = sb.problems[i]
            # an item alone, several shown together (JOINT: level_sequential), or none
            items = (list(value) if section == JOINT
                     else [(section, value)] if section is not None else [])
            prompts.append(memory_prompt(cfg, model, task, prob, sb.messages[i], items))
            probs.append(prob)
        att = episode.attempt(sampler, model, task, probs, prompts, params)
        cost["verify_prompt_tokens"] += att.prompt_tokens
        cost["verify_sequences"] += att.sequences
        cost["verify_generated_tokens"] += att.generated_tokens
        out: list[list[tuple[bool, bool]]] = [[] for _ in arms]
        thr = float(cfg.teacher_prompt.success_threshold)
        for ro, text, res in zip(att.rollouts, att.texts, att.results, strict=True):
            ok = float(res.reward) >= thr
            out[ro.prompt_index].append((ok, bool(res.ok)))
            if ok:
                i, section, value = arms[ro.prompt_index]
                if section is None:
                    found.setdefault(i, text)
                else:
                    item_found.setdefault((i, section, value), text)
        return out

    t0 = time.perf_counter()
    counts = check_before_use(memory.evidence, int(sb.step), [str(p.id) for p in sb.problems],
                              props, run_arms)
    seconds = time.perf_counter() - t0
    proposed = sum(len(x) for x in props)
    for ctx in ctxs:
        ctx.keep_items(memory.evidence.visible)
    for i, items in enumerate(props):  # a baseline's success first, then an admitted item's
        for prop in items:
            text = item_found.get((i, prop.section, prop.value))
            if text and i not in found and memory.evidence.visible(prop.key):
                found[i] = text
    for (i, section, value), text in item_found.items():  # then a joint arm's, all shown
        if section == JOINT and i not in found:
            keys = [p.key for p in props[i] if (p.section, p.value) in value]
            if keys and all(memory.evidence.visible(k) for k in keys):
                found[i] = text
    demos = 0
    if cfg.memory.verify.replays_as_demonstrations:
        cx = cfg.memory.context
        for idx, ctx in enumerate(ctxs):
            text = found.get(idx // g)
            if text and not ctx.successful_attempt:
                succ = sanitize_text(text, int(cx.max_attempt_chars), memory.extra_tokens,
                                     drop_thinking=bool(cx.strip_thinking))
                if succ:
                    ctx.successful_attempt, ctx.successful_attempt_source = succ, "replay"
                    demos += 1
    state = memory.evidence.counts()
    out: dict[str, float] = {f"verify_items_{k}": float(v) for k, v in counts.items()
                             if k not in ("calls", "arms")}
    out.update({k: float(v) for k, v in cost.items()})
    out.update(verify_demo_row_fraction=demos / max(1, len(ctxs)),
               verify_problems_with_a_replay_success=float(len(found)),
               verify_generate_calls=float(counts["calls"]), verify_arms=float(counts["arms"]),
               verify_items_proposed=float(proposed), time_verify_replays=seconds,
               verify_token_forwards=float(cost["verify_prompt_tokens"]
                                           + cost["verify_generated_tokens"]),
               **{f"verify_memory_{k}": float(v) for k, v in state.items()})
    return out


# ----------------------------------------------------------------------------- train batch
def build_train_batch(cfg: RunConfig, model: Any, task: Any, memory: Any, sb: Any, *,
                      student_only: bool = False, sampler: Any = None
                      ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """:func:`train_rows` assembled into the host-side arrays (``distill.assemble``), with
    every row: what the KL to the initial policy reads (the update's own batch comes from
    ``distill.assemble.update_batch``)."""
    rows, stats = train_rows(cfg, model, task, memory, sb, student_only=student_only,
                             sampler=sampler)
    return assemble(rows, model.pad_id, lengths=fixed_lengths(cfg)), stats


def train_rows(cfg: RunConfig, model: Any, task: Any, memory: Any, sb: Any, *,
               student_only: bool = False, sampler: Any = None
               ) -> tuple[TrainRows, dict[str, float]]:
    """A step's rollouts as update rows (``distill.assemble.TrainRows``: each side's prompt,
    the response, the sampler's log-probs, the teacher signal, the reward) and the teacher
    prompts' metrics. ``student_only``: the teacher side is the student's own prompt (GRPO's
    batch; what the KL to the initial policy reads). ``sampler``: for the memory's check
    before use (``memory.verify.enabled``).

    A row's teacher signal (the self-distillation mask) is read from its context *after* the
    token budget has cut it: a row whose memory items were all cut keeps a signal only if its
    demonstration or feedback survived."""
    responses = [r.tokens.tolist() for r in sb.rollouts]
    students = [sb.student_prompts[r.prompt_index] for r in sb.rollouts]
    sampler_logp = [r.logprobs for r in sb.rollouts]
    stats: dict[str, float] = {}
    # no teacher (mel's lesson rows: pmd_jax/modes/mel; fast_slow's student prompts carry the
    # context)
    if student_only or not get_mode(cfg.mode).has_teacher:
        teachers = students
        sd = np.ones(len(responses), np.float32)
    else:
        ctxs = build_teacher_contexts(cfg, model, task, memory, sb, sampler, stats)
        budget = int(min(cfg.teacher_prompt.max_tokens, cfg.memory.context.max_tokens)
                     if memory is not None else cfg.teacher_prompt.max_tokens)
        teachers, sd = [], np.zeros(len(responses), np.float32)
        src = {"sibling": 0, "memory": 0, "replay": 0}
        with_items = memory_only = 0
        for k, (ctx, r) in enumerate(zip(ctxs, sb.rollouts, strict=True)):
            fitted = ctx.fit(model.count_tokens, budget)
            prob = sb.problems[r.prompt_index]
            msgs = teacher_messages(sb.messages[r.prompt_index], fitted.text())
            teachers.append(model.encode_prompt(msgs, response_prefix(task, prob)))
            sd[k] = float(fitted.has_signal)
            if fitted.successful_attempt_source in src:
                src[fitted.successful_attempt_source] += 1
            items = fitted.memory_items() > 0
            with_items += items
            memory_only += items and fitted.has_signal and not (
                fitted.successful_attempt or fitted.feedback)
        n = max(1, len(ctxs))
        stats.update({
            "reprompt_sample_fraction": float(sd.mean()),
            "demo_from_sibling_fraction": src["sibling"] / n,
            "demo_from_memory_fraction": src["memory"] / n,
            "demo_from_replay_fraction": src["replay"] / n,
            "teacher_prompt_tokens_mean": float(np.mean([len(t) for t in teachers])),
            # rows whose teacher context holds memory items (written at earlier steps, with
            # memory.context.previous_steps_only), and those whose signal is the memory alone
            "memory_item_row_fraction": with_items / n,
            "memory_signal_row_fraction": memory_only / n,
        })
    stats["student_tokens_mean"] = float(np.mean([len(s) + len(x)
                                                  for s, x in zip(students, responses,
                                                                  strict=True)]))
    return TrainRows(students, teachers, responses, sampler_logp, sd,
                     sb.rewards.reshape(-1).astype(np.float32)), stats
