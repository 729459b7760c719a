r"""Bring your own data: the JSONL schemas of multiple-choice, code and math problems, and
their validation (the loaders are in ``jsonl_tasks``).

One JSON object per line (blank lines are skipped). ``--config.task.name=jsonl_mcq``,
``jsonl_code`` or ``jsonl_math`` with ``--config.task.path=<file>``. Every row is checked
when the config is validated, before any model or compute: a malformed row is an error
naming the file, the line number and the field (``TaskError`` here, exit status 2 on the
command line). Rows may not carry fields other than the ones below (a misspelt optional field
would otherwise be ignored silently); put anything else in ``"meta"`` (an object, kept in
``problem.meta["row_meta"]``).

Common fields: ``"id"`` (optional, string or integer; unique in the file): the problem's id;
without it the id is ``"<file stem>/<line number>"``.

Multiple choice (``jsonl_mcq``; prompts, styles and reward of ``mcq.py``)::

    {"id": "q1", "question": "Which gas do plants take in for photosynthesis?",
     "options": ["oxygen", "carbon dioxide", "nitrogen", "helium"], "answer": "carbon dioxide",
     "passage": "Plants make sugar from carbon dioxide and water."}

- ``question``: non-empty string. ``options``: 2 to 26 strings (numbers are turned into
  strings), distinct after case, spaces, quotes and periods are ignored.
- ``answer``: the text of the right option (exactly one of ``options``), or its letter
  (``"A"`` = the first option as listed in the file), or an integer: its 0-based index. A
  string that is both an option's text and another option's letter is refused as ambiguous
  (give the index). Options are shuffled per problem (``task.shuffle_options``, seeded); the
  gold follows its option.
- ``passage`` (optional string): shown before the question when ``task.include_support``.

Code (``jsonl_code``; the sandbox and grading of ``code.py`` / ``grading.py``)::

    {"id": "add", "prompt": "Write add(a, b) that returns a + b.", "entry_point": "add",
     "test_style": "call", "tests": [{"args": [1, 2], "expected": 3},
                                     {"args": {"a": -1, "b": 1}, "expected": 0}]}
    {"prompt": "Read two integers from stdin and print their sum.", "test_style": "stdin",
     "tests": [{"input": "1 2\n", "output": "3\n"}]}
    {"prompt": "Write is_even(n).", "test_style": "assert",
     "tests": ["assert is_even(2)", "assert not is_even(3)"]}

- ``prompt``: non-empty string (the problem text, put in ``code.CODE_PROMPT``).
- ``test_style`` and ``tests`` (a non-empty list):

  - ``"stdin"``: ``{"input": str, "output": str}``; the program runs as a script with the
    input on stdin; its stdout must equal the output up to whitespace between tokens.
  - ``"call"``: ``{"args": list | object, "expected": any JSON}``; needs ``entry_point``. The
    function (module level, or a method of ``class Solution``) is called with the list as
    positional arguments or the object as keyword arguments; its return value, as JSON (tuples
    become lists), must equal ``expected``.
  - ``"assert"``: Python source strings, each one test (usually one ``assert``); they run in
    the host against the sandboxed program's functions (``grading.py``), never inside it.

- ``entry_point`` (optional, required for ``"call"``): the function's name; when the prompt
  shows neither ``name(`` nor ```name``` the prompt gets "The function should be called
  `<name>`.".
- ``time_limit`` (optional): seconds per test (default 6).

The reward is 1 iff every test passes. The problems are split (below), not the tests: train
rewards use all of a problem's tests.

Math (``jsonl_math``; the prompts and numeric verifier of ``math.py``)::

    {"id": "m1", "question": "A box holds 12 eggs. How many eggs are in 3 boxes?",
     "answer": 36}
    {"question": "Simplify sqrt(8).", "answer": "2\\sqrt{2}"}

- ``question``: non-empty string.
- ``answer``: a JSON number, or a non-empty string. A number, or a string that is only a
  number (``"1,200"``, ``"-3.5"``, ``"3/4"``, ``"$12"``), is graded by
  ``math.check_numeric_answer``: the response's final number must equal it exactly as a
  rational (``0.75 == 3/4``). Any other string is a text answer: the response's final answer
  (the last ``\boxed{...}``, else the last ``<answer>`` tag, else the rest of the line after
  the last "the answer is" / "answer:") must equal it, ignoring case, spaces, ``$`` signs and
  a final period; its prompt asks for "The answer is <answer>" rather than a number.

Splits: "train", "validation" (held out) and "all". ``valid_size`` problems (or, when 0,
``max(1, round(n * valid_fraction))``) are held out by a permutation seeded with
``split_seed`` of the sorted ids: the same file and seed give the same split in any row
order.
"""

