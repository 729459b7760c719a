"""Running a candidate program against a problem's tests, with a verdict the program cannot forge.

The candidate is untrusted: it runs only in the sandbox (``sandbox/``), under the harness
``code_runner.py``. Expected outputs never enter the sandbox and no verdict is ever read from
it. By test kind:

- ``stdin`` and ``call``: the harness runs each test in a forked child and reports the
  program's stdout or the call's return value (JSON); the host compares them with the expected
  output. Whatever the program writes can only change what it "answered".
- ``code`` (assert-style tests: MBPP's asserts, HumanEval's ``check(candidate)``): the
  trusted test code runs in the host process (``trusted_asserts.py``), never in the sandbox.
  The sandbox runs a *solution server* (``code_runner.serve``): it executes the program
  once, then answers the host's requests to look up a global of the program, call it, or get
  or set an attribute of an object it returned. Every name that the test code reads and that
  trusted code does not define (builtins, the test's own imports and definitions, the
  problem's trusted prefix such as HumanEval's prompt with its helper functions, the
  dataset's setup code) is bound to what the program defines under that name. The problem's
  entry point is always the program's. Arguments and results cross the boundary as plain
  data only (``encode_plain`` / ``decode_plain``: numbers, strings, bytes, lists, tuples,
  dicts, sets, None, bool, and the stdlib's deque / Fraction / Decimal), decoded here into
  fresh built-in objects; an object of any other type stays in the sandbox and is seen here
  as an opaque ``Remote`` handle that can be passed back, called, or have attributes read
  and set, but refuses comparison and truth tests (a failure with a clear line of feedback).
  Modules cross by name and are imported here from the trusted installation (stdlib and
  numpy only). So the asserts, the comparison operators, ``abs``, ``round``, ``sorted``,
  ``isinstance``, ``AssertionError`` and the verdict all live in the host, out of the
  program's reach: walking its own stack, patching builtins, writing fake records to any
  descriptor or exiting early changes nothing but the values it returns. A program that
  dies, exits or times out during a call fails that test (and the rest are reported as not
  run).

Trust boundary of the test code itself: dataset test code (HumanEval, MBPP, a user's JSONL)
is trusted like the config file and runs in the verifying thread; each test has its own
namespace, and its calls into the sandbox are bounded by the test's time limit. A test that
loops forever in its own code (not in a call) is not interrupted. Unseeded ``random`` in
test code draws from the host's global ``random`` state, which pmd_jax does not use.
"""

from __future__ import annotations

import dataclasses
import json
import marshal
import re
import secrets
from collections.abc import Sequence

from pmd_jax.tasks import sandbox
from pmd_jax.tasks.harness import MAX_WALL_S, framed, harness, make_pool, site_paths
from pmd_jax.tasks.trusted_asserts import run_assert_tests

__all__ = ["MAX_WALL_S", "make_pool", "run_tests"]


# ----------------------------------------------------------------------------- stdin / call


def _run_harness(
    program: str,
    tests: dict,
    indices: Sequence[int],
    limits: sandbox.Limits | None,
    backend: str | None,
    max_wall_s: float,
    pool: sandbox.WarmPool | None,
) -> tuple[list, sandbox.ExecResult]:
    """Raw per-test reports of the in-sandbox harness (stdin and call kinds)."""
    t_lim = float(tests["time_limit"])
    inputs = [tests["inputs"][i] for i in indices]
    nonce = secrets.token_hex(16)
    if tests.get("setup"):
        program = program + "\n\n" + tests["setup"] + "\n"
    payload = {
        "program": program,
        "kind": tests["kind"],
        "tests": inputs,
        "fn_name": tests.get("fn_name", ""),
        "timeout": t_lim,
        "nonce": nonce,
        "sys_path": site_paths(),
        "max_timeouts": 1,
        # per-test stdout cap: enough to compare with the expected output, no more
        "max_output": [max(1 << 16, 2 * len(str(tests["outputs"][i])) + 1024) for i in indices],
    }
    wall = min(max_wall_s, len(inputs) * (t_lim + 0.3) + 5.0)
    out_cap = min(256 << 20, sum(payload["max_output"]) * 2 + (1 << 20))
    if pool is not None and limits is None:
        lim = dataclasses.replace(pool.limits, wall_s=wall, output_bytes=out_cap)
        res = pool.run(framed(payload), lim, done_marker=nonce.encode())
    else:
        lim = limits or sandbox.Limits(cpu_s=wall, wall_s=wall, output_bytes=out_cap)
        b = backend or sandbox.detect_backend()
        script, files = harness(b)
        files = {**files, "payload.bin": marshal.dumps(payload)}
        res = sandbox.run_python(script, files=files, limits=lim, backend=b)
    raw: list = []
    for line in res.stdout.decode("utf-8", "replace").splitlines():
        if line.startswith(nonce):
            try:
                got = json.loads(line[len(nonce) :])
            except ValueError:
                got = []
            raw = got if isinstance(got, list) else []
    return raw, res


