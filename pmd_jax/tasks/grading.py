"""Running a candidate program against a problem's tests, with a verdict the program cannot forge.

The candidate is untrusted: it runs only in the sandbox (``sandbox.py``), under the harness
``code_runner.py``. Expected outputs never enter the sandbox and no verdict is ever read from
it. By test kind:

- ``stdin`` and ``call``: the harness runs each test in a forked child and reports the
  program's stdout or the call's return value (JSON); the host compares them with the expected
  output. Whatever the program writes can only change what it "answered".
- ``code`` (assert-style tests: MBPP's asserts, HumanEval's ``check(candidate)``): the
  trusted test code runs HERE, in the host process, never in the sandbox. The sandbox runs a
  *solution server* (``code_runner.serve``): it executes the program once, then answers the
  host's requests to look up a global of the program, call it, or get or set an attribute of
  an object it returned. Every name that the test code reads and that trusted code does not
  define (builtins, the test's own imports and definitions, the problem's trusted prefix such
  as HumanEval's prompt with its helper functions, the dataset's setup code) is bound to what
  the program defines under that name. The problem's entry point is always the program's.
  Arguments and results cross the boundary as plain data only (``encode_plain`` /
  ``decode_plain``: numbers, strings, bytes, lists, tuples, dicts, sets, None, bool, and the
  stdlib's deque / Fraction / Decimal), decoded here into fresh built-in objects; an object
  of any other type stays in the sandbox and is seen here as an opaque ``Remote`` handle that
  can be passed back, called, or have attributes read and set, but refuses comparison and
  truth tests (a failure with a clear line of feedback). Modules cross by name and are
  imported here from the trusted installation (stdlib and numpy only). So the asserts, the
  comparison operators, ``abs``, ``round``, ``sorted``, ``isinstance``, ``AssertionError``
  and the verdict all live in the host, out of the program's reach: walking its own stack,
  patching builtins, writing fake records to any descriptor or exiting early changes nothing
  but the values it returns. A program that dies, exits or times out during a call fails
  that test (and the rest are reported as not run).

Trust boundary of the test code itself: dataset test code (HumanEval, MBPP, a user's JSONL)
is trusted like the config file and runs in the verifying thread; each test has its own
namespace, and its calls into the sandbox are bounded by the test's time limit. A test that
loops forever in its own code (not in a call) is not interrupted. Unseeded ``random`` in
test code draws from the host's global ``random`` state, which pmd_jax does not use.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dataclasses
import functools
import importlib
import json
import marshal
import os
import re
import secrets
import select
import sys
import time
from collections.abc import Sequence
from importlib import resources

from pmd_jax.tasks import code_runner, sandbox

MAX_WALL_S = 120.0
MAX_FRAME = 64 << 20  # bytes of one answer from the sandbox
ERR_LIMIT = code_runner.ERR_LIMIT
# modules a program may hand to the test code by name (imported here, never the program's)
_IMPORTABLE = frozenset(sys.stdlib_module_names) | {"numpy"}


# ----------------------------------------------------------------------------- harness


@functools.cache
def _runner_source() -> str:
    return resources.files("pmd_jax.tasks").joinpath("code_runner.py").read_text("utf-8")


_RUNNER_LOADER = (
    "import marshal, os\n"
    "exec(marshal.loads(open(os.path.join(os.path.dirname(__file__), 'runner.bin'), 'rb')"
    ".read()))\n"
)


@functools.cache
def _runner_code() -> bytes:
    return marshal.dumps(compile(_runner_source(), "code_runner.py", "exec"))


def _site_paths() -> list[str]:
    import site

    return [p for p in site.getsitepackages() if os.path.isdir(p)]


def _harness(backend: str) -> tuple[str, dict[str, str | bytes]]:
    """(main script, extra files) of the test harness for a backend."""
    if sandbox.interpreter_for(backend) == sandbox.python_executable():
        # same interpreter inside: ship the compiled harness, skip compiling it per program
        return _RUNNER_LOADER, {"runner.bin": _runner_code()}
    return _runner_source(), {}


def make_pool(size: int, backend: str | None = None) -> sandbox.WarmPool:
    """Pre-started harness sandboxes (the payload goes in on stdin, length first)."""
    b = backend or sandbox.detect_backend()
    script, files = _harness(b)
    return sandbox.WarmPool(
        script, files, sandbox.Limits(cpu_s=MAX_WALL_S, wall_s=MAX_WALL_S), size=size, backend=b
    )


def _framed(payload: dict) -> bytes:
    data = marshal.dumps(payload)
    return len(data).to_bytes(8, "big") + data


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
        "sys_path": _site_paths(),
        "max_timeouts": 1,
        # per-test stdout cap: enough to compare with the expected output, no more
        "max_output": [max(1 << 16, 2 * len(str(tests["outputs"][i])) + 1024) for i in indices],
    }
    wall = min(max_wall_s, len(inputs) * (t_lim + 0.3) + 5.0)
    out_cap = min(256 << 20, sum(payload["max_output"]) * 2 + (1 << 20))
    if pool is not None and limits is None:
        lim = dataclasses.replace(pool.limits, wall_s=wall, output_bytes=out_cap)
        res = pool.run(_framed(payload), lim, done_marker=nonce.encode())
    else:
        lim = limits or sandbox.Limits(cpu_s=wall, wall_s=wall, output_bytes=out_cap)
        b = backend or sandbox.detect_backend()
        script, files = _harness(b)
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


# ----------------------------------------------------------------------------- asserts


class SolutionFailed(Exception):
    """The solution's process cannot answer: it exited, broke the protocol or timed out."""


