"""The loss's top-K: ``lax.top_k`` against the two-stage top-K (pmd_jax/distill/topk.py).

Two measurements:

* ``--checkpoint DIR`` (a HF checkpoint folder, e.g. the cached Qwen2.5-Coder-0.5B): how the
  top-K winners of a real model's next-token log-probs fall into blocks of the vocabulary, for
  a few short texts (code and prose). For each K it prints the most winners any block of
  ``--block`` holds per row (median, p90, max), contiguous blocks (ids ``[b L, (b+1) L)``) and
  the strided ones the two-stage top-K uses (ids ``b, b + nb, ...``), and the fraction of rows
  whose answer would need the fallback (a block with >= 16 winners).
* timing on this backend: ``lax.top_k`` and ``two_stage_top_k`` on random log-probs
  ``[--rows, --vocab]``, each jitted, the median of ``--repeats`` calls after a warm-up, and
  whether the two-stage call took its fallback. On a GPU this is the figure that matters
  (XLA:GPU sorts the whole row for K > 16); on a CPU both are sorts of rows (XLA:CPU lowers
  the block top-16 to a sort of each block) and ``top_k_impl="auto"`` keeps ``lax.top_k``.

    python benchmarks/bench_topk.py [--checkpoint DIR] [--rows 96] [--vocab 128256] [--k 100]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pmd_jax.distill import topk

TEXTS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n"
    "    def push(self, x):\n        self.items.append(x)\n",
    "The mitochondria is the powerhouse of the cell. Photosynthesis converts light energy into "
    "chemical energy, which is stored in glucose. Which of the following organelles is "
    "responsible for protein synthesis? A) ribosome B) nucleus C) golgi D) lysosome. Answer:",
    "import numpy as np\nimport torch\n\nx = np.zeros((3, 4), dtype=np.float32)\nfor i in "
    "range(10):\n    print(i, x.sum())\n# TODO: fix the bug in the loop below\nwhile True:\n"
    "    break\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his "
    "wife. Every morning he went out in his boat, and every evening he came back with his nets "
    "full of fish, and they were happy.",
)


def model_log_probs(path: str) -> np.ndarray:
    from pmd_jax.models import decoder, hf_io
    from pmd_jax.models.tokenizer import Tokenizer

    cfg, params = hf_io.load_hf_checkpoint(path)
    tok = Tokenizer.from_pretrained(path)
    fwd = jax.jit(lambda p, t, q: decoder.forward(p, t, q, cfg)[0])
    rows = []
    for text in TEXTS:
        ids = np.asarray(tok.hf(text)["input_ids"])[None]
        logits = fwd(params, jnp.asarray(ids), jnp.arange(ids.shape[1])[None])
        rows.append(np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32))))
    return np.concatenate(rows)


def clustering(x: np.ndarray, block: int) -> None:
    vocab = x.shape[-1]
    nb, _ = topk.block_layout(vocab, block)
    print(f"{x.shape[0]} rows, vocabulary {vocab}, {nb} blocks of <= {block}")
    for k in (20, 100):
        idx = np.asarray(lax.top_k(jnp.asarray(x), k)[1])
        cont = np.stack([np.bincount(r // block, minlength=nb) for r in idx]).max(1)
        strd = np.stack([np.bincount(r % nb, minlength=nb) for r in idx]).max(1)
        for name, m in (("contiguous", cont), ("strided", strd)):
            print(f"  K={k} {name:10s} winners in the fullest block: median {np.median(m):.0f}"
                  f" p90 {np.percentile(m, 90):.0f} max {m.max()}; rows with >= "
                  f"{topk.PER_BLOCK}: {np.mean(m >= topk.PER_BLOCK):.1%}")


def timing(rows: int, vocab: int, k: int, repeats: int) -> None:
    x = jax.nn.log_softmax(3.0 * jax.random.normal(jax.random.key(0), (rows, vocab)))
    full = jax.jit(lambda a: lax.top_k(a, k))
    two = jax.jit(lambda a: topk.two_stage_top_k(a, k))
    parts = topk._two_stage_check(x, k, topk.BLOCK, topk.PER_BLOCK)
    fell_back = bool(parts[2]) if parts is not None else None
    times = {}
    for name, f in (("lax.top_k", full), ("two_stage", two)):
        jax.block_until_ready(f(x))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            ts.append(time.perf_counter() - t0)
        times[name] = float(np.median(ts))
    same = all(bool(jnp.all(a == b)) for a, b in zip(full(x), two(x)))
    print(f"backend {jax.default_backend()}, [{rows}, {vocab}], K={k}: lax.top_k "
          f"{times['lax.top_k'] * 1e3:.1f} ms, two_stage {times['two_stage'] * 1e3:.1f} ms "
          f"({times['lax.top_k'] / times['two_stage']:.2f}x); fallback taken: {fell_back}; "
          f"equal: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--block", type=int, default=topk.BLOCK)
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.checkpoint:
        clustering(model_log_probs(args.checkpoint), args.block)
    timing(args.rows, args.vocab, args.k, args.repeats)


if __name__ == "__main__":
    main()
