"""The teacher's user message: PMD's extension of SDPO's reprompt (METHOD.md 1.5, 2.1).

Order: problem, strategies, lessons, numbered behaviors ("name: instruction"), "Correct
solution:" block, feedback block, "Correctly solve the original question." With no memory
content the text equals SDPO's ``{prompt}{solution}{feedback}\\n\\nCorrectly solve ...``.

Token budget: ``render(count_tokens, max_tokens)`` cuts parts in ``truncation_order`` (default:
behaviors, lessons, strategies, feedback, successful attempt). List parts lose their last
(lowest-ranked / newest-added) item one at a time until the text fits or the list is empty;
text parts are cut to the longest prefix that fits (binary search) or dropped. The problem
text and the closing instruction are never cut; if they alone exceed the budget the result is
over budget and ``fit`` reports it (``over_budget``), leaving the caller's right truncation
to act, as SDPO does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from pmd_jax.memory import prompts

CountTokens = Callable[[str], int]
DEFAULT_ORDER = ("behaviors", "lessons", "strategies", "feedback", "successful_attempt")


@dataclasses.dataclass
class TeacherContext:
    problem_text: str
    strategies: list[str] = dataclasses.field(default_factory=list)
    lessons: list[str] = dataclasses.field(default_factory=list)
    behaviors: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    successful_attempt: str | None = None
    successful_attempt_source: str | None = None  # "sibling" | "memory" | None
    feedback: str | None = None
    # Provenance (JSON dicts) of the memory items shown, for logging and audits.
    provenance: list[dict] = dataclasses.field(default_factory=list)
    signal_rule: str = "any"
    truncation_order: Sequence[str] = DEFAULT_ORDER
    max_tokens: int | None = None
    inverted: bool = False  # control mode "inverted_lessons": headers swapped
    over_budget: bool = False

    @property
    def has_signal(self) -> bool:
        """Whether the SDPO self-distillation mask should be 1 for this sample."""
        sdpo = bool(self.successful_attempt) or bool(self.feedback)
        if self.signal_rule == "sdpo":
            return sdpo
        return sdpo or bool(self.strategies or self.lessons or self.behaviors)

    def text(self) -> str:
        """The full text, without any budget."""
        s_items, l_items = self.strategies, self.lessons
        if self.inverted:
            s_items, l_items = l_items, s_items
        out = [self.problem_text]
        if s_items:
            out.append(prompts.TEACHER_STRATEGIES_TEMPLATE.format(items="\n".join(
                prompts.TEACHER_LIST_ITEM.format(text=t) for t in s_items)))
        if l_items:
            out.append(prompts.TEACHER_LESSONS_TEMPLATE.format(items="\n".join(
                prompts.TEACHER_LIST_ITEM.format(text=t) for t in l_items)))
        if self.behaviors:
            out.append(prompts.TEACHER_BEHAVIORS_TEMPLATE.format(items="\n".join(
                prompts.TEACHER_BEHAVIOR_ITEM.format(index=i, name=n, instruction=ins)
                for i, (n, ins) in enumerate(self.behaviors, 1))))
        if self.successful_attempt:
            out.append(prompts.TEACHER_SOLUTION_TEMPLATE.format(
                successful_previous_attempt=self.successful_attempt))
        if self.feedback:
            out.append(prompts.TEACHER_FEEDBACK_TEMPLATE.format(feedback_raw=self.feedback))
        out.append(prompts.TEACHER_INSTRUCTION)
        return "".join(out)

    def fit(self, count_tokens: CountTokens, max_tokens: int) -> TeacherContext:
        """A copy cut to ``max_tokens`` tokens under ``count_tokens`` (see module doc)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        ctx = dataclasses.replace(self, strategies=list(self.strategies),
                                  lessons=list(self.lessons), behaviors=list(self.behaviors),
                                  over_budget=False)

        def fits() -> bool:
            return count_tokens(ctx.text()) <= max_tokens

        if fits():
            return ctx
        for part in self.truncation_order:
            if part in ("behaviors", "lessons", "strategies"):
                items = getattr(ctx, part)
                while items and not fits():
                    items.pop()
            elif part in ("feedback", "successful_attempt"):
                full = getattr(ctx, part)
                if not full:
                    continue
                setattr(ctx, part, None)
                if not fits():
                    continue  # even without it the text is too long: leave it out
                lo, hi = 0, len(full)  # longest prefix length that fits, by binary search
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    setattr(ctx, part, full[:mid])
                    if fits():
                        lo = mid
                    else:
                        hi = mid - 1
                setattr(ctx, part, full[:lo].rstrip() or None)
            else:
                raise ValueError(f"unknown truncation part {part!r}")
            if fits():
                return ctx
        ctx.over_budget = not fits()
        return ctx

    def render(self, count_tokens: CountTokens | None = None,
               max_tokens: int | None = None) -> str:
        """The teacher user-message text, within the budget when ``count_tokens`` is given."""
        budget = max_tokens if max_tokens is not None else self.max_tokens
        if count_tokens is None or budget is None:
            return self.text()
        return self.fit(count_tokens, budget).text()
