"""Defensive parsing of model-written JSON (reflections, behaviors, evolution actions).

Nothing here raises on model output: bad JSON, wrong types, empty or over-long items are
counted in a ``collections.Counter`` and skipped. Counter keys:

``json_error`` (no JSON object found), ``wrong_type`` (a field or item of the wrong type),
``empty_item`` (nothing left after sanitising), ``overlong_item`` (longer than the cap),
``too_many_items`` (items beyond the per-field cap), ``invalid_action`` (unknown action or
missing name/instruction).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pmd_jax.memory.sanitize import sanitize_text

MAX_PARSE_CHARS = 50_000  # longer model outputs are cut before parsing
MAX_DECODE_TRIES = 32
_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.DOTALL)


def extract_json_object(text: object, counts: Counter) -> dict[str, Any] | None:
    """The first JSON object in ``text`` (whole text, a fenced block, or an embedded object)."""
    if not isinstance(text, str):
        counts["json_error"] += 1
        return None
    text = text[:MAX_PARSE_CHARS]
    candidates = [text.strip()] + [m.strip() for m in _FENCE.findall(text)]
    for cand in candidates:
        try:
            obj = json.loads(cand)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict):
            return obj
    decoder = json.JSONDecoder()
    start = text.find("{")
    tries = 0
    while start != -1 and tries < MAX_DECODE_TRIES:
        tries += 1
        try:
            obj, _ = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            obj = None
        if isinstance(obj, dict):
            return obj
        start = text.find("{", start + 1)
    counts["json_error"] += 1
    return None


def clean_item(
    item: object,
    counts: Counter,
    *,
    max_chars: int,
    min_chars: int = 1,
    extra_tokens: Sequence[str] = (),
) -> str | None:
    """A sanitised string item, or None (counted) when wrong-typed, empty or over-long."""
    if not isinstance(item, str):
        counts["wrong_type"] += 1
        return None
    if len(item.strip()) > max_chars:
        counts["overlong_item"] += 1
        return None
    text = sanitize_text(item, max_chars, extra_tokens)
    text = " ".join(text.split())  # items are one line
    if len(text) < min_chars:
        counts["empty_item"] += 1
        return None
    return text


def parse_reflection(
    text: object,
    counts: Counter,
    *,
    max_item_chars: int,
    min_item_chars: int,
    max_items: int,
    extra_tokens: Sequence[str] = (),
) -> tuple[list[str], list[str]]:
    """``{"strategies": [...], "lessons": [...]}`` -> (strategies, lessons)."""
    obj = extract_json_object(text, counts)
    if obj is None:
        return [], []
    out: dict[str, list[str]] = {}
    for field in ("strategies", "lessons"):
        raw = obj.get(field, [])
        if isinstance(raw, str):  # a single string instead of a list: accept it as one item
            raw = [raw]
        if not isinstance(raw, list):
            counts["wrong_type"] += 1
            raw = []
        items: list[str] = []
        for item in raw:
            if len(items) >= max_items:
                counts["too_many_items"] += 1
                continue
            c = clean_item(item, counts, max_chars=max_item_chars, min_chars=min_item_chars,
                           extra_tokens=extra_tokens)
            if c is not None and c not in items:
                items.append(c)
        out[field] = items
    return out["strategies"], out["lessons"]


def normalize_name(name: str) -> str:
    """Behavior names compare case- and spacing-insensitively: 'Check Units' == 'check_units'."""
    return re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")


def parse_behaviors(
    text: object,
    counts: Counter,
    *,
    max_name_chars: int,
    max_instruction_chars: int,
    max_items: int,
    extra_tokens: Sequence[str] = (),
) -> list[tuple[str, str]]:
    """``{"behaviors": [{"name", "instruction"}, ...]}`` -> [(name, instruction)]."""
    obj = extract_json_object(text, counts)
    if obj is None:
        return []
    raw = obj.get("behaviors")
    if not isinstance(raw, list):
        counts["wrong_type"] += 1
        return []
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for b in raw:
        if len(out) >= max_items:
            counts["too_many_items"] += 1
            continue
        if not isinstance(b, dict):
            counts["wrong_type"] += 1
            continue
        name = clean_item(b.get("name"), counts, max_chars=max_name_chars,
                          extra_tokens=extra_tokens)
        instr = clean_item(b.get("instruction"), counts, max_chars=max_instruction_chars,
                           min_chars=8, extra_tokens=extra_tokens)
        if name is None or instr is None or not normalize_name(name):
            continue
        key = normalize_name(name)
        if key in seen:
            continue
        seen.add(key)
        out.append((name, instr))
    return out


@dataclasses.dataclass(frozen=True)
class Action:
    action: str  # "new" | "update" | "remove"
    name: str
    instruction: str | None


def parse_actions(
    text: object,
    counts: Counter,
    *,
    max_name_chars: int,
    max_instruction_chars: int,
    max_items: int,
    extra_tokens: Sequence[str] = (),
) -> list[Action]:
    """``{"actions": [{"action": "new"|"update"|"remove", "name", "instruction"}]}``."""
    obj = extract_json_object(text, counts)
    if obj is None:
        return []
    raw = obj.get("actions")
    if not isinstance(raw, list):
        counts["wrong_type"] += 1
        return []
    out: list[Action] = []
    for a in raw:
        if len(out) >= max_items:
            counts["too_many_items"] += 1
            continue
        if not isinstance(a, dict):
            counts["wrong_type"] += 1
            continue
        kind = a.get("action")
        if not isinstance(kind, str) or kind.strip().lower() not in ("new", "update", "remove"):
            counts["invalid_action"] += 1
            continue
        kind = kind.strip().lower()
        name = clean_item(a.get("name"), counts, max_chars=max_name_chars,
                          extra_tokens=extra_tokens)
        if name is None or not normalize_name(name):
            counts["invalid_action"] += 1
            continue
        instr = None
        if kind != "remove":
            instr = clean_item(a.get("instruction"), counts, max_chars=max_instruction_chars,
                               min_chars=8, extra_tokens=extra_tokens)
            if instr is None:
                counts["invalid_action"] += 1
                continue
        out.append(Action(kind, name, instr))
    return out
