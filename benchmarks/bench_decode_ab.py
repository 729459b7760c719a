"""The sampler's decode with and without issue 50's CPU changes, in one process.

Runs ``JaxSampler.generate`` on a config's evaluation prompts (greedy unless the config says
otherwise, its ``eval.max_tokens``) in four variants, each once to compile and then timed:
``new`` (cut batches to their still-going rows, shared prefix prefilled once), ``noprefix``,
``nocut`` and ``before`` (neither). Prints each variant's time, new tokens, prefilled
positions and prefill calls, and how many completions equal the first variant's token for
token. Quote ratios from a quiet machine (``uptime``).

    python benchmarks/bench_decode_ab.py --config configs/qwen25coder05b_mbpp.py --problems 48
    python benchmarks/bench_decode_ab.py --config configs/smollm2_sciq.py --reps 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = {"new": (8, 32), "noprefix": (8, 10**9), "nocut": (10**9, 32),
            "before": (10**9, 10**9)}  # (min_decode_rows, MIN_SHARED_PREFIX)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "smollm2_sciq.py"))
    ap.add_argument("--problems", type=int, default=0,
                    help="N evaluation problems spread over the list (every k-th; 0: all)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()

    from benchmarks.bench_eval import _setup
    from pmd_jax import episode
    from pmd_jax.sampling import jax_sampler

    cfg, task, problems, model, sampler, _ = _setup(args.config)
    if args.problems:
        problems = problems[::max(1, len(problems) // args.problems)][:args.problems]
    prompts = [episode.encode(model, task, p, task.prompt(p))[1] for p in problems]
    sp = episode.sampling_params(cfg.eval, n=1, stop_token_ids=model.stop_token_ids,
                                 purpose="eval", seed_parts=(0,))
    names = [v for v in args.variants.split(",") if v]

    def use(name: str) -> None:
        sampler.min_decode_rows, jax_sampler.MIN_SHARED_PREFIX = VARIANTS[name]

    tokens = {}
    for name in names:  # compile
        use(name)
        tokens[name] = [r.tokens.tolist() for r in sampler.generate(prompts, sp)]
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.reps):
        for name in names:
            use(name)
            t = time.perf_counter()
            sampler.generate(prompts, sp)
            times[name].append(time.perf_counter() - t)
            m = sampler.last_metrics
            print(f"{name}: {times[name][-1]:.1f} s, {m.new_tokens} new tokens, "
                  f"{m.prefill_positions} prefilled positions, {m.prefill_groups} prefill "
                  f"calls", flush=True)
    first = names[0]
    for name in names:
        same = sum(a == b for a, b in zip(tokens[name], tokens[first], strict=True))
        print(f"{name}: best {min(times[name]):.1f} s ({min(times[name]) / min(times[first]):.2f}"
              f"x {first}); same tokens as {first} on {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