class SolutionTimeout(SolutionFailed):
    pass


class SolutionRaised(Exception):
    """The solution raised an exception that is not a built-in exception type."""


class NotPlainData(TypeError):
    pass


class Remote:
    """An object that stays in the sandbox (a function of the program, or a non-plain value
    it returned). It can be called, passed back, and have attributes read and set; it cannot
    be compared or truth-tested here."""

    __slots__ = ("_session", "_handle", "_type")

    def __init__(self, session: _Session, handle: int, type_name: str):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_type", type_name)

    def __call__(self, *args, **kwargs):
        return self._session.request(
            {
                "op": "call",
                "h": self._handle,
                "args": self._session.encode(list(args)),
                "kwargs": self._session.encode(dict(kwargs)),
            }
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._session.request({"op": "get", "h": self._handle, "name": name})

    def __setattr__(self, name: str, value) -> None:
        self._session.request(
            {"op": "set", "h": self._handle, "name": name, "value": self._session.encode(value)}
        )

    def _refuse(self, *_a, **_k):
        raise NotPlainData(
            f"the solution returned a {self._type} object; only built-in data types "
            "(numbers, strings, lists, tuples, dicts, sets, None) are compared"
        )

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __bool__ = __len__ = __iter__ = __contains__ = __getitem__ = _refuse
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<{self._type} object in the sandbox>"


def _frame(obj) -> bytes:
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    return len(data).to_bytes(4, "big") + data


class _Session:
    """The host end of one solution server: requests out on its stdin, answers on stdout."""

    def __init__(self, st: sandbox._Started):
        self.st = st
        self.rfd = st.proc.stdout.fileno()  # type: ignore[union-attr]
        self.wfd = st.proc.stdin.fileno()  # type: ignore[union-attr]
        self.buf = bytearray()
        self.deadline = time.monotonic() + MAX_WALL_S
        self.calls = 0
        self.dead: str | None = None

    # -- plain data
    def encode(self, v):
        def handle_of(x):
            if isinstance(x, Remote) and x._session is self:
                return {"$": "handle", "v": x._handle}
            raise NotPlainData(
                f"an argument of type {type(x).__name__} cannot be passed to the solution "
                "(only plain data and objects the solution returned)"
            )

        return code_runner.encode_plain(v, handle_of)

    def _decode(self, obj):
        def handle(tag: str, v, type_name: str):
            if tag == "module":
                name = v if isinstance(v, str) else ""
                if name.split(".")[0] not in _IMPORTABLE:
                    raise NotPlainData(f"the solution's module {name[:100]!r} is not available")
                return importlib.import_module(name)
            if type(v) is not int:
                raise ValueError("malformed handle")
            return Remote(self, v, type_name or "object")

        return code_runner.decode_plain(obj, handle)

    # -- wire
    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise self._fail(SolutionTimeout("Time out"))
            _, w, _ = select.select([], [self.wfd], [], left)
            if w:
                try:
                    view = view[os.write(self.wfd, view[:65536]) :]
                except OSError:
                    raise self._fail(SolutionFailed(self._exit_text("during a call"))) from None

    def _recv(self) -> dict:
        need = 4
        while True:
            if len(self.buf) >= 4:
                need = 4 + int.from_bytes(self.buf[:4], "big")
                if need - 4 > MAX_FRAME:
                    raise self._fail(SolutionFailed("the solution's answer is too large"))
                if len(self.buf) >= need:
                    body = bytes(self.buf[4:need])
                    del self.buf[:need]
                    try:
                        msg = json.loads(body)
                    except (ValueError, RecursionError):
                        msg = None
                    if not isinstance(msg, dict):
                        raise self._fail(SolutionFailed("the solution broke the test protocol"))
                    return msg
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise self._fail(SolutionTimeout("Time out"))
            r, _, _ = select.select([self.rfd], [], [], left)
            if not r:
                continue
            chunk = os.read(self.rfd, max(65536, min(need - len(self.buf), MAX_FRAME)))
            if not chunk:
                raise self._fail(SolutionFailed(self._exit_text("during a call")))
            self.buf += chunk

    def _exit_text(self, when: str) -> str:
        rc, _ = sandbox._wait(self.st.proc, 0.5)
        return (
            f"the program exited (status {rc}) {when}"
            if rc is not None
            else (f"the program stopped answering {when}")
        )

    def _fail(self, e: SolutionFailed) -> SolutionFailed:
        self.dead = str(e)
        sandbox._kill_tree(self.st.proc)
        return e

    def request(self, req: dict):
        """Send one request; the decoded answer, or raise what the solution raised."""
        if self.dead is not None:
            raise SolutionFailed(self.dead)
        self.calls += 1
        self._send(_frame(req))
        return self._answer(self._recv())

    def _answer(self, msg: dict):
        if "ok" in msg:
            try:
                return self._decode(msg["ok"])
            except (ValueError, RecursionError) as e:
                raise self._fail(SolutionFailed(f"the solution sent malformed data: {e}")) from None
        err = str(msg.get("err", "error"))[:ERR_LIMIT]
        t = msg.get("type")
        cls = getattr(builtins, t, None) if isinstance(t, str) and t.isidentifier() else None
        if (
            isinstance(cls, type)
            and issubclass(cls, Exception)
            and not issubclass(cls, (StopIteration, StopAsyncIteration, NotPlainData))
        ):
            try:
                exc: Exception = cls(err)
            except Exception:  # noqa: BLE001 - e.g. UnicodeDecodeError wants 5 arguments
                exc = SolutionRaised(err)
        else:
            exc = SolutionRaised(err)
        exc.pmd_solution_trace = err  # type: ignore[attr-defined]
        raise exc


def _free_names(source: str) -> set[str]:
    """Names that ``source`` reads but never binds (candidates for the solution's globals)."""
    tree = ast.parse(source)
    loaded, bound = set(), set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            (loaded if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(n.name)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, ast.alias):
            bound.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)
    return loaded - bound


