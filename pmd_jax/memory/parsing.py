"""Defensive parsing of model-written JSON (reflections, summaries, behaviors, actions).

Nothing here raises on model output: bad JSON, wrong types, empty or over-long items are
counted in a ``collections.Counter`` and skipped. Each reply is first parsed (the first JSON
object in it, fenced or embedded), then, given its call's schema (memory/schemas.py),
validated, then salvaged item by item, so one bad item does not cost the good ones. Per reply
exactly one of:

``parsed`` (a JSON object that validates against the schema; with no schema given, any JSON
object), ``json_error`` (no JSON object found), ``schema_error`` (a JSON object that does not
validate: valid items are still kept).

Per item (what the salvage dropped or cut): ``wrong_type`` (a field or item of the wrong
type), ``empty_item`` (shorter than the minimum after sanitising), ``overlong_item`` (longer
than the cap), ``too_many_items`` (items beyond the per-field cap), ``invalid_action`` (unknown
action or missing name/instruction), ``plain_text_summary`` (a summary reply without JSON used
as it is; unstructured mode only).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pmd_jax.memory.sanitize import sanitize_text
from pmd_jax.memory.schemas import Schema, validate

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


def check_schema(obj: dict[str, Any], schema: Schema | None, counts: Counter) -> bool:
    """Counts a parsed object as ``parsed`` or ``schema_error``; True when it validates."""
    if schema is not None and validate(obj, schema):
        counts["schema_error"] += 1
        return False
    counts["parsed"] += 1
    return True


def parse_object(text: object, counts: Counter, schema: Schema | None) -> dict[str, Any] | None:
    """The reply's JSON object (counted ``json_error`` if none), checked against ``schema``."""
    obj = extract_json_object(text, counts)
    if obj is not None:
        check_schema(obj, schema, counts)
    return obj


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
    schema: Schema | None = None,
) -> tuple[list[str], list[str]]:
    """``{"strategies": [...], "lessons": [...]}`` -> (strategies, lessons)."""
    obj = parse_object(text, counts, schema)
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
    schema: Schema | None = None,
    min_name_chars: int = 1,
    min_instruction_chars: int = 8,
) -> list[tuple[str, str]]:
    """``{"behaviors": [{"name", "instruction"}, ...]}`` -> [(name, instruction)]."""
    obj = parse_object(text, counts, schema)
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
                          min_chars=min_name_chars, extra_tokens=extra_tokens)
        instr = clean_item(b.get("instruction"), counts, max_chars=max_instruction_chars,
                           min_chars=min_instruction_chars, extra_tokens=extra_tokens)
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
    schema: Schema | None = None,
    min_name_chars: int = 1,
    min_instruction_chars: int = 8,
) -> list[Action]:
    """``{"actions": [{"action": "new"|"update"|"remove", "name", "instruction"}]}``."""
    obj = parse_object(text, counts, schema)
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
                          min_chars=min_name_chars, extra_tokens=extra_tokens)
        if name is None or not normalize_name(name):
            counts["invalid_action"] += 1
            continue
        instr = None
        if kind != "remove":
            instr = clean_item(a.get("instruction"), counts, max_chars=max_instruction_chars,
                               min_chars=min_instruction_chars, extra_tokens=extra_tokens)
            if instr is None:
                counts["invalid_action"] += 1
                continue
        out.append(Action(kind, name, instr))
    return out


def parse_summary(
    text: object,
    counts: Counter,
    *,
    max_chars: int,
    min_chars: int = 1,
    extra_tokens: Sequence[str] = (),
    schema: Schema | None = None,
    plain_text: bool = False,
) -> str | None:
    """``{"summary": "..."}`` -> the summary (one line, cut to ``max_chars``), or None.

    ``plain_text``: a reply with no JSON object in it (one that does not start with "{") is
    taken as the summary itself, as servers without structured output tend to answer; counted
    ``plain_text_summary`` besides its ``json_error``. None means: keep the extractive summary.
    """
    obj = parse_object(text, counts, schema)
    if obj is None:
        if not plain_text or not isinstance(text, str) or text.lstrip().startswith("{"):
            return None
        raw = text
        counts["plain_text_summary"] += 1
    else:
        value = obj.get("summary")
        if not isinstance(value, str):
            counts["wrong_type"] += 1
            return None
        raw = value
    out = " ".join(sanitize_text(raw, max_chars, extra_tokens).split())
    if len(out) < max(1, min_chars):
        counts["empty_item"] += 1
        return None
    return out