# ----------------------------------------------------------------------------- records


def run_tests(
    program: str,
    tests: dict,
    indices: Sequence[int],
    *,
    limits: sandbox.Limits | None = None,
    backend: str | None = None,
    max_wall_s: float = MAX_WALL_S,
    pool: sandbox.WarmPool | None = None,
    trusted_prefix: str = "",
) -> tuple[list[dict], sandbox.ExecResult | None]:
    """Run the selected tests of ``tests`` against ``program``; per-test records.

    Records carry test_idx, input, expected, actual, passed, kind. Never raises for program
    behaviour; a harness failure (killed tree, output flood) marks every unrun test as a
    runtime error naming the cause. ``trusted_prefix`` is code of the problem (HumanEval's
    prompt) that the assert-style tests may use; it runs on the trusted side.
    """
    kind = tests["kind"]
    if kind == "code":
        raw, res = run_assert_tests(
            program,
            tests,
            indices,
            trusted_prefix=trusted_prefix,
            limits=limits,
            backend=backend,
            max_wall_s=max_wall_s,
            pool=pool,
        )
    else:
        raw, res = _run_harness(program, tests, indices, limits, backend, max_wall_s, pool)
    return _records(kind, tests, indices, raw, res), res


def _passed(kind: str, rec: dict, expected) -> bool:
    if rec.get("status") != "ok":
        return False
    if kind == "stdin":
        return rec.get("stdout", "").split() == str(expected).split()
    if kind == "call":
        val = rec.get("value")
        if val is None:
            return False
        got = json.loads(val)
        try:
            want = json.loads(expected) if isinstance(expected, str) else expected
        except ValueError:
            return str(got) == str(expected)
        return got == want
    return True  # code: the asserts ran in the host without failure


def _shown_call(r: dict, inp, tests: dict):
    shown = r.get("call") or inp
    fn = tests.get("fn_name")
    if fn and isinstance(shown, str):
        shown = re.sub(r"\bcandidate\(", f"{fn}(", shown)
    return shown


def _records(kind: str, tests: dict, indices: Sequence[int], raw: list, res) -> list[dict]:
    records = []
    for j, idx in enumerate(indices):
        inp, exp = tests["inputs"][idx], tests["outputs"][idx]
        if j >= len(raw):
            if raw:
                why = "not run (stopped after an earlier timeout)"
                records.append(_rec(idx, inp, exp, why, False, "skipped"))
                continue
            why = (
                f"the test harness was stopped: {res.reason}"
                if not res.ok
                else "the test harness produced no result"
            )
            if res.stderr:
                why += "\n" + res.stderr.decode("utf-8", "replace").strip()[-300:]
            kind_r = "timeout" if res.status == "timeout" else "error"
            records.append(
                _rec(idx, inp, exp, why if kind_r == "error" else "Time out", False, kind_r)
            )
            continue
        r = raw[j] if isinstance(raw[j], dict) else {"status": "error", "error": "malformed"}
        st = r.get("status")
        if st == "timeout":
            records.append(_rec(idx, inp, exp, "Time out", False, "timeout"))
        elif st == "error":
            shown = _shown_call(r, inp, tests) if kind == "code" else (r.get("call") or inp)
            records.append(_rec(idx, shown, exp, str(r.get("error", "")), False, "error"))
        elif kind == "code":
            if st == "fail":
                shown = _shown_call(r, inp, tests)
                records.append(
                    _rec(idx, shown, r.get("expected"), r.get("actual", ""), False, "wrong")
                )
            else:
                records.append(_rec(idx, inp, None, "All tests pass", st == "ok", "wrong"))
        else:
            try:
                ok = _passed(kind, r, exp)
            except (ValueError, TypeError):
                ok = False
            if kind == "stdin":
                actual = r.get("stdout", "")
            else:
                actual = r.get("value") if r.get("value") is not None else r.get("repr", "")
                if r.get("note"):
                    actual = f"{actual} ({r['note']})"
            records.append(_rec(idx, inp, exp, actual, ok, "wrong"))
    return records


_REC_CHARS = 4096  # records keep at most this much of each field (feedback shows 250)


def _cap(v):
    if isinstance(v, str) and len(v) > _REC_CHARS:
        return v[:_REC_CHARS] + f"... ({len(v) - _REC_CHARS} more characters)"
    return v


def _rec(idx, inp, exp, actual, passed, kind) -> dict:
    return {
        "test_idx": idx,
        "input": _cap(inp),
        "expected": _cap(exp),
        "actual": _cap(actual),
        "passed": bool(passed),
        "kind": kind,
    }
