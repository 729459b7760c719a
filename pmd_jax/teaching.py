"""The teacher side of a step: from the verified rollouts to the train batch.

After the rollouts are verified (``Trainer.verify``) the loop calls, in order:

1. :func:`update_memory`: the rollouts as memory records, one memory update (its reflections
   generate through the sampler); returns the memory's metrics.
2. :func:`build_train_batch`: each rollout's teacher context (:func:`build_teacher_contexts`:
   the demonstration chosen by :func:`select_demonstrations`, the verifier's feedback, the
   memory's sections), rendered into the teacher's prompt (:func:`teacher_messages`), aligned
   with the student's prompt and the response (``distill.align``) into the host-side batch the
   train step takes (``distill.batch.make_batch``).

Nothing numeric happens here beyond host-side bookkeeping.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pmd_jax.distill.update_rows import round_up
from pmd_jax.sampling.base import Messages, TextGenerator


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


def teacher_messages(student_messages: Messages, user_text: str) -> Messages:
    """The teacher conversation: system messages kept, the user turn replaced (SDPO 1.5)."""
    out = [dict(m) for m in student_messages if m["role"] == "system"]
    out.append({"role": "user", "content": user_text})
    return out


# ----------------------------------------------------------------------------- memory update
def update_memory(cfg: Any, memory: Any, step: int, sb: Any, task: Any,
                  textgen: TextGenerator) -> dict[str, Any]:
    """One memory update from step ``step``'s verified rollouts ``sb`` (a trainer StepBatch);
    returns the memory's metrics (``reflect_seconds``: time spent generating)."""
    from pmd_jax.memory.types import RolloutRecord

    records = []
    for r, text, res in zip(sb.rollouts, sb.texts, sb.results, strict=True):
        p = sb.problems[r.prompt_index]
        records.append(RolloutRecord(
            problem_id=str(p.id), problem_text=user_text(task.prompt(p)), step=int(step),
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


def build_teacher_contexts(cfg: Any, model: Any, task: Any, memory: Any,
                           sb: Any) -> list[Any]:
    """One TeacherContext per rollout (prompt-major), following the mode's rules."""
    from pmd_jax.memory.context import TeacherContext
    from pmd_jax.memory.sanitize import sanitize_text

    tp = cfg.teacher_prompt
    limits = cfg.memory.context  # the memory's own limits apply to SDPO's reprompt too
    g = cfg.rollout.n
    demos = select_demonstrations(sb.rewards, tp.success_threshold,
                                  tp.dont_reprompt_on_self_success)
    extra = tuple(model.tokenizer.special_tokens)
    out = []
    for idx, r in enumerate(sb.rollouts):
        i, j = r.prompt_index, r.sample_index
        p = sb.problems[i]
        user = user_text(task.prompt(p))
        d = demos[i, j]
        sibling = sb.texts[i * g + d] if d >= 0 else None
        fb = sb.results[idx].feedback if tp.include_feedback else None
        if fb and tp.feedback_only_without_solution and sibling:
            fb = None
        if memory is not None:
            ctx = memory.teacher_context(str(p.id), user, sibling, fb,
                                         student_response=sb.texts[idx])
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
    return out


# ----------------------------------------------------------------------------- train batch
def build_train_batch(cfg: Any, model: Any, task: Any, memory: Any, sb: Any, *,
                      student_only: bool = False) -> tuple[dict[str, np.ndarray],
                                                           dict[str, float]]:
    """The host-side train batch of a step's rollouts (``distill.batch.make_batch``'s keys,
    right padded) and the teacher prompts' metrics. ``student_only``: the teacher side is the
    student's own prompt (GRPO's batch; what the KL to the initial policy reads)."""
    from pmd_jax.distill import align
    from pmd_jax.distill.batch import make_batch

    responses = [r.tokens.tolist() for r in sb.rollouts]
    students = [sb.student_prompts[r.prompt_index] for r in sb.rollouts]
    sampler_logp = [r.logprobs for r in sb.rollouts]
    stats: dict[str, float] = {}
    # no teacher (mel's lesson rows: pmd_jax/mel; fast_slow's student prompts carry the context)
    if student_only or cfg.mode in ("grpo", "mel", "fast_slow"):
        teachers = students
        sd = np.ones(len(responses), np.float32)
    else:
        ctxs = build_teacher_contexts(cfg, model, task, memory, sb)
        budget = int(min(cfg.teacher_prompt.max_tokens, cfg.memory.context.max_tokens)
                     if memory is not None else cfg.teacher_prompt.max_tokens)
        teachers, sd = [], np.zeros(len(responses), np.float32)
        src = {"sibling": 0, "memory": 0}
        for k, (ctx, r) in enumerate(zip(ctxs, sb.rollouts, strict=True)):
            text = ctx.render(model.count_tokens, budget)
            prob = sb.problems[r.prompt_index]
            msgs = teacher_messages(task.prompt(prob), text)
            teachers.append(model.encode_prompt(msgs, response_prefix(task, prob)))
            sd[k] = float(ctx.has_signal)
            if ctx.successful_attempt_source in src:
                src[ctx.successful_attempt_source] += 1
        n = max(1, len(ctxs))
        stats = {
            "reprompt_sample_fraction": float(sd.mean()),
            "demo_from_sibling_fraction": src["sibling"] / n,
            "demo_from_memory_fraction": src["memory"] / n,
            "teacher_prompt_tokens_mean": float(np.mean([len(t) for t in teachers])),
        }
    r_max = max(1, max(len(x) for x in responses))
    db = align.build_distill_batch(
        students, teachers, responses, pad_id=model.pad_id, pad_side="right",
        pad_to_multiple=16, max_response_len=round_up(r_max, 16),
    )
    rl = db.responses.shape[1]
    logp = np.zeros((len(responses), rl), np.float32)
    for k, lp in enumerate(sampler_logp):
        logp[k, : len(lp)] = lp
    # One update per rollout batch (METHOD 1.3): the old policy is the current one, so no
    # old_logp (the step takes logp.detach(), ratio 1); the sampler/trainer gap is corrected
    # by the truncated rollout IS weights from sampler_logp alone (passing the sampler's
    # log-probs as old_logp too would apply that ratio twice).
    batch = make_batch(db, sd_mask=sd, sampler_logp=logp,
                       rewards=sb.rewards.reshape(-1).astype(np.float32))
    stats["student_tokens_mean"] = float(np.mean([len(s) + len(x)
                                                  for s, x in zip(students, responses,
                                                                  strict=True)]))
    return batch, stats
