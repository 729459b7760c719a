"""Bring your own data: the loaders of ``jsonl_mcq``, ``jsonl_code`` and ``jsonl_math``
(``--config.task.name=jsonl_* --config.task.path=<file>``), and the text answers of math rows.

The schemas, their validation and the held-out split are in ``jsonl_schema`` (its docstring
documents every field).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from pmd_jax.tasks import code as code_mod
from pmd_jax.tasks import math as math_task
from pmd_jax.tasks import mcq
from pmd_jax.tasks.base import Messages, Problem, TaskError, VerifyResult, clean_text
from pmd_jax.tasks.jsonl_schema import capped, held_out_ids, is_number, parse_file


def _load(kind: str, path: str | Path, valid_fraction: float, valid_size: int,
          split_seed: int) -> tuple[list[tuple[str, int, dict]], set[str]]:
    rows, errors = parse_file(kind, path)
    if errors:
        raise TaskError("malformed rows:\n" + "\n".join(capped(errors)))
    held = held_out_ids([pid for pid, _, _ in rows], valid_fraction, valid_size, split_seed)
    return rows, held


def _splits(probs: list[Problem], held: set[str]) -> dict[str, list[Problem]]:
    return {
        "train": [p for p in probs if p.id not in held],
        "validation": [p for p in probs if p.id in held],
        "all": list(probs),
    }


# ----------------------------------------------------------------------------- loaders


def load_jsonl_mcq(
    path: str | Path, *, valid_fraction: float = 0.1, valid_size: int = 0, split_seed: int = 42,
    seed: int = 0, shuffle: bool = True, prompt_style: str = "reasoning",
    include_support: bool = False,
) -> mcq.McqTask:
    """Multiple choice from a JSONL file (schema in ``jsonl_schema``)."""
    rows, held = _load("jsonl_mcq", path, valid_fraction, valid_size, split_seed)
    probs = [
        mcq.make_problem(pid, f["question"], f["options"], f["gold_index"], seed=seed,
                         shuffle=shuffle, meta={"source": "jsonl_mcq", "line": line,
                                                "support": f["passage"],
                                                "row_meta": f["row_meta"]})
        for pid, line, f in rows
    ]
    return mcq.McqTask(name="jsonl_mcq", splits=_splits(probs, held), prompt_style=prompt_style,
                       include_support=include_support)


def load_jsonl_code(
    path: str | Path, *, valid_fraction: float = 0.1, valid_size: int = 0, split_seed: int = 42,
) -> code_mod.CodeTask:
    """Code problems from a JSONL file (schema in ``jsonl_schema``)."""
    rows, held = _load("jsonl_code", path, valid_fraction, valid_size, split_seed)
    probs = []
    for pid, line, f in rows:
        text = f["prompt"]
        entry = f["entry_point"]
        name = re.escape(entry)
        if entry and not re.search(rf"\b{name}\s*\(|`{name}`", text):
            text += f"\nThe function should be called `{entry}`."
        meta = {"source": "jsonl_code", "line": line, "test_style": f["test_style"],
                "split_tests": False, "row_meta": f["row_meta"]}
        if entry:
            meta["entry_point"] = entry
        probs.append(Problem(id=pid, question=text, gold=f["spec"], meta=meta))
    return code_mod.CodeTask(name="jsonl_code", splits=_splits(probs, held))


# ----------------------------------------------------------------------------- math

# A string gold that is a number and nothing else (then graded numerically); "1 1/2" and
# LaTeX are text golds: check_numeric_answer reads only the first number of a text.
_NUMERIC_GOLD = re.compile(
    r"^[-+\u2212]?\s?\$?\s?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+)?\s?%?$")
TEXT_ANSWER_LINE = "The answer is"
TEXT_REASONING_SYSTEM_PROMPT = (
    "Solve the problem. Reason step by step, then end your response with a line of the form:\n"
    f"{TEXT_ANSWER_LINE} <answer>.\nWrite the answer exactly, with nothing after it."
)
TEXT_DIRECT_SYSTEM_PROMPT = "Solve the problem. Reply with the final answer only."
_TEXT_MARKER = re.compile(r"final answer is|final answer\s*:|the answer is|answer\s*:", re.I)


def is_numeric_gold(answer: Any) -> bool:
    """True for a JSON number or a string that is only a number (graded numerically)."""
    if is_number(answer):
        return True
    return isinstance(answer, str) and bool(_NUMERIC_GOLD.match(answer.strip()))


def math_gold(answer: Any) -> str:
    """The gold string of a math row: numbers written exactly (0.1 stays 1/10, not the
    binary float), strings as given."""
    if is_number(answer):
        return math_task.format_number(Fraction(repr(answer)))
    return str(answer).strip()


def _boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` with balanced braces, or None."""
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, start = 0, i + len("\\boxed")
    for k in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth == 0:
            return text[start + 1:k]
    return None