def _error_text(e: BaseException) -> str:
    trace = getattr(e, "pmd_solution_trace", None)
    return str(trace) if trace else f"{type(e).__name__}: {e}"[:ERR_LIMIT]


def _test_line(e: BaseException, test: str) -> str:
    tb, lineno = e.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<test>":
            lineno = tb.tb_lineno
        tb = tb.tb_next
    lines = test.splitlines()
    return lines[lineno - 1].strip()[:ERR_LIMIT] if lineno and 0 < lineno <= len(lines) else ""


def _single_eq(test: str) -> tuple[ast.expr, ast.expr] | None:
    """(left, right) of a test that is exactly ``assert left == right``."""
    body = ast.parse(test).body
    if (
        len(body) == 1
        and isinstance(body[0], ast.Assert)
        and isinstance(body[0].test, ast.Compare)
        and len(body[0].test.ops) == 1
        and isinstance(body[0].test.ops[0], ast.Eq)
    ):
        return body[0].test.left, body[0].test.comparators[0]
    return None


def _run_one_assert(test: str, ns: dict) -> dict:
    """Run one test's code in ``ns``; a raw report (status ok / fail / error / timeout)."""
    try:
        pair = _single_eq(test)
        if pair is not None:  # show the call, the actual value and the expected one
            left, right = pair
            got = eval(compile(ast.Expression(left), "<test>", "eval"), ns)
            want = eval(compile(ast.Expression(right), "<test>", "eval"), ns)
            shown = {"call": ast.unparse(left)[:ERR_LIMIT], "expected": ast.unparse(right)}
            if isinstance(got, Remote):
                return {"status": "fail", "actual": f"TypeError: {_refusal(got)}", **shown}
            if got == want:
                return {"status": "ok"}
            return {"status": "fail", "actual": repr(got)[:ERR_LIMIT], **shown}
        exec(compile(test, "<test>", "exec"), ns)
        return {"status": "ok"}
    except SolutionTimeout:
        return {"status": "timeout"}
    except AssertionError as e:
        out = {"status": "fail", "actual": f"AssertionError: {e}"[:ERR_LIMIT]}
        line = _test_line(e, test)
        return {**out, "call": line} if line else out
    except BaseException as e:  # noqa: BLE001 - any error of the solution or of a call
        out = {"status": "error", "error": _error_text(e)}
        line = _test_line(e, test)
        return {**out, "call": line} if line else out


