"""Test harness that runs INSIDE the sandbox (stdlib only; executed as a script, not imported).

Reads ``payload.bin`` (marshal, written by the host, next to this file): the candidate program,
the test inputs (never the expected outputs: the comparison happens in the host), the test
kind, a function name, a per-test timeout and a nonce. Each test runs in a forked child with
its own process group, CPU limit and wall deadline; stdin comes from a file, stdout and stderr
go to files. The child reports through a pipe (marshal); the harness prints one line
``<nonce><json>`` with all records. Start-up cost matters (one harness per program), so the
json, traceback and linecache modules are imported only when needed and JSON output is
written with a small encoder over the C ``_json`` string escaper.

Kinds:
- ``stdin``: the program runs as ``__main__`` with the input on stdin; stdout is returned.
- ``call``: the program is executed, then ``fn_name`` (module level, or a method of
  ``class Solution``) is called with the JSON values of the input lines (or a dict as keyword
  arguments); the JSON of the return value is returned.
- ``code``: the program is executed as ``__main__``, then the test code (asserts). A test that
  is a single ``assert left == right`` is evaluated side by side so the actual value can be
  shown.
"""

import marshal
import os
import resource
import select
import signal
import sys
import time
from _json import encode_basestring_ascii as _enc_str

ERR_LIMIT = 2000


def _no_dump():
    """PR_SET_DUMPABLE 0: processes of our uid (the candidate) cannot read our memory or fds
    through /proc. Uses the C ``_ctypes`` module directly (importing ``ctypes`` costs more)."""
    try:
        import _ctypes

        fn = _ctypes.dlsym(_ctypes.dlopen(None), "prctl")
        _ctypes.call_function(fn, (4, 0, 0, 0, 0))  # PR_SET_DUMPABLE = 4
    except Exception:  # noqa: BLE001
        try:
            import ctypes

            ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
        except Exception:  # noqa: BLE001
            pass


_PROGRAM = [""]


def _dumps(v, depth=0):
    """Minimal JSON encoder (dict, list, tuple, str, int, float, bool, None; repr otherwise)."""
    if depth > 200:
        return _enc_str("<nested too deeply>")
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    t = type(v)
    if t is int:
        return int.__repr__(v)
    if t is float:
        if v != v:
            return "NaN"
        if v in (float("inf"), float("-inf")):
            return "Infinity" if v > 0 else "-Infinity"
        return float.__repr__(v)
    if t is str:
        return _enc_str(v)
    if t is list or t is tuple:
        return "[" + ",".join(_dumps(x, depth + 1) for x in v) + "]"
    if t is dict:
        return (
            "{"
            + ",".join(_enc_str(str(k)) + ":" + _dumps(x, depth + 1) for k, x in v.items())
            + "}"
        )
    return _enc_str(repr(v))


def _short_trace(exc, filename="<solution>", limit=3):
    import linecache
    import traceback

    if filename == "<solution>" and _PROGRAM[0]:
        src = _PROGRAM[0]
        linecache.cache["<solution>"] = (len(src), None, src.splitlines(True), "<solution>")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
    lines = [f"{type(exc).__name__}: {exc}"[:ERR_LIMIT]]
    for f in frames[-limit:]:
        if f.line:
            lines.append(f"  {f.line}")
        lines.append(f"Line {f.lineno} in {f.name} (solution)")
    return "\n".join(lines)


def _jsonable(v, depth=0):
    if depth > 100:
        raise TypeError("value nested too deeply")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x, depth + 1) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x, depth + 1) for k, x in v.items()}
    raise TypeError(f"return value of type {type(v).__name__} is not JSON-like")


def _find_callable(ns, fn_name):
    if fn_name and callable(ns.get(fn_name)):
        return ns[fn_name]
    sol = ns.get("Solution")
    if isinstance(sol, type) and fn_name and hasattr(sol, fn_name):
        return getattr(sol(), fn_name)
    if fn_name:
        raise NameError(f"function {fn_name!r} is not defined by the program")
    funcs = [v for k, v in ns.items() if callable(v) and getattr(v, "__module__", "") == "sol"]
    if not funcs:
        raise NameError("the program defines no function to call")
    return funcs[0]


