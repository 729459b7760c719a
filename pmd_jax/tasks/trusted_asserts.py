"""Assert-style tests graded in the host: the trusted side of ``grading.py``'s design.

The sandbox runs the solution server (``code_runner.serve``); here a ``_Session`` sends it
requests and decodes its plain-data answers, ``Remote`` stands for an object that stays in
the sandbox, and ``run_assert_tests`` runs the dataset's test code in this process with the
program's names bound to what the server answers. See ``grading.py`` for the whole design.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib
import json
import os
import select
import sys
import threading
import time
from collections.abc import Sequence

from pmd_jax.tasks import code_runner, sandbox
from pmd_jax.tasks.harness import MAX_WALL_S, framed, harness, site_paths
from pmd_jax.tasks.sandbox import process

MAX_FRAME = 64 << 20  # bytes of one answer from the sandbox
ERR_LIMIT = code_runner.ERR_LIMIT
# modules a program may hand to the test code by name (imported here, never the program's)
_IMPORTABLE = frozenset(sys.stdlib_module_names) | {"numpy"}


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

    def __init__(self, st: process.Started):
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
        rc, _ = process.wait(self.st.proc, 0.5)
        return (
            f"the program exited (status {rc}) {when}"
            if rc is not None
            else (f"the program stopped answering {when}")
        )

    def _fail(self, e: SolutionFailed) -> SolutionFailed:
        self.dead = str(e)
        process.kill_tree(self.st.proc)
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


# CPython 3.11 keeps the recursion depth of its AST <-> Python-object conversion in one
# interpreter-wide slot (the state behind cpython gh-106905), so ``ast.parse`` or
# ``compile(<AST object>)`` in two of verify_batch's threads at once can fail with
# "SystemError: AST constructor recursion depth mismatch" (seen: a canonical HumanEval
# solution graded 0). Every conversion of ours holds this lock; compiling source text and
# running the code do not need it.
_AST_LOCK = threading.Lock()


def _parse(source: str) -> ast.Module:
    with _AST_LOCK:
        return ast.parse(source)


def _compile_expr(node: ast.expr):
    with _AST_LOCK:
        return compile(ast.Expression(node), "<test>", "eval")


def _free_names(source: str) -> set[str]:
    """Names that ``source`` reads but never binds (candidates for the solution's globals)."""
    tree = _parse(source)
    loaded: set[str] = set()
    bound: set[str] = set()
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
    body = _parse(test).body
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
            got = eval(_compile_expr(left), ns)
            want = eval(_compile_expr(right), ns)
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
) -> process.Started:
    if pool is not None and limits is None:
        return pool.acquire()
    b = backend or sandbox.detect_backend()
    script, files = harness(b)
    lim = limits or sandbox.Limits(cpu_s=MAX_WALL_S, wall_s=MAX_WALL_S)
    return process.start(script, files, None, lim, b, ("-I", "-S"))


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
        sess._send(framed({"kind": "serve", "program": program, "sys_path": site_paths()}))
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
        process.cleanup(st)
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
