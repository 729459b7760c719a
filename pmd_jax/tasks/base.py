"""Task contract shared by the trainer, the memory and the evaluation.

A task turns problems into chat messages (untokenized) and scores model responses. Tasks know
nothing about models. ``verify`` never raises on any response text: malformed responses get
``ok=False``, reward 0 and a reason.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]


@dataclass
class Problem:
    """One problem. ``gold`` is the answer (option letter) or the test specification."""

    id: str
    question: str
    gold: Any
    meta: dict = field(default_factory=dict)


@dataclass
class VerifyResult:
    """Verifier output.

    reward: in [0, 1].
    feedback: text for the self-teacher (empty when there is nothing to say).
    reason: short machine-readable cause ("correct", "wrong_answer", "no_answer_tag",
        "no_code_block", "runtime_error", "timeout", ...).
    ok: False when the response itself was malformed (no answer tag, no code block); reward is
        0 then.
    details: optional extra data (per-test records for code).
    """

    reward: float
    feedback: str
    reason: str
    ok: bool
    details: dict = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    name: str

    def problems(self, split: str) -> list[Problem]: ...

    def prompt(self, problem: Problem) -> Messages: ...

    def verify(
        self, problem: Problem, response_text: str, split: str = "train"
    ) -> VerifyResult: ...

    def verify_batch(
        self, problems: Sequence[Problem], responses: Sequence[str], split: str = "train"
    ) -> list[VerifyResult]: ...

    def gold_leak_strings(self, problem: Problem) -> list[str]: ...


def clean_text(s: str) -> str:
    """Text safe to encode as UTF-8 (lone surrogates from bad bytes become escapes)."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


class TaskError(ValueError):
    """Bad task input (missing file, unknown split, unreadable data)."""


def check_split(task_name: str, split: str, allowed: Sequence[str]) -> None:
    if split not in allowed:
        raise TaskError(f"task {task_name!r} has no split {split!r}; choose one of {list(allowed)}")


@dataclass
class LoadError:
    """A record that could not be used; kept so callers can report it."""

    source: str
    line: int
    reason: str


def iter_jsonl(path: str | Path, errors: list[LoadError]) -> Iterator[tuple[int, dict]]:
    """Yield (line number, object) for each valid JSON-object line of ``path``.

    Malformed lines (bad UTF-8, bad JSON, not an object) are skipped, logged with their line
    number and appended to ``errors``; they never raise. A missing file raises ``TaskError``.
    """
    p = Path(path)
    if not p.is_file():
        raise TaskError(f"JSONL file not found: {p}")
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                _bad(errors, str(p), lineno, f"line is not valid UTF-8 ({e.reason})")
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                _bad(errors, str(p), lineno, f"malformed JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(obj, dict):
                _bad(errors, str(p), lineno, f"expected a JSON object, got {type(obj).__name__}")
                continue
            yield lineno, obj


def _bad(errors: list[LoadError], source: str, line: int, reason: str) -> None:
    log.warning("skipping %s:%d: %s", source, line, reason)
    errors.append(LoadError(source, line, reason))


class BaseTask:
    """Default ``verify_batch``: sequential map of ``verify``; no response prefix."""

    name: str

    def response_prefix(self, problem: Problem) -> str:
        """Text the assistant turn starts with (appended after the generation prompt and
        prepended to the response before verification); "" for none."""
        return ""

    def verify(self, problem: Problem, response_text: str, split: str = "train") -> VerifyResult:
        raise NotImplementedError

    def verify_batch(
        self, problems: Sequence[Problem], responses: Sequence[str], split: str = "train"
    ) -> list[VerifyResult]:
        if len(problems) != len(responses):
            raise ValueError(
                f"verify_batch: {len(problems)} problems but {len(responses)} responses"
            )
        return [self.verify(p, r, split) for p, r in zip(problems, responses, strict=True)]