def _child(payload, test, w_fd):
    program = payload["program"]
    kind = payload["kind"]
    _PROGRAM[0] = program
    msg = {"status": "ok"}
    try:
        if kind == "stdin":
            code = compile(program, "<solution>", "exec")
            ns = {"__name__": "__main__", "__builtins__": __builtins__}
            try:
                exec(code, ns)
            except SystemExit as e:
                if e.code not in (None, 0):
                    msg = {"status": "error", "error": f"SystemExit: {e.code}"}
        elif kind == "call":
            code = compile(program, "<solution>", "exec")
            ns = {"__name__": "sol", "__builtins__": __builtins__}
            exec(code, ns)
            fn = _find_callable(ns, payload.get("fn_name") or "")
            inp = test
            if isinstance(inp, dict):
                result = fn(**inp)
            else:
                import json

                args = [json.loads(line) for line in str(inp).split("\n") if line.strip()]
                result = fn(*args)
            import json

            try:
                msg = {"status": "ok", "value": json.dumps(_jsonable(result))}
            except (TypeError, ValueError) as e:
                msg = {
                    "status": "ok",
                    "value": None,
                    "repr": repr(result)[:ERR_LIMIT],
                    "note": str(e),
                }
        elif kind == "code":
            code = compile(program, "<solution>", "exec")
            ns = {"__name__": "__main__", "__builtins__": __builtins__}
            try:
                exec(code, ns)
            except SystemExit as e:
                raise RuntimeError(
                    f"the program exited (SystemExit: {e.code}) before the tests ran"
                ) from None
            msg = _run_code_test(str(test), ns, payload.get("fn_name") or "")
        else:
            msg = {"status": "error", "error": f"unknown test kind {kind!r}"}
    except BaseException as e:  # noqa: BLE001
        msg = {"status": "error", "error": _short_trace(e)}
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass
    try:
        data = marshal.dumps(msg)
    except ValueError:
        data = marshal.dumps({"status": "error", "error": "unserialisable result"})
    os.write(w_fd, data)
    os.close(w_fd)


_type = type
_builtin_mods = {"builtins", "collections", "fractions", "decimal", "datetime"}
_seqs = (list, tuple, set, frozenset)
_atoms = frozenset(
    {int, float, complex, str, bytes, bool, type(None), type(Ellipsis), type(NotImplemented)}
)


def _check_plain(v, depth=0):
    """Raise TypeError unless ``v`` is built-in data (so ``==`` cannot be faked).

    A returned object with a custom ``__eq__`` (always True) would pass any assert; built-in
    types, the stdlib containers (Counter, OrderedDict, deque, ...), Fraction, Decimal,
    datetime and numpy scalars are accepted, recursively for containers.
    """
    if depth > 100:
        raise TypeError("returned value is nested too deeply")
    t = _type(v)
    if t in _atoms:
        return
    mod = sys.modules.get(getattr(t, "__module__", "") or "")
    trusted = mod is not None and getattr(mod, getattr(t, "__name__", ""), None) is t
    if trusted and t.__module__ in _builtin_mods:
        if isinstance(v, dict):
            for k, x in v.items():
                _check_plain(k, depth + 1)
                _check_plain(x, depth + 1)
        elif isinstance(v, _seqs) or t.__name__ == "deque":
            for x in v:
                _check_plain(x, depth + 1)
        return
    if trusted and t.__module__ == "numpy":
        return
    raise TypeError(
        f"the function returned a {getattr(t, '__name__', t)!s} object; only "
        "built-in data types are compared"
    )


def _guard(fn):
    def guarded(*args, **kwargs):
        out = fn(*args, **kwargs)
        _check_plain(out)
        return out

    guarded.__name__ = getattr(fn, "__name__", "guarded")
    guarded.__wrapped__ = fn
    return guarded


