"""Trusted grading (pmd_jax/tasks/grading.py): hostile submissions on real MBPP / HumanEval
problems get reward 0 while the dataset's canonical solutions get 1, and only plain data
crosses the sandbox boundary."""

from __future__ import annotations

import collections
import decimal
import fractions
import json

import pytest

from pmd_jax.tasks.code_runner import decode_plain, encode_plain
from pmd_jax.tasks.grading import run_tests
from tests.tasks.test_tasks_code import fence


def _by_id(task, ids):
    probs = {p.id: p for p in task.problems("all")}
    return [probs[i] for i in ids]


# Each hack defines the entry point {fn} with the wrong behaviour and tries to make the grader
# report a pass anyway. Against the old harness (asserts run inside the sandboxed process)
# STACK (on all but mbpp/367), FORGE_FDS (on all four) and BUILTINS_NUMERIC (on HumanEval/4)
# were graded as passes.

STACK = """
import gc, sys
def _patch():
    ok = lambda *a, **k: {{"status": "ok"}}
    f = sys._getframe()
    while f is not None:
        g = f.f_globals
        for name in list(g):
            if name.startswith("_") and callable(g[name]) and name not in ("_patch",):
                if name in ("_run_code_test", "_explain_assert", "_check_plain", "_run_one",
                            "_answer", "decode_plain", "encode_plain", "_short_trace"):
                    g[name] = ok
        f = f.f_back
    for o in gc.get_objects():
        if isinstance(o, dict) and o.get("status") in ("fail", "error", "timeout"):
            o["status"] = "ok"
_patch()
def {fn}(*args, **kwargs):
    _patch()
    return None
"""

FORGE_FDS = """
import json, marshal, os, sys
def _forge():
    nonce = ""
    f = sys._getframe()
    while f is not None:
        for v in list(f.f_locals.values()) + list(f.f_globals.values()):
            if isinstance(v, dict) and isinstance(v.get("nonce"), str):
                nonce = v["nonce"]
        f = f.f_back
    line = (nonce + json.dumps([{{"status": "ok"}}] * 64) + "\\n").encode()
    body = json.dumps({{"ok": True}}).encode()
    frames = (len(body).to_bytes(4, "big") + body) * 64
    for fd in range(256):
        for data in (marshal.dumps({{"status": "ok"}}), line, frames):
            try:
                os.write(fd, data)
            except OSError:
                pass
    os._exit(0)
_forge()
def {fn}(*args, **kwargs):
    _forge()
"""

BUILTINS = """
import builtins
class _NotAnAssertionError(Exception):
    pass
builtins.AssertionError = _NotAnAssertionError
builtins.isinstance = lambda *a: True
builtins.abs = lambda x: 0
builtins.round = lambda *a, **k: 0
builtins.sorted = lambda *a, **k: []
def {fn}(*args, **kwargs):
    return 0.0
"""

# the numeric builtins alone (patching isinstance too broke the old harness's own checks)
BUILTINS_NUMERIC = """
import builtins
builtins.abs = lambda x: 0
builtins.round = lambda *a, **k: 0
builtins.sorted = lambda *a, **k: []
def {fn}(*args, **kwargs):
    return 0.0
"""

EQUALS_ALL = """
class _Any:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = None
class _Str(str):
    def __eq__(self, other):
        return True
    __hash__ = str.__hash__
_calls = [0]
def {fn}(*args, **kwargs):
    _calls[0] += 1
    return _Any() if _calls[0] % 2 else _Str("")
"""

EXIT_MIDWAY = """
import os
_calls = [0]
def {fn}(*args, **kwargs):
    _calls[0] += 1
    if _calls[0] >= 2:
        os._exit(0)
    return None
"""

HACKS = {
    "stack": STACK,
    "forge_fds": FORGE_FDS,
    "builtins": BUILTINS,
    "builtins_numeric": BUILTINS_NUMERIC,
    "equals_all": EQUALS_ALL,
    "exit_midway": EXIT_MIDWAY,
}


@pytest.mark.parametrize("name", sorted(HACKS))
def test_hostile_submissions_get_zero(name, humaneval, mbpp):
    he = _by_id(humaneval, ["HumanEval/0", "HumanEval/4"])
    mb = _by_id(mbpp, ["mbpp/11", "mbpp/367"])
    for task, probs, canon in (
        (humaneval, he, lambda p: p.meta["program_prefix"] + p.meta["reference"]),
        (mbpp, mb, lambda p: p.meta["reference"]),
    ):
        fns = [p.meta.get("entry_point") or p.gold["fn_name"] for p in probs]
        hostile = [fence(HACKS[name].format(fn=fn)) for fn in fns]
        good = [fence(canon(p)) for p in probs]
        res = task.verify_batch(probs + probs, good + hostile, "validation")
        n = len(probs)
        assert [r.reward for r in res[:n]] == [1.0] * n, [
            (p.id, r.reason, r.feedback, r.details) for p, r in zip(probs, res[:n], strict=True)
        ]
        assert [r.reward for r in res[n:]] == [0.0] * n, [
            (p.id, r.reason) for p, r in zip(probs, res[n:], strict=True)
        ]
        for r in res[n:]:
            assert r.feedback  # the model is told why