def final_text_answer(response: str) -> str | None:
    """The response's final answer as text: the last ``\\boxed{}``, else the last
    ``<answer>`` tag, else the line's rest after the last answer marker; None if none."""
    if not isinstance(response, str):
        return None
    boxed = _boxed(response)
    if boxed is not None:
        return boxed
    ans = mcq.extract_answer(response)
    if ans is not None:
        return ans
    marks = list(_TEXT_MARKER.finditer(response))
    if marks:
        return response[marks[-1].end():].split("\n", 1)[0]
    return None


def normalize_text_answer(s: str) -> str:
    """Case-folded, ``$`` signs and spaces removed, a final period dropped."""
    s = s.strip().rstrip(".").replace("$", "")
    return "".join(s.split()).casefold()


def score_text_answer(response: str, gold: str) -> VerifyResult:
    """Exact-text reward for a non-numeric math gold; never raises."""
    ans = final_text_answer(response)
    if ans is None or not ans.strip():
        return VerifyResult(
            0.0, f"No final answer was found. End your response with a line of the form "
            f"'{TEXT_ANSWER_LINE} <answer>.'", "no_answer", False)
    if normalize_text_answer(ans) == normalize_text_answer(gold):
        return VerifyResult(1.0, "", "correct", True, {"pred": ans})
    shown = ans.strip()
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    return VerifyResult(0.0, clean_text(f'Your final answer "{shown}" is wrong.'),
                        "wrong_answer", True, {"pred": ans})


@dataclass
class JsonlMathTask(math_task.MathTask):
    """``math.MathTask`` whose problems may also have text answers (``meta["numeric"]``
    False): those get a text prompt and exact-text grading."""

    def prompt(self, problem: Problem) -> Messages:
        if problem.meta.get("numeric", True):
            return super().prompt(problem)
        system = (TEXT_REASONING_SYSTEM_PROMPT if self.prompt_style == "reasoning"
                  else TEXT_DIRECT_SYSTEM_PROMPT)
        return [{"role": "system", "content": system},
                {"role": "user", "content": problem.question}]

    def response_prefix(self, problem: Problem) -> str:
        if problem.meta.get("numeric", True):
            return super().response_prefix(problem)
        return f"{TEXT_ANSWER_LINE} " if self.prompt_style == "direct" else ""

    def verify(self, problem: Problem, response_text: str, split: str = "train") -> VerifyResult:
        if problem.meta.get("numeric", True):
            return super().verify(problem, response_text, split)
        try:
            return score_text_answer(response_text, str(problem.gold))
        except Exception as e:  # noqa: BLE001 - never raise into the trainer
            return VerifyResult(0.0, "", f"verifier_error: {type(e).__name__}: {e}", False)


def load_jsonl_math(
    path: str | Path, *, valid_fraction: float = 0.1, valid_size: int = 0, split_seed: int = 42,
    prompt_style: str = "reasoning",
) -> JsonlMathTask:
    """Math problems from a JSONL file (schema in ``jsonl_schema``)."""
    rows, held = _load("jsonl_math", path, valid_fraction, valid_size, split_seed)
    probs = [
        Problem(id=pid, question=f["question"], gold=math_gold(f["answer"]),
                meta={"source": "jsonl_math", "line": line,
                      "numeric": is_numeric_gold(f["answer"]), "row_meta": f["row_meta"]})
        for pid, line, f in rows
    ]
    return JsonlMathTask(name="jsonl_math", splits=_splits(probs, held),
                         prompt_style=prompt_style)
