"""The probe's statistics against direct formulas, and its minimum detectable difference
against simulation: a true effect of the stated MDD is detected about 80% of the time."""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as sps

from pmd_jax.probe.stats import contrast, minimum_detectable_difference, verdict


def test_contrast_against_direct_formulas():
    a = {"p1": np.array([1, 1, 0, 1], bool), "p2": np.array([0, 0, 0, 1], bool),
         "p3": np.array([1, 1, 1, 1], bool), "only_a": np.array([1, 1, 1, 1], bool)}
    b = {"p1": np.array([0, 1, 0, 0], bool), "p2": np.array([0, 1, 0, 1], bool),
         "p3": np.array([0, 1, 1, 0], bool)}
    c = contrast(a, b)
    d = np.array([0.75 - 0.25, 0.25 - 0.5, 1.0 - 0.5])
    assert c["problems"] == 3
    assert math.isclose(c["mean"], d.mean())
    assert (c["better"], c["worse"]) == (2, 1)
    # discordant attempt pairs, paired by index: (1,0) at p1[0], p1[3], p3[0], p3[3]; (0,1) p2[1]
    assert (c["a_only"], c["b_only"]) == (4, 1)
    assert math.isclose(c["mdd"], (sps.norm.ppf(0.975) + sps.norm.ppf(0.8))
                        * d.std(ddof=1) / math.sqrt(3))
    assert c["ci_low"] <= c["mean"] <= c["ci_high"]
    assert math.isclose(c["rate_a"], np.mean([0.75, 0.25, 1.0]))
    assert contrast(a, {})["problems"] == 0 and verdict(contrast(a, {})) == "no data"
    same = contrast(b, b)
    assert verdict(same).startswith("identical attempts")


def test_mdd_has_the_power_it_states():
    """Simulated probes: 60 problems with base rates spread over (0.15, 0.85), 16 attempts
    per arm, and a problem-specific arm effect (sd 0.08) around the true mean effect. The
    MDD a probe prints under no effect (the pilot) is the effect it then detects (bootstrap CI
    above 0) in 0.8 +- 0.1 of the runs; with no effect it claims help in <= 0.05 + 0.03."""
    rng = np.random.default_rng(0)
    n, k = 60, 16

    def simulate(effect):
        base = rng.uniform(0.15, 0.85, n)
        rate_a = np.clip(base + effect + rng.normal(0, 0.08, n), 0, 1)
        a = {f"p{i}": rng.random(k) < rate_a[i] for i in range(n)}
        b = {f"p{i}": rng.random(k) < base[i] for i in range(n)}
        return a, b

    mdd = float(np.mean([contrast(*simulate(0.0), n_boot=200)["mdd"] for _ in range(30)]))
    assert 0.05 < mdd < 0.15

    def detect_rate(effect, runs=200):
        return np.mean([contrast(*simulate(effect), n_boot=1000, seed=s)["ci_low"] > 0
                        for s in range(runs)])

    assert 0.7 <= detect_rate(mdd) <= 0.9
    assert detect_rate(0.0) <= 0.08


def test_verdicts():
    base = {"problems": 10, "mean": 0.1, "ci_low": 0.02, "ci_high": 0.18, "mdd": 0.09,
            "a_only": 5, "b_only": 1}
    assert verdict(base) == "detected (helps)"
    assert verdict(base, positive_control=True).startswith("detected: the probe can see")
    assert verdict(dict(base, ci_low=-0.01)).startswith("not detected (a gain above +0.18")
    assert verdict(dict(base, ci_low=-0.01), positive_control=True).startswith("NOT detected")
    assert verdict(dict(base, mean=-0.1, ci_low=-0.2, ci_high=-0.01)) == "detected (hurts)"
    assert minimum_detectable_difference(np.array([0.1])) != minimum_detectable_difference(
        np.array([0.1]))  # nan below two problems


def test_randomization_p_against_scipy_and_the_verdict_needs_it():
    """The sign-flip test against scipy's exact paired permutation test; with 7 problems a
    percentile bootstrap interval can exclude 0 while the exact test does not (the Qwen MBPP
    probe's primary contrast): the reading is then "cannot tell", not "detected"."""
    from pmd_jax.probe.stats import randomization_p

    qwen = np.array([0.0625, 0.0, 0.625, 0.125, 0.1875, -0.0625, 0.25])
    rng = np.random.default_rng(1)
    for d in (qwen, rng.normal(0.1, 0.3, 11), np.array([0.5, 0.5, 0.5]), np.zeros(4)):
        ref = sps.permutation_test((d,), np.mean, permutation_type="samples",
                                   alternative="two-sided", n_resamples=np.inf).pvalue
        assert math.isclose(randomization_p(d), min(1.0, ref), rel_tol=1e-9), (d, ref)
    assert math.isclose(randomization_p(qwen), 12 / 128)
    big = rng.normal(0.05, 0.3, 30)  # drawn, not enumerated, above 16 problems
    ref = sps.permutation_test((big,), np.mean, permutation_type="samples",
                               n_resamples=200_000, random_state=3).pvalue
    assert abs(randomization_p(big) - ref) < 0.01
    c = {"problems": 7, "mean": 0.17, "ci_low": 0.036, "ci_high": 0.339, "a_only": 28,
         "b_only": 9, "p_randomization": 12 / 128}
    assert verdict(c).startswith("cannot tell: the bootstrap interval excludes 0")
    assert verdict({**c, "p_randomization": 0.01}) == "detected (helps)"
    assert verdict({**c, "p_randomization": 0.01}, positive_control=True) == \
        "detected: the probe can see"
    assert verdict(c, positive_control=True).startswith("NOT detected by the exact test")
    assert verdict({**c, "mean": -0.2, "ci_low": -0.3, "ci_high": -0.1,
                    "p_randomization": 0.2}).startswith("cannot tell")
