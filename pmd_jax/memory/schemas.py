"""JSON schemas of the memory's model calls, a validator for them, and their token bounds.

Four calls, one schema each, every bound taken from the memory config:

- reflection (level 2): ``{"strategies": [str], "lessons": [str]}``, each list
  ``insight.min_items_per_reflection`` .. ``insight.max_items_per_reflection`` items of
  ``insight.min_item_chars`` .. ``insight.max_item_chars`` characters;
- cluster summary (level 3, ``behavior.summary_mode="policy"``): ``{"summary": str}`` of
  ``behavior.min_summary_chars`` .. ``behavior.max_summary_chars`` characters;
- behavior extraction: ``{"behaviors": [{"name", "instruction"}]}`` with
  ``behavior.min_behaviors`` .. ``behavior.max_behaviors`` items (3-8, METHOD.md 2.1);
- behavior evolution: ``{"actions": [...]}``, at most ``behavior.max_actions`` actions, each
  ``{"action": "new"|"update", "name", "instruction"}`` or ``{"action": "remove", "name"}``.

Every object lists all its keys as required and sets ``additionalProperties: false``. Only
features the grammar engines implement are used (llguidance and xgrammar: ``type``,
``properties``, ``required``, ``additionalProperties``, ``items``, ``minItems``/``maxItems``,
``minLength``/``maxLength``, ``enum``/``const``, ``anyOf``; no ``pattern``), so one schema
serves both samplers. The engines emit an object's keys in the order ``properties`` lists
them, so :func:`schema_param` keeps that order (``sampling.base.schema_string`` sorts the keys,
which would put "lessons" before "strategies" and "instruction" before "name").

:func:`validate` checks a parsed reply against the same subset (errors as strings, no
dependency), and :func:`reply_token_bound` gives the worst-case reply length in tokens that
the token budgets in ``memory/config.py`` and ``configs/*.py`` are set above.
"""

from __future__ import annotations

import json
import math
from typing import Any

Schema = dict[str, Any]

CALLS = ("reflection", "summary", "extraction", "evolution")
# Syntax that is not string content counts one token per character in reply_token_bound.
CHARS_PER_TOKEN = 3.0  # string content: a fair bound for SmolLM2's BPE on English text


def _string(min_chars: int, max_chars: int) -> Schema:
    return {"type": "string", "minLength": int(min_chars), "maxLength": int(max_chars)}


def _object(properties: dict[str, Schema]) -> Schema:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def _array(items: Schema, min_items: int, max_items: int) -> Schema:
    return {"type": "array", "items": items, "minItems": int(min_items),
            "maxItems": int(max_items)}


def reflection_schema(insight_cfg: Any) -> Schema:
    """``{"strategies": [...], "lessons": [...]}`` bounded by ``memory.insight``."""
    item = _string(insight_cfg.min_item_chars, insight_cfg.max_item_chars)
    lo, hi = insight_cfg.min_items_per_reflection, insight_cfg.max_items_per_reflection
    return _object({"strategies": _array(item, lo, hi), "lessons": _array(item, lo, hi)})


def summary_schema(behavior_cfg: Any) -> Schema:
    """``{"summary": "..."}`` bounded by ``memory.behavior.{min,max}_summary_chars``."""
    return _object({"summary": _string(behavior_cfg.min_summary_chars,
                                       behavior_cfg.max_summary_chars)})


def _name(b: Any) -> Schema:
    return _string(b.min_name_chars, b.max_name_chars)


def _instruction(b: Any) -> Schema:
    return _string(b.min_instruction_chars, b.max_instruction_chars)


def extraction_schema(behavior_cfg: Any) -> Schema:
    """``{"behaviors": [{"name", "instruction"}]}`` with min/max_behaviors items."""
    b = behavior_cfg
    item = _object({"name": _name(b), "instruction": _instruction(b)})
    return _object({"behaviors": _array(item, b.min_behaviors, b.max_behaviors)})


def evolution_schema(behavior_cfg: Any) -> Schema:
    """``{"actions": [...]}``: new/update carry name and instruction, remove a name only."""
    b = behavior_cfg
    write = _object({"action": {"type": "string", "enum": ["new", "update"]},
                     "name": _name(b), "instruction": _instruction(b)})
    remove = _object({"action": {"type": "string", "const": "remove"}, "name": _name(b)})
    return _object({"actions": _array({"anyOf": [write, remove]}, 0, b.max_actions)})


def call_schema(call: str, memory_cfg: Any) -> Schema:
    """The schema of one call (``CALLS``) from the whole memory config."""
    if call == "reflection":
        return reflection_schema(memory_cfg.insight)
    builders = {"summary": summary_schema, "extraction": extraction_schema,
                "evolution": evolution_schema}
    if call not in builders:
        raise ValueError(f"unknown memory call {call!r}, expected one of {CALLS}")
    return builders[call](memory_cfg.behavior)