def _guard_entry(ns, fn_name):
    f = ns.get(fn_name) if fn_name else None
    code = getattr(f, "__code__", None)
    if code is not None and code.co_filename == "<solution>":
        ns[fn_name] = _guard(f)


def _run_code_test(test, ns, fn_name=""):
    import ast

    _guard_entry(ns, fn_name)
    tree = ast.parse(test, "<test>")
    body = tree.body
    if (
        len(body) == 1
        and isinstance(body[0], ast.Assert)
        and isinstance(body[0].test, ast.Compare)
        and len(body[0].test.ops) == 1
        and isinstance(body[0].test.ops[0], ast.Eq)
    ):
        left = ast.Expression(body[0].test.left)
        right = ast.Expression(body[0].test.comparators[0])
        try:
            got = eval(compile(left, "<test>", "eval"), ns)
        except BaseException as e:  # noqa: BLE001
            return {"status": "error", "error": _short_trace(e)}
        want = eval(compile(right, "<test>", "eval"), ns)
        try:
            _check_plain(got)
        except TypeError as e:
            return {
                "status": "fail",
                "actual": f"TypeError: {e}"[:ERR_LIMIT],
                "call": ast.unparse(body[0].test.left)[:ERR_LIMIT],
                "expected": ast.unparse(body[0].test.comparators[0])[:ERR_LIMIT],
            }
        if got == want:
            return {"status": "ok"}
        return {
            "status": "fail",
            "actual": repr(got)[:ERR_LIMIT],
            "call": ast.unparse(body[0].test.left)[:ERR_LIMIT],
            "expected": ast.unparse(body[0].test.comparators[0])[:ERR_LIMIT],
        }
    try:
        exec(compile(tree, "<test>", "exec"), ns)
    except AssertionError as e:
        return _explain_assert(e, test)
    except BaseException as e:  # noqa: BLE001
        out = {"status": "error", "error": _short_trace(e)}
        line = _test_line(e, test)
        if line:
            out["call"] = line
        return out
    return {"status": "ok"}


def _test_line(exc, test):
    tb = exc.__traceback__
    lineno = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<test>":
            lineno = tb.tb_lineno
        tb = tb.tb_next
    lines = test.splitlines()
    if lineno and 0 < lineno <= len(lines):
        return lines[lineno - 1].strip()[:ERR_LIMIT]
    return ""


def _explain_assert(exc, test):
    """The failing assert line, and for ``assert a == b`` the actual value of ``a``."""
    out = {"status": "fail", "actual": f"AssertionError: {exc}"[:ERR_LIMIT]}
    tb = exc.__traceback__
    frame = lineno = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<test>":
            frame, lineno = tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
    if frame is None:
        return out
    lines = test.splitlines()
    line = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
    out["call"] = line[:ERR_LIMIT]
    try:
        import ast

        node = ast.parse(line).body[0]
        if (
            isinstance(node, ast.Assert)
            and isinstance(node.test, ast.Compare)
            and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)
        ):
            env = dict(frame.f_globals)
            env.update(frame.f_locals)
            got = eval(compile(ast.Expression(node.test.left), "<test>", "eval"), env)
            out["call"] = ast.unparse(node.test.left)[:ERR_LIMIT]
            out["expected"] = ast.unparse(node.test.comparators[0])[:ERR_LIMIT]
            out["actual"] = repr(got)[:ERR_LIMIT]
    except BaseException:  # noqa: BLE001
        pass
    return out