from __future__ import annotations

import ast
import difflib
import json
import math
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pmd_jax.tasks import code as code_mod
from pmd_jax.tasks import mcq
from pmd_jax.tasks.base import TaskError

KINDS = ("jsonl_mcq", "jsonl_code", "jsonl_math")
TEST_STYLES = ("stdin", "call", "assert")
MAX_REPORTED = 20  # malformed rows listed in one error (then a count of the rest)
MAX_TIME_LIMIT = 60.0

_COMMON = ("id", "meta")
FIELDS = {
    "jsonl_mcq": ("question", "options", "answer", "passage", *_COMMON),
    "jsonl_code": ("prompt", "test_style", "tests", "entry_point", "time_limit", *_COMMON),
    "jsonl_math": ("question", "answer", *_COMMON),
}
REQUIRED = {
    "jsonl_mcq": ("question", "options", "answer"),
    "jsonl_code": ("prompt", "test_style", "tests"),
    "jsonl_math": ("question", "answer"),
}
_IDENT = re.compile(r"^[A-Za-z_]\w*$")


class RowError(ValueError):
    """A malformed row: ``field`` is the field at fault ("" for the row as a whole)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


# ----------------------------------------------------------------------------- reading


def _where(path: Path, line: int, field: str) -> str:
    return f"{path} line {line}, " + (f"field {field!r}" if field else "the whole row")


def read_rows(path: str | Path) -> tuple[list[tuple[int, dict]], list[tuple[int, str]]]:
    """(line number, object) of each non-blank line, and (line number, error) for lines that
    are not JSON objects. A missing or unreadable file raises ``TaskError``."""
    p = Path(path)
    if not p.is_file():
        raise TaskError(f"JSONL file not found: {p}")
    rows: list[tuple[int, dict]] = []
    errors: list[tuple[int, str]] = []
    try:
        f = p.open("rb")
    except OSError as e:
        raise TaskError(f"cannot read {p}: {e}") from e
    with f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                errors.append((lineno, f"{_where(p, lineno, '')}: not valid UTF-8 ({e.reason})"))
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                errors.append((lineno, f"{_where(p, lineno, '')}: not valid JSON ({e.msg} at "
                               f"column {e.colno})"))
                continue
            if not isinstance(obj, dict):
                errors.append((lineno, f"{_where(p, lineno, '')}: expected a JSON object, got "
                               f"{_json_type(obj)}"))
                continue
            rows.append((lineno, obj))
    return rows, errors


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _text(obj: dict, field: str, *, required: bool = True) -> str:
    v = obj.get(field)
    if v is None and not required:
        return ""
    if field not in obj:
        raise RowError(field, "missing")
    if not isinstance(v, str):
        raise RowError(field, f"must be a string, got {_json_type(v)}")
    if required and not v.strip():
        raise RowError(field, "is empty")
    return v


def _check_fields(kind: str, obj: dict) -> None:
    allowed = FIELDS[kind]
    for key in obj:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RowError(str(key), f"unknown field; {hint}fields of {kind} rows: "
                           f"{', '.join(allowed)} (put other data in 'meta')")
    for key in REQUIRED[kind]:
        if key not in obj:
            raise RowError(key, "missing")
    if "meta" in obj and not isinstance(obj["meta"], dict):
        raise RowError("meta", f"must be an object, got {_json_type(obj['meta'])}")


def _row_id(obj: dict, path: Path, lineno: int) -> str:
    if "id" not in obj:
        return f"{path.stem}/{lineno}"
    v = obj["id"]
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise RowError("id", f"must be a string or an integer, got {_json_type(v)}")
    s = str(v)
    if not s.strip():
        raise RowError("id", "is empty")
    return s


# ----------------------------------------------------------------------------- rows


def parse_mcq_row(obj: dict) -> dict:
    """{question, options, gold_index, passage} of a jsonl_mcq row; raises ``RowError``."""
    _check_fields("jsonl_mcq", obj)
    question = _text(obj, "question")
    opts_raw = obj["options"]
    if not isinstance(opts_raw, list):
        raise RowError("options", f"must be a list of strings, got {_json_type(opts_raw)}")
    if not 2 <= len(opts_raw) <= len(mcq.LETTERS):
        raise RowError("options", f"needs 2 to {len(mcq.LETTERS)} options, got {len(opts_raw)}")
    options: list[str] = []
    seen: dict[str, int] = {}
    for i, o in enumerate(opts_raw):
        if not (isinstance(o, str) or is_number(o)):
            raise RowError(f"options[{i}]", f"must be a string, got {_json_type(o)}")
        s = str(o).strip()
        if not s:
            raise RowError(f"options[{i}]", "is empty")
        key = mcq.normalize_option_text(s)
        if key in seen:
            raise RowError(f"options[{i}]", f"{s!r} repeats options[{seen[key]}]")
        seen[key] = i
        options.append(s)
    gold = _mcq_answer(obj["answer"], options)
    passage = _text(obj, "passage", required=False)
    return {"question": question, "options": options, "gold_index": gold, "passage": passage}


def _mcq_answer(ans: Any, options: list[str]) -> int:
    n = len(options)
    if isinstance(ans, int) and not isinstance(ans, bool):
        if not 0 <= ans < n:
            raise RowError("answer", f"index {ans} is out of range for {n} options (0-based)")
        return ans
    if not isinstance(ans, str):
        raise RowError("answer", "must be an option's text, its letter or a 0-based index, "
                       f"got {_json_type(ans)}")
    a = ans.strip()
    by_text = [i for i, o in enumerate(options) if o == a]
    by_letter = mcq.LETTERS.index(a) if len(a) == 1 and a in mcq.LETTERS[:n] else None
    if by_text and by_letter is not None and by_text[0] != by_letter:
        raise RowError("answer", f"{ans!r} is both the text of option {by_text[0]} and the "
                       f"letter of option {by_letter}; give the 0-based index instead")
    if by_text:
        return by_text[0]
    if by_letter is not None:
        return by_letter
    raise RowError("answer", f"{ans!r} is not among the options {options} (nor one of the "
                   f"letters {', '.join(mcq.LETTERS[:n])})")


def parse_code_row(obj: dict) -> dict:
    """{prompt, spec (a ``code._canon_tests`` spec), entry_point} of a jsonl_code row."""
    _check_fields("jsonl_code", obj)
    prompt = _text(obj, "prompt")
    entry = _text(obj, "entry_point", required=False)
    if obj.get("entry_point") is not None and not _IDENT.match(entry):
        raise RowError("entry_point", f"{entry!r} is not a Python identifier")
    style = obj["test_style"]
    if style not in TEST_STYLES:
        raise RowError("test_style", f"unknown test style {style!r}; choose one of "
                       f"{', '.join(TEST_STYLES)}")
    tests = obj["tests"]
    if not isinstance(tests, list):
        raise RowError("tests", f"must be a list, got {_json_type(tests)}")
    if not tests:
        raise RowError("tests", "is empty (a problem needs at least one test)")
    time_limit = obj.get("time_limit", 6.0)
    if not is_number(time_limit) or not 0 < time_limit <= MAX_TIME_LIMIT:
        raise RowError("time_limit", f"must be a number of seconds in (0, {MAX_TIME_LIMIT:g}], "
                       f"got {time_limit!r}")
    inputs: list = []
    outputs: list = []
    if style == "stdin":
        for i, t in enumerate(tests):
            _case_keys(t, i, ("input", "output"), style)
            for k in ("input", "output"):
                if not isinstance(t[k], str):
                    raise RowError(f"tests[{i}].{k}",
                                   f"must be a string, got {_json_type(t[k])}")
            inputs.append(t["input"])
            outputs.append(t["output"])
    elif style == "call":
        if not entry:
            raise RowError("entry_point", "missing (call-style tests need the function's name)")
        for i, t in enumerate(tests):
            _case_keys(t, i, ("args", "expected"), style)
            args = t["args"]
            if isinstance(args, list):
                inputs.append("\n".join(json.dumps(a) for a in args))
            elif isinstance(args, dict):
                bad = [k for k in args if not _IDENT.match(k)]
                if bad:
                    raise RowError(f"tests[{i}].args", f"keyword {bad[0]!r} is not a Python "
                                   "identifier")
                inputs.append(dict(args))
            else:
                raise RowError(f"tests[{i}].args", "must be a list (positional arguments) or "
                               f"an object (keyword arguments), got {_json_type(args)}")
            outputs.append(json.dumps(t["expected"]))
    else:
        for i, t in enumerate(tests):
            if not isinstance(t, str):
                raise RowError(f"tests[{i}]", "assert-style tests are strings of Python code, "
                               f"got {_json_type(t)}")
            if not t.strip():
                raise RowError(f"tests[{i}]", "is empty")
            try:
                ast.parse(t)
            except SyntaxError as e:
                raise RowError(f"tests[{i}]", f"is not valid Python ({e.msg}, line "
                               f"{e.lineno})") from None
            inputs.append(t)
            outputs.append("")
    spec = code_mod._canon_tests({
        "kind": {"assert": "code"}.get(style, style), "inputs": inputs, "outputs": outputs,
        "fn_name": entry, "time_limit": float(time_limit),
    })
    return {"prompt": prompt, "spec": spec, "entry_point": entry, "test_style": style}


def _case_keys(t: Any, i: int, keys: tuple[str, str], style: str) -> None:
    if not isinstance(t, dict):
        raise RowError(f"tests[{i}]", f"{style}-style tests are objects with "
                       f"{' and '.join(map(repr, keys))}, got {_json_type(t)}")
    for k in keys:
        if k not in t:
            raise RowError(f"tests[{i}].{k}", "missing")
    extra = [k for k in t if k not in keys]
    if extra:
        raise RowError(f"tests[{i}].{extra[0]}",
                       f"unknown key; {style}-style tests have {' and '.join(map(repr, keys))}")


def parse_math_row(obj: dict) -> dict:
    """{question, answer} of a jsonl_math row (answer: a number or a non-empty string)."""
    _check_fields("jsonl_math", obj)
    question = _text(obj, "question")
    ans = obj["answer"]
    if is_number(ans):
        if not math.isfinite(ans):
            raise RowError("answer", f"must be a finite number, got {ans!r}")
    elif isinstance(ans, str):
        if not ans.strip():
            raise RowError("answer", "is empty")
    else:
        raise RowError("answer", f"must be a number or a string, got {_json_type(ans)}")
    return {"question": question, "answer": ans}


PARSERS: dict[str, Callable[[dict], dict]] = {
    "jsonl_mcq": parse_mcq_row,
    "jsonl_code": parse_code_row,
    "jsonl_math": parse_math_row,
}


# ----------------------------------------------------------------------------- file


def parse_file(kind: str, path: str | Path) -> tuple[list[tuple[str, int, dict]], list[str]]:
    """Every row of ``path`` parsed as ``kind``: ([(id, line, fields)], errors).

    Errors name the file, the line and the field; ids must be unique."""
    if kind not in PARSERS:
        raise TaskError(f"unknown JSONL task kind {kind!r}; choose one of {', '.join(KINDS)}")
    p = Path(path)
    rows, errors = read_rows(p)
    errors = list(errors)
    out: list[tuple[str, int, dict]] = []
    first_line: dict[str, int] = {}
    for lineno, obj in rows:
        try:
            pid = _row_id(obj, p, lineno)
            if pid in first_line:
                raise RowError("id", f"{pid!r} was already used on line {first_line[pid]}")
            fields = PARSERS[kind](obj)
        except RowError as e:
            errors.append((lineno, f"{_where(p, lineno, e.field)}: {e.message}"))
            continue
        first_line[pid] = lineno
        fields["row_meta"] = dict(obj.get("meta") or {})
        out.append((pid, lineno, fields))
    msgs = [m for _, m in sorted(errors, key=lambda e: e[0])]
    if not out and not msgs:
        msgs.append(f"{p}: no rows (the file is empty)")
    return out, msgs


def split_sizes(n: int, valid_fraction: float, valid_size: int) -> int:
    """The number of held-out problems; raises ``TaskError`` when no train or no held-out
    problem would be left."""
    if valid_size < 0:
        raise TaskError(f"valid_size={valid_size} must be >= 0 (0 = use valid_fraction)")
    if not valid_size and not 0.0 < valid_fraction < 1.0:
        raise TaskError(f"valid_fraction={valid_fraction} must be in (0, 1)")
    n_val = valid_size or max(1, round(n * valid_fraction))
    if n_val >= n:
        why = f"valid_size={valid_size}" if valid_size else f"valid_fraction={valid_fraction}"
        raise TaskError(f"{why} holds out {n_val} of {n} problems and leaves none to train on; "
                        "the file needs more rows or a smaller held-out part")
    return n_val


def held_out_ids(ids: list[str], valid_fraction: float, valid_size: int,
                 split_seed: int) -> set[str]:
    """The held-out ids: the first ``n_val`` of a seeded permutation of the sorted ids."""
    n_val = split_sizes(len(ids), valid_fraction, valid_size)
    order = sorted(ids)
    random.Random(split_seed).shuffle(order)
    return set(order[:n_val])


def file_errors(kind: str, path: str | Path, valid_fraction: float = 0.1,
                valid_size: int = 0) -> list[str]:
    """Config-time check of a whole file: the malformed rows (file, line, field) and a split
    that leaves no train or no held-out problem. [] when the file loads."""
    try:
        rows, errors = parse_file(kind, path)
        if errors:
            return capped(errors)
        split_sizes(len(rows), valid_fraction, valid_size)
    except TaskError as e:
        return [str(e)]
    return []


def capped(errors: list[str]) -> list[str]:
    if len(errors) <= MAX_REPORTED:
        return list(errors)
    return errors[:MAX_REPORTED] + [f"... and {len(errors) - MAX_REPORTED} more malformed rows"]