def _refusal(r: Remote) -> str:
    try:
        r._refuse()
    except NotPlainData as e:
        return str(e)
    return ""


def _acquire(
    pool: sandbox.WarmPool | None, backend: str | None, limits: sandbox.Limits | None
) -> sandbox._Started:
    if pool is not None and limits is None:
        return pool.acquire()
    b = backend or sandbox.detect_backend()
    script, files = _harness(b)
    lim = limits or sandbox.Limits(cpu_s=MAX_WALL_S, wall_s=MAX_WALL_S)
    return sandbox._start(script, files, None, lim, b, ("-I", "-S"))


def run_assert_tests(
    program: str,
    tests: dict,
    indices: Sequence[int],
    *,
    trusted_prefix: str = "",
    limits: sandbox.Limits | None = None,
    backend: str | None = None,
    max_wall_s: float = MAX_WALL_S,
    pool: sandbox.WarmPool | None = None,
) -> tuple[list[dict], sandbox.ExecResult]:
    """Raw reports of assert-style tests, computed in this process (see the module doc)."""
    t_lim = float(tests["time_limit"])
    t0 = time.monotonic()
    try:
        st = _acquire(pool, backend, limits)
    except (OSError, sandbox.SandboxError) as e:
        why = f"sandbox failed to start: {e}"
        return [], sandbox.ExecResult("sandbox_error", None, b"", b"", why, 0.0, "")
    sess = _Session(st)
    stop_at = t0 + max_wall_s
    raw: list[dict] = []
    status, reason = "ok", "completed"
    try:
        sess.deadline = min(stop_at, time.monotonic() + t_lim + 1.0)
        sess._send(_framed({"kind": "serve", "program": program, "sys_path": _site_paths()}))
        fn = str(tests.get("fn_name") or "")
        base: dict = {"__builtins__": builtins, "__name__": "__test__"}
        if trusted_prefix:
            exec(compile(trusted_prefix, "<prefix>", "exec"), base)
        try:
            sess._answer(sess._recv())  # the program ran
            load_error = None
        except SolutionTimeout:
            load_error = {"status": "timeout"}
        except BaseException as e:  # noqa: BLE001
            load_error = {"status": "error", "error": _error_text(e)}
        if load_error is None:
            names = set().union(*(_free_names(tests["inputs"][i]) for i in indices))
            if tests.get("setup"):
                names |= _free_names(tests["setup"])
            names = {n for n in names if n not in base and not hasattr(builtins, n)}
            if fn:
                names.add(fn)
                base.pop(fn, None)  # the entry point is always the program's
            for name in sorted(names):
                value = _name_lookup(sess, name)
                if value is not _MISSING:
                    base[name] = value
        for i in indices:
            if load_error is not None:
                raw.append(dict(load_error))
                if load_error["status"] == "timeout":
                    break
                continue
            sess.deadline = min(stop_at, time.monotonic() + t_lim)
            ns = dict(base)
            if tests.get("setup"):
                rep = _run_one_assert(tests["setup"], ns)
                if rep["status"] != "ok":
                    raw.append(rep)
                    continue
            rep = _run_one_assert(str(tests["inputs"][i]), ns)
            raw.append(rep)
            if rep["status"] == "timeout":
                break
    except SolutionTimeout:
        status, reason = "timeout", f"wall-clock limit of {max_wall_s:g}s exceeded"
    except SolutionFailed as e:
        status, reason = "error", str(e)
    finally:
        err = b""
        with contextlib.suppress(OSError, ValueError):
            os.set_blocking(st.proc.stderr.fileno(), False)  # type: ignore[union-attr]
            err = st.proc.stderr.read(8192) or b""  # type: ignore[union-attr]
        sandbox._cleanup(st)
    res = sandbox.ExecResult(
        status,
        st.proc.returncode,
        b"",
        err,
        reason,
        time.monotonic() - t0,
        st.backend,
        {"calls": sess.calls},
    )
    return raw, res


_MISSING = object()


def _name_lookup(sess: _Session, name: str):
    if sess.dead is not None:
        raise SolutionFailed(sess.dead)
    sess.calls += 1
    sess._send(_frame({"op": "name", "name": name}))
    msg = sess._recv()
    return _MISSING if msg.get("missing") else sess._answer(msg)


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