def mel_reflection_schema(mel_cfg: Any) -> Schema:
    """``mode=mel``'s contrastive reflection (pmd_jax/modes/mel): ``{"split_point", "critique",
    "lesson"}``, bounded by ``mel.split_point_max_chars`` / ``critique_max_chars`` /
    ``lesson_min_chars``..``lesson_max_chars`` (not one of :data:`CALLS`: the memory never
    makes it)."""
    return _object({
        "split_point": _string(1, mel_cfg.split_point_max_chars),
        "critique": _string(1, mel_cfg.critique_max_chars),
        "lesson": _string(mel_cfg.lesson_min_chars, mel_cfg.lesson_max_chars),
    })


def schema_param(schema: Schema) -> str:
    """The ``SamplingParams.json_schema`` string of ``schema``: compact, key order kept."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


# ------------------------------------------------------------------------- validation --
_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "boolean": (bool,),
    "integer": (int,), "number": (int, float), "null": (type(None),),
}


def _is_type(value: object, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES[name])


def validate(value: object, schema: Schema, path: str = "$") -> list[str]:
    """Errors of ``value`` against ``schema`` (the subset above); empty when it validates.

    Raises ValueError for a schema keyword outside the subset, so that a schema edited to use
    one cannot validate silently wrong.
    """
    known = {"type", "properties", "required", "additionalProperties", "items", "minItems",
             "maxItems", "minLength", "maxLength", "enum", "const", "anyOf"}
    unknown = set(schema) - known
    if unknown:
        raise ValueError(f"schema keywords {sorted(unknown)} are outside the validated subset")
    if "anyOf" in schema:
        branches = [validate(value, s, path) for s in schema["anyOf"]]
        if not any(not b for b in branches):
            best = min(branches, key=len)
            return [f"{path}: matches no anyOf branch ({best[0]})"]
    errors: list[str] = []
    t = schema.get("type")
    if t is not None and not _is_type(value, t):
        return [f"{path}: expected {t}, got {type(value).__name__}"]
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: expected {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: shorter than {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']} characters")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
        if "items" in schema:
            for i, v in enumerate(value):
                errors.extend(validate(v, schema["items"], f"{path}[{i}]"))
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: missing key {key!r}")
        if schema.get("additionalProperties", True) is False:
            extra = sorted(set(value) - set(props))
            if extra:
                errors.append(f"{path}: unexpected keys {extra}")
        for key, sub in props.items():
            if key in value:
                errors.extend(validate(value[key], sub, f"{path}.{key}"))
    return errors


# ------------------------------------------------------------------------ token bound --
def reply_token_bound(schema: Schema, chars_per_token: float = CHARS_PER_TOKEN) -> int:
    """Worst-case length in tokens of a reply that fills every bound of ``schema``.

    The reply is laid out as the grammar engines emit it (``", "`` and ``": "`` separators, no
    other whitespace; sampling/grammar.py). String content counts ``ceil(maxLength /
    chars_per_token)`` tokens per string; every other character (braces, brackets, quotes,
    separators, keys, enum values) counts one token each, which over-counts (BPE merges
    ``{"`` and ``": "``) and so leaves headroom. Every property of an object is counted
    (all are required here); ``anyOf`` takes its longest branch. Raises ValueError for an
    unbounded string or array.
    """
    if "anyOf" in schema:
        return max(reply_token_bound(s, chars_per_token) for s in schema["anyOf"])
    if "const" in schema:
        return len(json.dumps(schema["const"]))
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    t = schema.get("type")
    if t == "string":
        if "maxLength" not in schema:
            raise ValueError("unbounded string (no maxLength)")
        return math.ceil(schema["maxLength"] / chars_per_token) + 2
    if t == "array":
        if "maxItems" not in schema:
            raise ValueError("unbounded array (no maxItems)")
        n = int(schema["maxItems"])
        item = reply_token_bound(schema["items"], chars_per_token) if n else 0
        return 2 + n * item + 2 * max(0, n - 1)
    if t == "object":
        props = schema.get("properties", {})
        keys = sum(len(json.dumps(k)) + 2 + reply_token_bound(s, chars_per_token)
                   for k, s in props.items())
        return 2 + keys + 2 * max(0, len(props) - 1)
    raise ValueError(f"reply_token_bound does not handle schema type {t!r}")


def call_token_bounds(memory_cfg: Any) -> dict[str, int]:
    """``reply_token_bound`` of every call's schema, e.g. to check a config's budgets."""
    return {call: reply_token_bound(call_schema(call, memory_cfg)) for call in CALLS}
