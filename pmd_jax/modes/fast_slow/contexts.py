"""Fast-weight contexts as text: where a context goes in a prompt, how the memory is rendered
into one, and the reflective rewrite's conversation (GEPA-style, review Figure 1)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pmd_jax.memory.sanitize import resanitize
from pmd_jax.sampling.base import Messages

CONTEXT_HEADER = "\n\nGuidance:\n"
STRATEGIES = "What worked on earlier problems:"
LESSONS = "Mistakes to avoid:"
BEHAVIORS = "Useful habits:"
REWRITE_SYSTEM = ("You improve the guidance given to a problem solver. You see the current "
                  "guidance and attempts made with it, with their reward (1 = right) and "
                  "feedback.")
REWRITE_USER = ("Current guidance:\n{parent}\n\n{attempts}\n\nWrite improved guidance: keep "
                "what helped, fix what went wrong, stay general (no answers to these "
                "problems). Reply with the guidance only, at most a few short lines.")
ATTEMPT = "### Attempt {i}\nProblem: {problem}\nResponse: {response}\nReward: {reward:g}\n"


def with_context(messages: Messages, context: str) -> Messages:
    """The task's prompt with ``context`` at the end of its system message (a system message is
    added when there is none). FST / GEPA optimise the instruction the policy reads; the user
    turn (the problem) is left as it is."""
    out = [dict(m) for m in messages]
    if not context:
        return out
    for m in out:
        if m["role"] == "system":
            m["content"] = f"{m['content']}{CONTEXT_HEADER}{context}"
            return out
    return [{"role": "system", "content": CONTEXT_HEADER.lstrip() + context}, *out]


def fit_lines(lines: Sequence[str], count_tokens: Callable[[str], int], max_tokens: int) -> str:
    """The longest prefix of ``lines`` (joined by newlines) within ``max_tokens``; a first line
    alone over the budget is cut by characters."""
    out: list[str] = []
    for line in lines:
        if count_tokens("\n".join([*out, line])) > max_tokens:
            break
        out.append(line)
    if not out and lines:
        text = lines[0]
        lo, hi = 0, len(text)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count_tokens(text[:mid]) <= max_tokens:
                lo = mid
            else:
                hi = mid - 1
        return text[:lo].rstrip()
    return "\n".join(out).strip()


def memory_items(memory: Any) -> list[tuple[str, str, int]]:
    """Every insight and behavior of the memory as (kind, text, recency): the candidates of a
    rendering (behaviors first, then insights, newest and best supported first)."""

    toks = memory.extra_tokens
    out: list[tuple[str, str, int]] = []
    if memory.level("behavior").enabled:
        for b in memory.behaviors.behaviors.values():
            name, ins = resanitize(b.name, toks), resanitize(b.instruction, toks)
            if name and ins:
                out.append(("behavior", f"{name}: {ins}", int(b.created_step)))
    if memory.level("insight").enabled:
        items = sorted(memory.insights.items.values(),
                       key=lambda it: (-int(it.last_step), -int(it.support), it.docid))
        for it in items:
            text = resanitize(it.text, toks)
            if text:
                out.append((it.kind, text, int(it.last_step)))
    return out


def render_memory(memory: Any, rng: np.random.Generator, max_items: int,
                  count_tokens: Callable[[str], int], max_tokens: int) -> str:
    """One rendering of the memory's insight and behavior levels: ``max_items`` items drawn
    with ``rng`` from the newest ones (at most 4 x max_items candidates), grouped by kind and
    fitted to ``max_tokens``; "" when the levels are empty."""
    items = memory_items(memory)[: 4 * max_items]
    if not items:
        return ""
    pick = sorted(rng.permutation(len(items))[:max_items].tolist())
    chosen = [items[i] for i in pick]
    lines: list[str] = []
    for kind, header in (("strategy", STRATEGIES), ("lesson", LESSONS),
                         ("behavior", BEHAVIORS)):
        texts = [t for k, t, _ in chosen if k == kind]
        if texts:
            lines.append(header)
            lines.extend(f"- {t}" for t in texts)
    return fit_lines(lines, count_tokens, max_tokens)


def rewrite_conversation(parent: str, attempts: Sequence[tuple[str, str, float, str]],
                         max_chars: int) -> Messages:
    """The reflective rewrite of ``parent`` from attempts (problem, response, reward,
    feedback): GEPA's reflection over the rollouts' full text and feedback."""
    blocks = []
    for i, (problem, response, reward, feedback) in enumerate(attempts, 1):
        block = ATTEMPT.format(i=i, problem=problem[:max_chars].strip(),
                               response=response[:max_chars].strip(), reward=reward)
        if feedback:
            block += f"Feedback: {feedback[:max_chars].strip()}\n"
        blocks.append(block)
    return [{"role": "system", "content": REWRITE_SYSTEM},
            {"role": "user", "content": REWRITE_USER.format(parent=parent,
                                                             attempts="\n".join(blocks))}]
