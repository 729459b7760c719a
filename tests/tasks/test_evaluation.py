"""Evaluation statistics against scipy, and avg@k on the real SciQ task."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats as st

from pmd_jax.tasks import get_task
from pmd_jax.tasks.evaluation import (
    bootstrap_ci,
    compare,
    evaluate,
    load_results,
    paired_bootstrap,
    report_table,
    sign_test,
)


@pytest.mark.parametrize(
    "pos,neg,zeros", [(0, 0, 3), (5, 5, 0), (12, 3, 4), (1, 19, 0), (40, 25, 10), (0, 7, 0)]
)
def test_sign_test_matches_scipy_binomtest(pos, neg, zeros):
    d = np.array([0.5] * pos + [-0.25] * neg + [0.0] * zeros)
    p_pos, p_neg, p = sign_test(d)
    assert (p_pos, p_neg) == (pos, neg)
    ref = 1.0 if pos + neg == 0 else st.binomtest(pos, pos + neg, 0.5).pvalue
    assert p == pytest.approx(ref, rel=1e-12, abs=1e-15)


def test_bootstrap_ci_matches_scipy():
    x = np.random.default_rng(3).binomial(1, 0.37, size=300).astype(float)
    lo, hi = bootstrap_ci(x, n_boot=20_000, seed=1)
    ref = st.bootstrap(
        (x,),
        np.mean,
        n_resamples=20_000,
        method="percentile",
        confidence_level=0.95,
        random_state=2,
    ).confidence_interval
    assert lo == pytest.approx(ref.low, abs=0.006)
    assert hi == pytest.approx(ref.high, abs=0.006)
    # and the normal approximation for a large sample
    se = x.std(ddof=1) / np.sqrt(x.size)
    assert lo == pytest.approx(x.mean() - 1.96 * se, abs=0.01)
    assert hi == pytest.approx(x.mean() + 1.96 * se, abs=0.01)
    assert lo < x.mean() < hi


def test_paired_bootstrap_p_value():
    rng = np.random.default_rng(0)
    d = rng.normal(0.08, 0.4, size=200)
    lo, hi, p = paired_bootstrap(d, n_boot=20_000, seed=0)
    ref = st.bootstrap((d,), np.mean, n_resamples=20_000, method="percentile", random_state=5)
    dist = ref.bootstrap_distribution
    p_ref = 2 * min((dist <= 0).mean(), (dist >= 0).mean())
    assert p == pytest.approx(p_ref, abs=0.01)
    assert lo == pytest.approx(ref.confidence_interval.low, abs=0.01)
    # the one-sample t-test gives a p-value of the same size for this near-normal sample
    assert p == pytest.approx(st.ttest_1samp(d, 0.0).pvalue, abs=0.02)
    _, _, p_null = paired_bootstrap(np.r_[d - d.mean()], n_boot=5000)
    assert p_null > 0.5


def _scripted(task, acc_by_seed_offset: float):
    """A deterministic policy: answers problem i correctly iff a seeded draw < its accuracy."""
    probs = {
        tuple(map(tuple, (m.items() for m in task.prompt(p)))): p
        for p in task.problems("validation")
    }

    def generate(convs, n, seed):
        out = []
        for c in convs:
            p = probs[tuple(map(tuple, (m.items() for m in c)))]
            acc = min(1.0, (int(p.id.split("/")[1]) % 10) / 10 + acc_by_seed_offset)
            rng = np.random.default_rng([seed, int(p.id.split("/")[1])])
            wrong = next(x for x in "ABCD" if x != p.gold)
            out.append(
                [f"<answer>{p.gold if rng.random() < acc else wrong}</answer>" for _ in range(n)]
            )
        return out

    def expected(k, seeds):
        tot = []
        for p in task.problems("validation"):
            acc = min(1.0, (int(p.id.split("/")[1]) % 10) / 10 + acc_by_seed_offset)
            r = []
            for s in seeds:
                rng = np.random.default_rng([s, int(p.id.split("/")[1])])
                r += [float(rng.random() < acc) for _ in range(k)]
            tot.append(np.mean(r))
        return float(np.mean(tot))

    return generate, expected


def test_evaluate_avg_at_k_and_compare(tmp_path):
    task = get_task("sciq")
    gen_a, exp_a = _scripted(task, 0.0)
    gen_b, exp_b = _scripted(task, 0.3)
    ra = evaluate(task, gen_a, k=4, seeds=(0, 1, 2), out_path=tmp_path / "a.jsonl", name="base")
    rb = evaluate(task, gen_b, k=4, seeds=(0, 1, 2), out_path=tmp_path / "b.jsonl", name="pmd")
    sa = ra.summary
    assert sa["n_problems"] == 100 and sa["k"] == 4 and sa["seeds"] == [0, 1, 2]
    assert sa["mean"] == pytest.approx(exp_a(4, (0, 1, 2)), abs=1e-12)
    assert rb.summary["mean"] == pytest.approx(exp_b(4, (0, 1, 2)), abs=1e-12)
    assert sa["ci_low"] < sa["mean"] < sa["ci_high"]
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert len(lines) == 300
    again = load_results(tmp_path / "a.jsonl")
    assert again.summary["mean"] == pytest.approx(sa["mean"])
    c = compare(load_results(tmp_path / "a.jsonl"), load_results(tmp_path / "b.jsonl"))
    assert c["n_common"] == 100 and c["diff"] > 0.2
    assert c["p_sign"] < 1e-6 and c["p_bootstrap"] < 1e-3
    assert c["ci_low"] > 0
    same = compare(ra, ra)
    assert same["diff"] == 0 and same["p_sign"] == 1.0
    table = report_table([ra, rb], [c])
    assert "| base | 100 | 4 | 3 |" in table and "| pmd - base | 100 |" in table


def test_evaluate_bad_generate():
    task = get_task("sciq")
    probs = task.problems("validation")[:3]
    with pytest.raises(ValueError, match="expected 3 lists of 2"):
        evaluate(task, lambda c, n, s: [["x"]] * len(c), k=2, seeds=(0,), problems=probs)
    with pytest.raises(ValueError, match="k must be"):
        evaluate(task, lambda c, n, s: [], k=0, problems=probs)
