"""The probe's statistics: paired contrasts between arms over problems.

Unit: a problem. Each arm's solve rate on a problem is the fraction of its ``samples``
attempts graded correct; arm A minus arm B is the mean over the problems where both are
defined of the per-problem difference. Attempts are paired across arms (the same sampling
key for a problem's j-th attempt in every arm), which removes the sampler's noise shared by
both arms from each difference.

Per contrast: the mean, a 95% percentile bootstrap interval resampling problems (10,000
resamples), its two-sided bootstrap p-value, the exact sign test over problems (ties
dropped), the randomization test (below), the discordant attempt pairs, and the minimum
detectable difference: the true mean difference a two-sided test at alpha 0.05 detects with
power 0.8 given the observed spread of per-problem differences,
``(z_0.975 + z_0.8) * sd / sqrt(n)``.

The randomization (sign-flip) test: with no difference between the arms, the two arms'
labels are exchangeable within a problem (its attempts are paired by sampling key), so each
per-problem difference is as likely to have either sign; the p-value is the share of the
2^n sign assignments whose mean is at least as far from 0 as the observed one (every
assignment for n <= 16, else 100,000 drawn). It is exact at any n, where the percentile
bootstrap is too narrow with few problems (at 7 problems a bootstrap interval can exclude 0
while the exact p is 0.09). A contrast is read "detected" only when the bootstrap interval
excludes 0 and the randomization p is below 0.05.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from pmd_jax.tasks.evaluation import (  # noqa: F401  (the probe's statistics, one place)
    Z_ALPHA,
    Z_POWER,
    minimum_detectable_difference,
    paired_bootstrap,
    sign_test,
)

EXACT_MAX_N = 16  # sign-flip: every assignment up to here, else RANDOMIZATION_DRAWS drawn
RANDOMIZATION_DRAWS = 100_000


def randomization_p(diffs: np.ndarray, seed: int = 0) -> float:
    """Two-sided sign-flip p-value of the mean of ``diffs`` (1.0 for none)."""
    d = np.asarray(diffs, np.float64)
    n = d.size
    if n == 0:
        return 1.0
    obs = abs(d.mean()) - 1e-12 * max(1.0, abs(d).max())  # (ties count as extreme)
    if n <= EXACT_MAX_N:
        signs = 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)
    else:
        rng = np.random.default_rng(seed)
        signs = rng.choice(np.array([-1, 1]), size=(RANDOMIZATION_DRAWS, n))
    means = np.abs(signs @ d) / n
    return float(np.mean(means >= obs))


def contrast(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray],
             n_boot: int = 10_000, seed: int = 0) -> dict:
    """Arm ``a`` minus arm ``b``; each maps problem id -> bool[samples] (paired by index)."""
    pids = sorted(set(a) & set(b))
    d = np.array([float(np.mean(a[p])) - float(np.mean(b[p])) for p in pids], np.float64)
    if not pids:
        return {"problems": 0, "mean": float("nan"), "ci_low": float("nan"),
                "ci_high": float("nan"), "p_bootstrap": 1.0, "better": 0, "worse": 0,
                "p_sign": 1.0, "p_randomization": 1.0, "mdd": float("nan"), "a_only": 0,
                "b_only": 0,
                "rate_a": float("nan"), "rate_b": float("nan")}
    lo, hi, p = paired_bootstrap(d, n_boot=n_boot, seed=seed)
    p_rand = randomization_p(d, seed=seed)
    better, worse, p_sign = sign_test(d)
    a_only = sum(int(np.sum(a[q] & ~b[q])) for q in pids)
    b_only = sum(int(np.sum(~a[q] & b[q])) for q in pids)
    return {"problems": len(pids), "mean": float(d.mean()), "ci_low": lo, "ci_high": hi,
            "p_bootstrap": p, "better": better, "worse": worse, "p_sign": p_sign,
            "p_randomization": p_rand,
            "mdd": minimum_detectable_difference(d), "a_only": a_only, "b_only": b_only,
            "rate_a": float(np.mean([np.mean(a[q]) for q in pids])),
            "rate_b": float(np.mean([np.mean(b[q]) for q in pids]))}


def verdict(c: Mapping, positive_control: bool = False) -> str:
    """A one-phrase reading of a contrast: what the data support, "cannot tell" included."""
    if not c["problems"] or math.isnan(c["mean"]):
        return "no data"
    if c["a_only"] == 0 and c["b_only"] == 0:
        return "identical attempts (no discordant pair: the arms showed the same text?)"
    exact = c.get("p_randomization", 0.0) < 0.05  # (older records have none)
    if c["ci_low"] > 0 and exact:
        return "detected (helps)" if not positive_control else "detected: the probe can see"
    if c["ci_high"] < 0 and exact:
        return "detected (hurts)"
    if positive_control:
        if c["ci_low"] > 0:  # the bootstrap alone: too few problems
            return (f"NOT detected by the exact test (p = {c['p_randomization']:.3g}, "
                    f"{c['problems']} problems): the probe cannot see effects of this size here")
        return "NOT detected: the probe cannot see effects of this size here"
    if c["ci_low"] > 0 or c["ci_high"] < 0:  # the bootstrap alone: too few problems
        return (f"cannot tell: the bootstrap interval excludes 0 but the exact test does not "
                f"(p = {c['p_randomization']:.3g}, {c['problems']} problems)")
    return f"not detected (a gain above {c['ci_high']:+.2f} is ruled out; cannot tell less)"
