"""One decode step of the in-process JaxSampler against its read-once memory bound.

A decode step must at least read every weight and the rows' K/V cache once. This script
times the step on SmolLM2-135M's shapes (random weights: the cost does not depend on their
values) and measures, in the same process, the read bandwidth of a jitted reduction over a
weights-sized float32 array. It prints the step time, the bytes it must read, the bound
(bytes / bandwidth) and their ratio, the headroom left in the step.

    python benchmarks/bench_decode_bound.py [--rows 4] [--prompt 1400] [--tokens 256]

The step time is (time of a ``--tokens`` call - time of a 1-token call) / (tokens - 1), after
one warm-up call each, so the prefill and compiling are not counted. The defaults are the
shape of the embedded default's memory reflections: 4 rows, prompts of 1,000-1,500 tokens.

What it times is the unconstrained decode (``decode.decode_batch``, the evaluations' path).
The memory's constrained loop runs the same cached forward one token at a time from the host
(``decode.decode_logits``) plus the grammar's host work, so this is its device part. The K/V
bytes count prompt + generated slots only; the sampler's cache is padded to its length
buckets (1,552 slots for 1,400 + 129 here), so the bound is slightly optimistic and the
printed ratio slightly high. The reference is a hardware bound, not a peer implementation:
``bench_sampler.py`` compares the sampler with HF transformers.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_common  # noqa: E402
from pmd_jax.models import decoder  # noqa: E402
from pmd_jax.models.config import preset  # noqa: E402
from pmd_jax.sampling.base import SamplingParams  # noqa: E402
from pmd_jax.sampling.jax_sampler import JaxSampler  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=1400)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--preset", default="smollm2-135m")
    args = ap.parse_args()
    cfg = preset(args.preset)
    params = decoder.init_params(cfg, jax.random.PRNGKey(0))
    sampler = JaxSampler(cfg, params, pad_id=0)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(100, cfg.vocab_size - 100, args.prompt))
               for _ in range(args.rows)]

    def timed(max_tokens: int) -> tuple[float, int]:
        sp = SamplingParams(n=1, temperature=1.0, max_tokens=max_tokens, seed=1)
        sampler.generate(prompts, sp)  # warm-up: compiles
        t = time.perf_counter()
        out = sampler.generate(prompts, sp)
        return time.perf_counter() - t, max(len(r.tokens) for r in out)

    t_one, _ = timed(1)
    t_all, n = timed(args.tokens)
    step = (t_all - t_one) / max(n - 1, 1)

    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    bandwidth = bench_common.jax_read_bandwidth(weights)
    slots = args.prompt + args.tokens
    itemsize = sampler.cache_dtype.itemsize
    kv = args.rows * slots * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
    bound = (weights + kv) / bandwidth
    print(f"{args.preset}, {args.rows} rows x {args.prompt}-token prompts: prefill + 1 token "
          f"{t_one:.2f} s; decode {step * 1e3:.1f} ms/step over {n - 1} steps")
    print(f"read once per step: weights {weights / 1e6:.0f} MB + K/V cache {kv / 1e6:.0f} MB "
          f"at {bandwidth / 1e9:.1f} GB/s (jitted sum) = {bound * 1e3:.1f} ms; "
          f"step / bound = {step / bound:.2f}x")


if __name__ == "__main__":
    main()
