"""The probe's report: ``probe.json`` (everything, per problem), ``probe.md`` (the tables and
what they support) and ``probe.png`` (each contrast with its interval and its minimum
detectable difference; each arm's solve rate)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from pmd_jax.probe.arms import CONTRASTS
from pmd_jax.probe.stats import contrast, verdict


def contrasts(outcomes: dict[str, dict[str, dict[str, np.ndarray]]]) -> list[dict[str, Any]]:
    out = []
    for group, a, b, role in CONTRASTS:
        arms = outcomes.get(group, {})
        if a not in arms or b not in arms:
            continue
        c = contrast(arms[a], arms[b])
        c.update(group=group, a=a, b=b, role=role,
                 verdict=verdict(c, positive_control=role == "positive control"))
        out.append(c)
    return out


def _f(x: float, sign: bool = True) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:+.3f}" if sign else f"{x:.3f}"


def markdown(setup: dict[str, Any], result: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# Memory content probe", ""]
    lines.append("Training-free: the model attempts each problem with memory text in the "
                 "teacher's reprompt template, arm by arm; arms differ in one thing each, "
                 "attempts are paired across arms by sampling key (pmd_jax/probe).")
    lines.append("")
    lines.append("## Setup")
    lines.append("")
    for k, v in setup.items():
        lines.append(f"- {k}: `{json.dumps(v) if not isinstance(v, str) else v}`")
    lines.append("")
    lines.append("## Screening")
    lines.append("")
    lines.append("| group | candidates | never solved | always solved | mixed | kept | "
                 "solve rate |")
    lines.append("|---|---|---|---|---|---|---|")
    for g, s in result["screen"].items():
        lines.append(f"| {g} | {s['candidates']} | {s['never_solved']} | {s['always_solved']}"
                     f" | {s['mixed']} | {s['kept']} | {_f(s['screen_rate'], False)} |")
    lines.append("")
    lines.append("## Contrasts (A minus B, per-problem solve rates)")
    lines.append("")
    lines.append("MDD: the minimum detectable difference (alpha 0.05 two-sided, power 0.8, "
                 "from the observed spread). A-only / B-only: attempt pairs (same key) solved "
                 "by one arm only.")
    lines.append("")
    lines.append("| group | A | B | role | problems | rate A | rate B | A - B [95% CI] | MDD"
                 " | better / worse | p (sign) | p (randomization) | A-only / B-only | "
                 "reading |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in rows:
        lines.append(
            f"| {c['group']} | {c['a']} | {c['b']} | {c['role']} | {c['problems']} | "
            f"{_f(c['rate_a'], False)} | {_f(c['rate_b'], False)} | {_f(c['mean'])} "
            f"[{_f(c['ci_low'])}, {_f(c['ci_high'])}] | {_f(c['mdd'], False)} | "
            f"{c['better']} / {c['worse']} | {c['p_sign']:.3g} | "
            f"{c.get('p_randomization', float('nan')):.3g} | {c['a_only']} / "
            f"{c['b_only']} | {c['verdict']} |")
    lines.append("")
    lines.append("## Arms")
    lines.append("")
    lines.append("| group | arm | problems defined | solve rate | seconds |")
    lines.append("|---|---|---|---|---|")
    for g, arms in result["defined"].items():
        for arm, n in arms.items():
            o = result["outcomes"].get(g, {}).get(arm)
            rate = float(np.mean([v.mean() for v in o.values()])) if o else float("nan")
            sec = result["timings"].get(f"{g}_{arm}")
            lines.append(f"| {g} | {arm} | {n} | {_f(rate, False)} | "
                         f"{'' if sec is None else f'{sec:.0f}'} |")
    lines.append("")
    d = {g: v for g, v in result.get("diagnostics", {}).items() if v}
    if d:
        lines.append(f"Diagnostics: `{json.dumps(d)}` (behavior_overlap_mean: the mean "
                     "fraction of a problem's behaviors that its control arm also showed; "
                     "a content contrast is weak by construction when it is high).")
        lines.append("")
    lines.append(f"Wall time: {result['timings'].get('total', float('nan')) / 60:.1f} min.")
    lines.append("")
    lines.append("## One prompt per arm")
    lines.append("")
    for g, ex in result.get("examples", {}).items():
        for arm, text in ex.items():
            lines.append(f"<details><summary>{g} / {arm}</summary>")
            lines.append("")
            lines.append("```text")
            lines.append(text.replace("```", "'''")[:4000])
            lines.append("```")
            lines.append("</details>")
            lines.append("")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], result: dict[str, Any], path: Path) -> Path:
    # lazy: matplotlib only for the plots, which a run without plotting never draws
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib only for the plots, which a run without plotting never draws
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.45 * max(6, len(rows)) + 1.5),
                                   gridspec_kw={"width_ratios": [3, 2]})
    ys = np.arange(len(rows))[::-1]
    for y, c in zip(ys, rows, strict=True):
        color = "tab:green" if c["role"] == "positive control" else (
            "tab:red" if c["role"].startswith("primary") else "tab:blue")
        if not math.isnan(c["mean"]):
            ax1.errorbar(c["mean"], y, xerr=[[c["mean"] - c["ci_low"]],
                                              [c["ci_high"] - c["mean"]]],
                         fmt="o", color=color, capsize=3)
        if not math.isnan(c["mdd"]):
            ax1.plot([c["mdd"]], [y], marker="|", color="gray", markersize=12)
    ax1.axvline(0, color="black", lw=0.8)
    ax1.set_yticks(ys)
    ax1.set_yticklabels([f"{c['group']}: {c['a']} - {c['b']} (n={c['problems']})"
                         for c in rows], fontsize=8)
    ax1.set_xlabel("difference in solve rate (95% CI over problems; | = MDD)")
    ax1.set_title("contrasts (green: positive controls, red: primary)")
    labels, rates = [], []
    for g, arms in result["outcomes"].items():
        for arm, o in arms.items():
            labels.append(f"{g}: {arm}")
            rates.append(float(np.mean([v.mean() for v in o.values()])))
    ax2.barh(np.arange(len(rates))[::-1], rates, color="tab:gray")
    ax2.set_yticks(np.arange(len(rates))[::-1])
    ax2.set_yticklabels(labels, fontsize=8)
    ax2.set_xlim(0, 1)
    ax2.set_xlabel("solve rate (screened problems)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(out: Path, setup: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """Writes probe.json, probe.md and probe.png under ``out``; returns the json's content."""
    out.mkdir(parents=True, exist_ok=True)
    rows = contrasts(result["outcomes"])
    data = {
        "setup": setup, "screen": result["screen"], "contrasts": rows,
        "defined": result["defined"], "diagnostics": result.get("diagnostics", {}),
        "timings": result["timings"], "missing_problems": result.get("missing_problems", 0),
        "outcomes": {g: {arm: {pid: v.astype(int).tolist() for pid, v in o.items()}
                         for arm, o in arms.items()}
                     for g, arms in result["outcomes"].items()},
    }
    (out / "probe.json").write_text(json.dumps(data, indent=1, default=float) + "\n")
    (out / "probe.md").write_text(markdown(setup, result, rows))
    plot(rows, result, out / "probe.png")
    return data
