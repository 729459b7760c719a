"""Mutation testing of the memory path and the losses with mutmut (not in CI: too slow for 2
cores). For each target file of ``[tool.pmd_jax.mutation.targets]`` in pyproject.toml, a
scratch copy of the repository gets a ``[tool.mutmut]`` config that mutates that file only
(the rest of the package is copied unmutated) and runs the target's tests; the survivors are
printed and every result is written to ``<out>/<target>.json``.

    pip install -e ".[mutation]"
    python scripts/mutation.py                                   # every target
    python scripts/mutation.py pmd_jax/memory/verify.py          # one file
    python scripts/mutation.py pmd_jax/memory/verify.py \\
        --only 'pmd_jax.memory.verify.x_paired_effect*'            # some functions
    mutmut show NAME  (in the scratch folder printed for the target)    # one mutant's diff

docs/mutation.md holds the last run's counts and its survivors, each explained or killed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# mutmut's command, as its console script runs it: ``python -m mutmut`` would load its module
# twice (as __main__, and again from the mutants' trampolines, whose second
# multiprocessing.set_start_method raises "context has already been set")
MUTMUT = [sys.executable, "-c", "import sys; from mutmut.__main__ import cli; "
          "sys.argv[0] = 'mutmut'; cli()"]
COPY = ("pmd_jax", "tests", "configs", "pyproject.toml")


def targets() -> dict[str, list[str]]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(cfg["tool"]["pmd_jax"]["mutation"]["targets"])


def _toml_list(xs: list[str]) -> str:
    return "[" + ", ".join(json.dumps(x) for x in xs) + "]"


def prepare(target: str, tests: list[str], scratch: Path) -> None:
    """A copy of the repo whose [tool.mutmut] mutates ``target`` alone with ``tests``."""
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, scratch / name, ignore=ignore)
        else:
            shutil.copy(src, scratch / name)
    others = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "pmd_jax").rglob("*.py")
                    if str(p.relative_to(ROOT)) != target)
    if len(others) == sum(1 for _ in (ROOT / "pmd_jax").rglob("*.py")):
        raise SystemExit(f"mutation: {target} is not a file of pmd_jax/")
    py = scratch / "pyproject.toml"
    text = py.read_text()
    text += ("\n[tool.mutmut]\n"
             'paths_to_mutate = ["pmd_jax/"]\n'
             f"do_not_mutate = {_toml_list(others)}\n"
             f"tests_dir = {_toml_list(tests)}\n"
             'also_copy = ["configs/"]\n')
    py.write_text(text)


def run_target(target: str, tests: list[str], out: Path, only: list[str] | None,
               children: int) -> dict:
    scratch = out / "scratch" / target.replace("/", "__").removesuffix(".py")
    prepare(target, tests, scratch)
    # the scratch copy's pmd_jax, not the checkout's; jax.jit off: mutmut forks every mutant's
    # run from one process, whose jit caches would otherwise serve the unmutated function's
    # compiled program to every mutant of a jitted function (false survivors)
    env = {**os.environ, "PYTHONPATH": "", "JAX_DISABLE_JIT": "1"}
    t0 = time.monotonic()
    cmd = [*MUTMUT, "run", f"--max-children={children}"]
    if only:
        cmd.extend(only)
    print(f"[mutation] {target}: mutmut {' '.join(cmd[len(MUTMUT):])} in {scratch}",
          flush=True)
    p = subprocess.run(cmd, cwd=scratch, env=env, text=True, capture_output=True)
    seconds = time.monotonic() - t0
    if p.returncode:
        print(p.stdout[-4000:], p.stderr[-4000:], sep="\n")
        raise SystemExit(f"mutation: mutmut failed on {target} (exit {p.returncode})")
    res = subprocess.run([*MUTMUT, "results", "--all=true"],
                         cwd=scratch, env=env, text=True, capture_output=True)
    status: dict[str, str] = {}
    for line in res.stdout.splitlines():
        name, sep, state = line.strip().rpartition(": ")
        if sep and name:
            status[name] = state
    counts: dict[str, int] = {}
    for state in status.values():
        counts[state] = counts.get(state, 0) + 1
    survivors = sorted(n for n, st in status.items() if st == "survived")
    diffs = {}
    for name in survivors:
        d = subprocess.run([*MUTMUT, "show", name], cwd=scratch,
                           env=env, text=True, capture_output=True).stdout
        diffs[name] = d
    report = {"target": target, "tests": tests, "only": only, "seconds": round(seconds, 1),
              "counts": counts, "total": len(status), "survivors": diffs,
              "scratch": str(scratch)}
    (out / f"{scratch.name}.json").write_text(json.dumps(report, indent=1))
    print(f"[mutation] {target}: {len(status)} mutants {counts} in {seconds:.0f}s; "
          f"survivors: {len(survivors)}", flush=True)
    for name in survivors:
        print(f"  {name}")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="*", help="target files (default: every configured one)")
    ap.add_argument("--only", action="append",
                    help="mutmut's mutant name glob (repeatable), e.g. "
                         "'pmd_jax.memory.verify.x_paired_effect*'")
    ap.add_argument("--out", default=str(ROOT / "runs" / "mutation"), help="results folder")
    ap.add_argument("--max-children", type=int, default=1, help="parallel mutants")
    a = ap.parse_args(argv)
    table = targets()
    chosen = a.targets or list(table)
    unknown = [t for t in chosen if t not in table]
    if unknown:
        ap.error(f"not configured in [tool.pmd_jax.mutation.targets]: {unknown}")
    try:
        import mutmut  # noqa: F401
    except ImportError:
        ap.error('mutmut is not installed: pip install -e ".[mutation]"')
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(chosen, 1):
        print(f"[mutation] target {i}/{len(chosen)}", flush=True)
        run_target(t, table[t], out, a.only, a.max_children)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