def _run_one(payload, i, test):
    tmp = os.environ.get("TMPDIR", "/tmp")
    in_path = os.path.join(tmp, f"in{i}")
    out_path = os.path.join(tmp, f"out{i}")
    err_path = os.path.join(tmp, f"err{i}")
    with open(in_path, "w", encoding="utf-8") as f:
        f.write(test if (payload["kind"] == "stdin" and isinstance(test, str)) else "")
    r_fd, w_fd = os.pipe()
    timeout = float(payload["timeout"])
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(r_fd)
            os.close(int(payload["_out_fd"]))  # the host channel stays with the harness
            os.setpgid(0, 0)
            cpu = max(1, int(timeout + 0.999))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
            fd0 = os.open(in_path, os.O_RDONLY)
            fd1 = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            fd2 = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd0, 0)
            os.dup2(fd1, 1)
            os.dup2(fd2, 2)
            for fd in (fd0, fd1, fd2):
                os.close(fd)
            sys.stdin = open(0, encoding="utf-8", errors="replace", closefd=False)
            sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
            sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
            _child(payload, test, w_fd)
        finally:
            os._exit(0)
    os.close(w_fd)
    data = b""
    deadline = t0 + timeout
    timed_out = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        rl, _, _ = select.select([r_fd], [], [], left)
        if not rl:
            continue
        chunk = os.read(r_fd, 65536)
        if not chunk:
            break
        data += chunk
        if len(data) > 1 << 20:
            break
    os.close(r_fd)
    if timed_out:
        for target in (-pid, pid):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
    _, status = os.waitpid(pid, 0)
    try:
        os.killpg(pid, signal.SIGKILL)  # leftovers of the child's group
    except OSError:
        pass
    elapsed = time.monotonic() - t0
    rec = {"elapsed": round(elapsed, 4)}
    if timed_out:
        rec.update(status="timeout")
    else:
        try:
            got = marshal.loads(data) if data else {}
            if not isinstance(got, dict):
                raise ValueError("not a dict")
            rec.update(got)
        except (ValueError, EOFError, TypeError):
            rec.update(status="error", error="the program corrupted the harness channel")
        if not data:
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
            if sig == signal.SIGXCPU or sig == signal.SIGKILL and elapsed >= timeout * 0.9:
                rec.update(status="timeout")
            elif sig == signal.SIGXFSZ:
                rec.update(status="error", error="output limit exceeded (file size limit)")
            elif sig:
                rec.update(status="error", error=f"killed by {signal.Signals(sig).name}")
            elif payload["kind"] == "stdin" and code == 0:
                rec.update(status="ok")  # os._exit(0) after printing is fine for stdin tests
            else:
                rec.update(
                    status="error", error=f"the program exited (status {code}) before reporting"
                )
    caps = payload.get("max_output") or []
    out_cap = int(caps[i]) if i < len(caps) else 1 << 16
    for key, path, cap in (("stdout", out_path, out_cap), ("stderr", err_path, 8192)):
        try:
            with open(path, "rb") as f:
                raw = f.read(cap + 1)
            rec[key] = raw[:cap].decode("utf-8", "replace")
            if len(raw) > cap:
                rec[key + "_truncated"] = True
            os.unlink(path)
        except OSError:
            rec[key] = ""
    try:
        os.unlink(in_path)
    except OSError:
        pass
    return rec


def main():
    _no_dump()
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "payload.bin")
    if os.path.exists(path):
        with open(path, "rb") as f:
            payload = marshal.loads(f.read())
    else:  # a pre-started sandbox: the job arrives on stdin
        payload = marshal.loads(sys.stdin.buffer.read())
    # imported once here rather than in every forked child
    if payload["kind"] == "call":
        import json  # noqa: F401
    elif payload["kind"] == "code":
        import ast  # noqa: F401
    for p in payload.get("sys_path", []):
        if p not in sys.path:
            sys.path.append(p)
    nonce = payload["nonce"]
    out_fd = os.dup(1)
    payload["_out_fd"] = out_fd
    out = os.fdopen(out_fd, "w", encoding="utf-8")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    records = []
    timeouts = 0
    for i, test in enumerate(payload["tests"]):
        rec = _run_one(payload, i, test)
        records.append(rec)
        if rec.get("status") == "timeout":
            timeouts += 1
            if timeouts >= int(payload.get("max_timeouts", 1)):
                break
        if payload.get("stop_on_error") and rec.get("status") == "error":
            break
    out.write(nonce + _dumps(records) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