def test_non_plain_results_fail_with_a_clear_line(mbpp):
    p = _by_id(mbpp, ["mbpp/11"])[0]
    r = mbpp.verify(p, fence("def remove_Occ(s, ch):\n    return object()"), "validation")
    assert r.reward == 0.0 and r.reason == "wrong_answer", (r.reason, r.feedback, r.details)
    assert "only built-in data types" in r.feedback and "object" in r.feedback


def test_tests_use_trusted_helpers_and_solution_objects(humaneval, mbpp):
    # HumanEval/32 checks with the prompt's own poly(); mbpp/367 builds trees of the
    # solution's Node class in its setup code; mbpp/18's tests call a function that is not
    # the first one the reference defines.
    probs = _by_id(humaneval, ["HumanEval/32", "HumanEval/38"])
    res = humaneval.verify_batch(
        probs,
        [fence(p.meta["program_prefix"] + p.meta["reference"]) for p in probs],
        "validation",
    )
    assert [r.reward for r in res] == [1.0, 1.0], [r.feedback for r in res]
    # a wrong solution that redefines the prompt's helper cannot change the check
    q = probs[0]
    wrong = q.meta["program_prefix"] + "    return 0.0\n\ndef poly(xs, x):\n    return 0\n"
    assert humaneval.verify(q, fence(wrong), "validation").reward == 0.0
    mb = _by_id(mbpp, ["mbpp/367", "mbpp/18"])
    res = mbpp.verify_batch(mb, [fence(p.meta["reference"]) for p in mb], "validation")
    assert [r.reward for r in res] == [1.0, 1.0], [r.feedback for r in res]
    assert "remove_dirty_chars" in mbpp.prompt(mb[1])[-1]["content"]


def test_plain_codec_roundtrip_and_refusals():
    v = {
        "a": [1, 2.5, None, True, float("inf")],
        (1, "x"): frozenset({1, 2}),
        3: {1, 2},
        "b": b"\x00\xff",
        "c": 1 + 2j,
        "d": collections.deque([1]),
        "e": fractions.Fraction(1, 3),
        "f": decimal.Decimal("1.10"),
        "g": collections.Counter("aab"),
        "h": 10**40,
    }
    wire = json.loads(json.dumps(encode_plain(v, None), allow_nan=False))
    back = decode_plain(wire, None)
    assert back == {**v, "g": {"a": 2, "b": 1}}
    assert type(back["g"]) is dict and type(back[(1, "x")]) is frozenset
    with pytest.raises(TypeError):
        encode_plain(object(), None)
    for bad in (
        {"$": "pickle", "v": "x"},
        {"$": "dict", "v": [[[1], 2]]},  # unhashable key
        {"$": "float", "v": "1e999999"},
        {"$": "tuple", "v": "abc"},
        {"$": "fraction", "v": [1, 0]},
        {"x": 1},
    ):
        with pytest.raises(ValueError):
            decode_plain(bad, None)
    deep: list = []
    cur = deep
    for _ in range(200):
        cur.append([])
        cur = cur[0]
    with pytest.raises(ValueError):
        decode_plain(deep, None)


def test_assert_tests_without_pool_and_timeouts():
    tests = {
        "kind": "code",
        "inputs": ["assert f(2) == 4", "assert f(3) == 9", "assert g() is None"],
        "outputs": ["", "", ""],
        "time_limit": 1.0,
        "fn_name": "f",
        "setup": "",
    }
    recs, res = run_tests("def f(x):\n    return x * x\ndef g():\n    pass", tests, [0, 1, 2])
    assert [r["passed"] for r in recs] == [True, True, True], recs
    assert res.extra["calls"] >= 3
    recs, _ = run_tests("def f(x):\n    while x == 3: pass\n    return x * x", tests, [0, 1, 2])
    assert [r["kind"] for r in recs] == ["wrong", "timeout", "skipped"], recs
    assert recs[0]["passed"]
    recs, _ = run_tests("def f(x):\n    return x * x\nraise ValueError('boom')", tests, [0])
    assert recs[0]["kind"] == "error" and "ValueError: boom" in recs[0]["actual"]
    recs, _ = run_tests("def f(x):\n    return x + 1", tests, [0, 1])
    assert not recs[1]["passed"] and recs[1]["actual"] == "4" and recs[1]["expected"] == "9"
