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

Sections are keyed by level (issue 16): :data:`SECTIONS` lists every part between the problem
and the closing instruction in text order, each with the memory level that fills it (``None``:
the trainer's feedback), its kind (``"list"`` or ``"text"``, how the budget cuts it) and its
renderer. A new level adds its own part with :func:`register_section`; its value lives in
``TeacherContext.extra`` (the built-in parts keep their fields).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pmd_jax.memory import prompts

CountTokens = Callable[[str], int]
DEFAULT_ORDER = ("behaviors", "lessons", "strategies", "feedback", "successful_attempt")


@dataclasses.dataclass(frozen=True)
class ContextSection:
    """One part of the teacher text between the problem and the closing instruction."""

    name: str  # TeacherContext attribute (or ``extra`` key); a memory.context.truncation_order part
    level: str | None  # the memory level that fills it; None: not memory (the trainer's feedback)
    kind: str  # "list": the budget drops its last items first; "text": cut to a prefix
    render: Callable[[TeacherContext], str]  # its text in the message, "" when empty


def _items_block(template: str, items: Sequence[str]) -> str:
    if not items:
        return ""
    return template.format(items="\n".join(prompts.TEACHER_LIST_ITEM.format(text=t)
                                           for t in items))


def _render_strategies(ctx: TeacherContext) -> str:
    # control mode "inverted_lessons": the lessons go under the strategies' header
    return _items_block(prompts.TEACHER_STRATEGIES_TEMPLATE,
                        ctx.lessons if ctx.inverted else ctx.strategies)


def _render_lessons(ctx: TeacherContext) -> str:
    return _items_block(prompts.TEACHER_LESSONS_TEMPLATE,
                        ctx.strategies if ctx.inverted else ctx.lessons)


def _render_behaviors(ctx: TeacherContext) -> str:
    if not ctx.behaviors:
        return ""
    return prompts.TEACHER_BEHAVIORS_TEMPLATE.format(items="\n".join(
        prompts.TEACHER_BEHAVIOR_ITEM.format(index=i, name=n, instruction=ins)
        for i, (n, ins) in enumerate(ctx.behaviors, 1)))


def _render_solution(ctx: TeacherContext) -> str:
    if not ctx.successful_attempt:
        return ""
    return prompts.TEACHER_SOLUTION_TEMPLATE.format(
        successful_previous_attempt=ctx.successful_attempt)


def _render_feedback(ctx: TeacherContext) -> str:
    if not ctx.feedback:
        return ""
    return prompts.TEACHER_FEEDBACK_TEMPLATE.format(feedback_raw=ctx.feedback)


SECTIONS: list[ContextSection] = [
    ContextSection("strategies", "insight", "list", _render_strategies),
    ContextSection("lessons", "insight", "list", _render_lessons),
    ContextSection("behaviors", "behavior", "list", _render_behaviors),
    ContextSection("successful_attempt", "experience", "text", _render_solution),
    ContextSection("feedback", None, "text", _render_feedback),
]
_FIELDS = ("strategies", "lessons", "behaviors", "successful_attempt", "feedback")


def register_section(section: ContextSection, *, before: str | None = None) -> ContextSection:
    """Adds a level's part to the teacher text, before part ``before`` (None: last).

    Its name must also be listed in ``memory.context.truncation_order``.
    """
    if section.kind not in ("list", "text"):
        raise ValueError(f"section {section.name!r}: kind must be 'list' or 'text'")
    if any(s.name == section.name for s in SECTIONS):
        raise ValueError(f"teacher-context section {section.name!r} is already registered")
    names = [s.name for s in SECTIONS]
    if before is not None and before not in names:
        raise ValueError(f"unknown section {before!r}; known: {names}")
    SECTIONS.insert(names.index(before) if before is not None else len(SECTIONS), section)
    return section


def section_names() -> tuple[str, ...]:
    """Every registered part, in text order (the parts a truncation order may name)."""
    return tuple(s.name for s in SECTIONS)


def _section(name: str) -> ContextSection:
    for s in SECTIONS:
        if s.name == name:
            return s
    raise ValueError(f"unknown truncation part {name!r}")


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
    # Values of the sections registered by further levels (register_section), by name.
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Per list section, the evidence key (memory/verify.py) of each item, parallel to the
    # section's list: what the check before use admits or filters out.
    item_keys: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def add_item(self, name: str, value: Any, key: str, provenance: dict | None = None) -> None:
        """Appends one model-written item to list section ``name`` with its evidence key."""
        items = self.section(name)
        if items is None:
            items = []
            self.set_section(name, items)
        items.append(value)
        self.item_keys.setdefault(name, []).append(key)
        if provenance is not None:
            self.provenance.append(dict(provenance, key=key, section=name))

    def keys(self) -> list[str]:
        """The evidence keys of every item shown, in section order."""
        return [k for s in SECTIONS for k in self.item_keys.get(s.name, [])]

    def keep_items(self, keep: Callable[[str], bool]) -> int:
        """Drops every keyed item for which ``keep(key)`` is false (and its provenance);
        returns how many were dropped."""
        dropped: set[str] = set()
        for name, keys in self.item_keys.items():
            items = self.section(name)
            kept = [(v, k) for v, k in zip(items, keys, strict=True) if keep(k)]
            dropped.update(k for k in keys if not keep(k))
            items[:] = [v for v, _ in kept]
            keys[:] = [k for _, k in kept]
        self.provenance = [p for p in self.provenance if p.get("key") not in dropped]
        return len(dropped)

    def memory_items(self) -> int:
        """How many memory items (list sections' entries) the context holds."""
        return sum(len(self.section(s.name) or ()) for s in SECTIONS if s.kind == "list")

    def section(self, name: str) -> Any:
        """The value of part ``name`` (a list for "list" parts, str or None for "text")."""
        return getattr(self, name) if name in _FIELDS else self.extra.get(name)

    def set_section(self, name: str, value: Any) -> None:
        if name in _FIELDS:
            setattr(self, name, value)
        else:
            self.extra[name] = value

    def by_level(self) -> dict[str | None, dict[str, Any]]:
        """The sections keyed by the level that fills them (None: the trainer's feedback)."""
        out: dict[str | None, dict[str, Any]] = {}
        for s in SECTIONS:
            out.setdefault(s.level, {})[s.name] = self.section(s.name)
        return out

    @property
    def has_signal(self) -> bool:
        """Whether the SDPO self-distillation mask should be 1 for this sample."""
        sdpo = bool(self.successful_attempt) or bool(self.feedback)
        if self.signal_rule == "sdpo":
            return sdpo
        return sdpo or any(bool(self.section(s.name)) for s in SECTIONS)

    def text(self) -> str:
        """The full text, without any budget."""
        out = [self.problem_text]
        out.extend(s.render(self) for s in SECTIONS)
        out.append(prompts.TEACHER_INSTRUCTION)
        return "".join(out)

    def fit(self, count_tokens: CountTokens, max_tokens: int) -> TeacherContext:
        """A copy cut to ``max_tokens`` tokens under ``count_tokens`` (see module doc)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        ctx = dataclasses.replace(self, strategies=list(self.strategies),
                                  lessons=list(self.lessons), behaviors=list(self.behaviors),
                                  extra={k: list(v) if isinstance(v, list) else v
                                         for k, v in self.extra.items()},
                                  item_keys={k: list(v) for k, v in self.item_keys.items()},
                                  provenance=list(self.provenance), over_budget=False)

        def fits() -> bool:
            return count_tokens(ctx.text()) <= max_tokens

        if fits():
            return ctx
        for part in self.truncation_order:
            if _section(part).kind == "list":
                items = ctx.section(part)
                keys = ctx.item_keys.get(part)
                while items and not fits():
                    items.pop()
                    if keys and len(keys) > len(items):  # the item's key goes with it
                        gone = keys.pop()
                        ctx.provenance = [p for p in ctx.provenance if p.get("key") != gone]
            else:
                full = ctx.section(part)
                if not full:
                    continue
                ctx.set_section(part, None)
                if not fits():
                    continue  # even without it the text is too long: leave it out
                lo, hi = 0, len(full)  # longest prefix length that fits, by binary search
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    ctx.set_section(part, full[:mid])
                    if fits():
                        lo = mid
                    else:
                        hi = mid - 1
                ctx.set_section(part, full[:lo].rstrip() or None)
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
