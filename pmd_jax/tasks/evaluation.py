"""Memory-free evaluation: avg@k over a split, several seeds, bootstrap CIs, paired comparison.

Model-agnostic: the caller passes ``generate(conversations, n, seed) -> list[list[str]]`` (n
responses per conversation; sampling settings such as the METHOD.md validation defaults
T=0.6, top-p 0.95 are the caller's). Per-problem results are saved as JSONL, one line per
(problem, seed), so two checkpoints can be compared later from their files.

Statistics (pure numpy):
- score of a problem = mean reward over its k samples and all seeds;
- mean over problems with a percentile bootstrap CI (problems resampled);
- paired comparison of two result sets on their common problems: mean difference, paired
  bootstrap CI and two-sided bootstrap p-value, and the exact two-sided sign test (binomial,
  ties dropped).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pmd_jax.run import paths
from pmd_jax.tasks.base import Messages, Problem, Task

GenerateFn = Callable[[list[Messages], int, int], list[list[str]]]


@dataclass
class EvalResult:
    name: str
    records: list[dict]  # one per (problem, seed): problem_id, seed, rewards, reasons
    n_boot: int = 10_000
    boot_seed: int = 0
    summary: dict = field(default_factory=dict)
    # The problems were also training problems (eval.allow_in_sample): every number of this
    # result is labelled "in-sample" (IN_SAMPLE) in its summary and the report.
    in_sample: bool = False

    def problem_scores(self) -> dict[str, float]:
        acc: dict[str, list[float]] = {}
        for r in self.records:
            acc.setdefault(r["problem_id"], []).extend(float(x) for x in r["rewards"])
        return {pid: float(np.mean(v)) for pid, v in acc.items() if v}

    def seed_scores(self) -> dict[int, float]:
        by: dict[int, dict[str, list[float]]] = {}
        for r in self.records:
            by.setdefault(int(r["seed"]), {}).setdefault(r["problem_id"], []).extend(
                float(x) for x in r["rewards"]
            )
        return {s: float(np.mean([np.mean(v) for v in d.values()])) for s, d in by.items()}

    def summarize(self, ci: float = 0.95) -> dict:
        scores = np.array(list(self.problem_scores().values()), dtype=np.float64)
        lo, hi = bootstrap_ci(scores, ci=ci, n_boot=self.n_boot, seed=self.boot_seed)
        seeds = self.seed_scores()
        k = max((len(r["rewards"]) for r in self.records), default=0)
        self.summary = {
            "name": self.name,
            "n_problems": int(scores.size),
            "k": k,
            "seeds": sorted(seeds),
            "mean": float(scores.mean()) if scores.size else float("nan"),
            "ci_low": lo,
            "ci_high": hi,
            "ci": ci,
            "per_seed": {str(s): v for s, v in sorted(seeds.items())},
            "seed_std": float(np.std(list(seeds.values()), ddof=1)) if len(seeds) > 1 else 0.0,
            "in_sample": bool(self.in_sample),
        }
        return self.summary


def bootstrap_ci(
    x: np.ndarray, ci: float = 0.95, n_boot: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of ``x`` (resampling its entries)."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_boot, x.size))
    means = x[idx].mean(axis=1)
    a = (1.0 - ci) / 2.0
    return float(np.quantile(means, a)), float(np.quantile(means, 1.0 - a))


def sign_test(diffs: np.ndarray) -> tuple[int, int, float]:
    """Exact two-sided sign test: (n_positive, n_negative, p-value); zeros are dropped."""
    d = np.asarray(diffs, dtype=np.float64)
    pos, neg = int((d > 0).sum()), int((d < 0).sum())
    n = pos + neg
    if n == 0:
        return pos, neg, 1.0
    k = min(pos, neg)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return pos, neg, float(min(1.0, 2.0 * tail))


Z_ALPHA = 1.959963984540054  # two-sided alpha 0.05
Z_POWER = 0.8416212335729143  # power 0.8


def minimum_detectable_difference(diffs: np.ndarray, alpha_z: float = Z_ALPHA,
                                  power_z: float = Z_POWER) -> float:
    """The smallest true mean of paired differences that a two-sided test at alpha 0.05
    detects with power 0.8 (normal approximation), from the differences' sample standard
    deviation: ``(z_0.975 + z_0.8) * sd / sqrt(n)``; nan below 2 units."""
    d = np.asarray(diffs, np.float64)
    if d.size < 2:
        return float("nan")
    return float((alpha_z + power_z) * d.std(ddof=1) / math.sqrt(d.size))


def paired_bootstrap(
    diffs: np.ndarray, ci: float = 0.95, n_boot: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """(ci_low, ci_high, two-sided p) for the mean of paired differences.

    The p-value is twice the smaller bootstrap tail mass on either side of 0 (capped at 1).
    """
    d = np.asarray(diffs, dtype=np.float64)
    if d.size == 0:
        return float("nan"), float("nan"), 1.0
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(n_boot, d.size))
    means = d[idx].mean(axis=1)
    a = (1.0 - ci) / 2.0
    p = 2.0 * min(float((means <= 0).mean()), float((means >= 0).mean()))
    return float(np.quantile(means, a)), float(np.quantile(means, 1.0 - a)), min(1.0, p)


def compare(
    a: EvalResult, b: EvalResult, ci: float = 0.95, n_boot: int = 10_000, seed: int = 0
) -> dict:
    """Paired comparison of B against A on their common problems (diff = B - A)."""
    sa, sb = a.problem_scores(), b.problem_scores()
    common = sorted(set(sa) & set(sb))
    if not common:
        raise ValueError(f"results {a.name!r} and {b.name!r} share no problems")
    d = np.array([sb[p] - sa[p] for p in common])
    lo, hi, p_boot = paired_bootstrap(d, ci=ci, n_boot=n_boot, seed=seed)
    pos, neg, p_sign = sign_test(d)
    return {
        "in_sample": bool(a.in_sample or b.in_sample),
        "a": a.name,
        "b": b.name,
        "n_common": len(common),
        "only_a": len(set(sa) - set(sb)),
        "only_b": len(set(sb) - set(sa)),
        "mean_a": float(np.mean([sa[p] for p in common])),
        "mean_b": float(np.mean([sb[p] for p in common])),
        "diff": float(d.mean()),
        "ci_low": lo,
        "ci_high": hi,
        "p_bootstrap": p_boot,
        "b_better": pos,
        "a_better": neg,
        "ties": int(len(common) - pos - neg),
        "p_sign": p_sign,
    }


# ----------------------------------------------------------------------------- running


def evaluate(
    task: Task,
    generate: GenerateFn,
    *,
    split: str = "validation",
    k: int = 4,
    seeds: Sequence[int] = (0, 1, 2),
    problems: Sequence[Problem] | None = None,
    out_path: str | Path | None = None,
    name: str = "model",
    n_boot: int = 10_000,
    in_sample: bool | None = None,
) -> EvalResult:
    """avg@k of ``generate`` on ``task``'s ``split``, memory-free (the task's own prompt).

    ``in_sample``: the problems are training problems (None: the task's ``eval_in_sample``,
    set by ``build.build_task``); the records and summary then say so."""
    if in_sample is None:
        in_sample = bool(getattr(task, "eval_in_sample", False))
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not seeds:
        raise ValueError("need at least one seed")
    probs = list(problems) if problems is not None else task.problems(split)
    convs = [task.prompt(p) for p in probs]
    records: list[dict] = []
    for seed in seeds:
        outs = generate(convs, k, int(seed))
        if len(outs) != len(probs) or any(len(o) != k for o in outs):
            shape = [len(o) for o in outs[:5]]
            raise ValueError(
                f"generate returned {len(outs)} lists (first sizes {shape}); expected "
                f"{len(probs)} lists of {k} responses"
            )
        flat_p = [p for p in probs for _ in range(k)]
        flat_r = [r for o in outs for r in o]
        res = task.verify_batch(flat_p, flat_r, split)
        for i, p in enumerate(probs):
            chunk = res[i * k : (i + 1) * k]
            records.append(
                {
                    "problem_id": p.id,
                    "seed": int(seed),
                    "split": split,
                    "rewards": [float(r.reward) for r in chunk],
                    "reasons": [r.reason for r in chunk],
                    "mean": float(np.mean([r.reward for r in chunk])),
                    "in_sample": bool(in_sample),
                }
            )
    result = EvalResult(name=name, records=records, n_boot=n_boot, in_sample=bool(in_sample))
    result.summarize()
    if out_path is not None:
        save_results(result, out_path)
    return result


def save_results(result: EvalResult, path: str | Path) -> None:
    # Through pmd_jax.run.paths: a gs:// run dir's eval folder stays a URL; written atomically.
    paths.write_jsonl(path, ({"name": result.name, **r} for r in result.records))


def load_results(path: str | Path, name: str | None = None) -> EvalResult:
    p = paths.run_path(path)
    if not p.is_file():
        raise FileNotFoundError(f"evaluation results not found: {p}")
    records = []
    for i, line in enumerate(paths.read_text(p).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            _ = r["problem_id"], r["seed"], list(r["rewards"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{p}:{i}: bad evaluation record ({e})") from e
        records.append(r)
    res = EvalResult(
        name=name or (records[0].get("name", p.stem) if records else p.stem), records=records,
        in_sample=any(bool(r.get("in_sample")) for r in records),
    )
    res.summarize()
    return res


IN_SAMPLE = "in-sample"


def report_table(results: Sequence[EvalResult], comparisons: Sequence[dict] = ()) -> str:
    """A small markdown report: one row per result, then one per comparison. Every number of
    an in-sample result (or of a comparison with one) is followed by "(in-sample)"."""
    lines = [
        "| model | problems | k | seeds | avg@k | 95% CI | per seed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s = r.summary or r.summarize()
        lab = f" ({IN_SAMPLE})" if r.in_sample else ""
        per = ", ".join(f"{v:.3f}{lab}" for v in s["per_seed"].values())
        lines.append(
            f"| {s['name']} | {s['n_problems']} | {s['k']} | {len(s['seeds'])} | "
            f"{s['mean']:.3f}{lab} | [{s['ci_low']:.3f}, {s['ci_high']:.3f}]{lab} | {per} |"
        )
    if comparisons:
        lines += [
            "",
            "| comparison (B - A) | problems | diff | 95% CI | p (bootstrap) | "
            "B/A/ties | p (sign) |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in comparisons:
            lab = f" ({IN_SAMPLE})" if c.get("in_sample") else ""
            lines.append(
                f"| {c['b']} - {c['a']} | {c['n_common']} | {c['diff']:+.3f}{lab} | "
                f"[{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]{lab} | {c['p_bootstrap']:.4f}{lab} | "
                f"{c['b_better']}/{c['a_better']}/{c['ties']} | {c['p_sign']:.4f}{lab} |"
            )
    return "\n".join(lines) + "\n"
