"""The grid's comparison: statistics over the finished cells, the markdown table, the
comparison JSON and the accuracy-vs-step plot. The statistics are described in
``pmd_jax.experiments``' docstring; the tables of what the cells did besides their accuracy
(tokens, answers that are not an option, the memory's check) are ``pmd_jax.grid.diagnostics``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pmd_jax.grid import diagnostics as dg
from pmd_jax.grid import per_step as ps
from pmd_jax.grid.cells import Cell, CellResult, GridError, cell_state, eval_dir, read_info
from pmd_jax.grid.per_step import fmt as _f
from pmd_jax.run.metrics import eval_kl_points, read_metrics
from pmd_jax.tasks import evaluation
from pmd_jax.tasks.evaluation import (
    bootstrap_ci,
    minimum_detectable_difference,
    paired_bootstrap,
    sign_test,
)

log = logging.getLogger("pmd_jax")

# Every mode is compared with each of these that the grid holds, in this order, each pair of
# modes once (as ``mode - reference``, the reference being the one listed first): the
# baselines (SDPO, GRPO, SDPO spending pmd_verified's check's samples on extra
# demonstrations), PMD as the paper describes it, and pmd_verified's control (the check on a
# random other problem's memory). The grid's command line (pmd_jax.experiments) uses this one.
REFERENCE_MODES: tuple[str, ...] = (
    "sdpo", "grpo", "sdpo_matched_sampling", "pmd", "pmd_verified_random_memory")
N_BOOT = ps.N_BOOT
CI = ps.CI
ACC_LABEL = "held-out accuracy (memory-free)"
PLOT_FILE = "accuracy_vs_step.png"
KL_PLOT_FILE = "accuracy_vs_kl.png"


# Eval-record metrics of modes deployed with text in the prompt: fast_slow's best context
# (pmd_jax.modes.fast_slow), memory_only's memory (pmd_frozen_policy).
IN_PROMPT_METRICS = ("accuracy_deployed", "accuracy_with_memory")


def load_cell(folder: Path, cell: Cell, step: int) -> CellResult:
    res = evaluation.load_results(eval_dir(folder, step) / "results.jsonl", name=cell.name)
    recs = read_metrics(folder / "metrics.jsonl")
    curve = sorted(
        (int(r["step"]), float(r["accuracy"])) for r in recs
        if r.get("kind") == "eval" and isinstance(r.get("accuracy"), int | float))
    # a training step's KL (its rollouts), or an evaluation's own (eval.kl_final: the final
    # weights' batch, one step after the last training step)
    kls = sorted((int(r["step"]), float(r["kl_policy_initial"])) for r in recs
                 if r.get("kind") in ("train", "eval")
                 and isinstance(r.get("kl_policy_initial"), int | float))
    rpath = eval_dir(folder, step) / "retention.jsonl"
    rscores, rtask = None, ""
    if rpath.is_file():
        rscores = evaluation.load_results(rpath, name=cell.name).problem_scores()
        rec: dict[str, Any] = next((r for r in reversed(recs)
                                    if r.get("kind") == "eval" and r.get("retention_task")), {})
        rtask = str(rec.get("retention_task", ""))
        if rec.get("retention_prompt_style"):  # how it was asked (eval.retention_prompt_style)
            rtask += f" ({rec['retention_prompt_style']})"
    last_eval: dict[str, Any] = next(
        (r for r in reversed(recs)
         if r.get("kind") == "eval" and int(r.get("step", -1)) == step), {})
    in_prompt = next(((k, float(last_eval[k])) for k in IN_PROMPT_METRICS
                      if isinstance(last_eval.get(k), int | float)), None)
    cfg_path = folder / "config.json"
    config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    reasons = {s: dg.reason_fractions(eval_dir(folder, s) / "results.jsonl")
               for s in sorted({0, step})}
    scores = res.problem_scores()
    return CellResult(cell, step, scores, curve, res.in_sample,
                      eval_kl_points(recs), kls[-1] if kls else None, rscores, rtask,
                      dg.generated_tokens(recs, config), in_prompt,
                      {s: v for s, v in reasons.items() if v}, dg.run_counters(recs),
                      ps.step_scores(folder, "results.jsonl", cell.name, {step: scores}),
                      ps.step_scores(folder, "retention.jsonl", cell.name,
                                     {step: rscores} if rscores is not None else None),
                      ps.train_rewards(recs), str(config.get("task", {}).get("name", "")),
                      dg.cell_cost(recs))


def _units(results: Sequence[CellResult]) -> dict[tuple[str, int], float]:
    return {(pid, r.cell.seed): v for r in results for pid, v in r.scores.items()}


def summarize_mode(mode: str, results: Sequence[CellResult]) -> dict:
    """Accuracy of one mode at the last step over its (problem, seed) pairs."""

    units = _units(results)
    x = np.array(list(units.values()), dtype=np.float64)
    lo, hi = bootstrap_ci(x, ci=CI, n_boot=N_BOOT, seed=0)
    by_problem: dict[str, list[float]] = {}
    for (pid, _), v in units.items():
        by_problem.setdefault(pid, []).append(v)
    px = np.array([np.mean(v) for v in by_problem.values()], dtype=np.float64)
    plo, phi = bootstrap_ci(px, ci=CI, n_boot=N_BOOT, seed=0)
    per_seed = {
        str(r.cell.seed): {"accuracy": float(np.mean(list(r.scores.values()))),
                           "n_problems": len(r.scores)}
        for r in sorted(results, key=lambda r: r.cell.seed)}
    accs = [v["accuracy"] for v in per_seed.values()]
    return {
        "mode": mode,
        "step": results[0].step,
        "accuracy": float(x.mean()),
        "ci_low": lo, "ci_high": hi,
        "ci_problems_low": plo, "ci_problems_high": phi,
        "n_pairs": int(x.size),
        "n_problems": len(by_problem),
        "seeds": [r.cell.seed for r in sorted(results, key=lambda r: r.cell.seed)],
        "per_seed": per_seed,
        "seed_std": float(np.std(accs, ddof=1)) if len(accs) > 1 else float("nan"),
        "in_sample": any(r.in_sample for r in results),
    }


def compare_modes(ref: str, ref_res: Sequence[CellResult], mode: str,
                  res: Sequence[CellResult]) -> dict:
    """``mode - ref`` over their matched (problem, seed) pairs."""

    a, b = _units(ref_res), _units(res)
    common = sorted(set(a) & set(b))
    if not common:
        raise GridError(f"modes {mode} and {ref} share no (problem, seed) pair")
    d = np.array([b[k] - a[k] for k in common], dtype=np.float64)
    lo, hi, p_boot = paired_bootstrap(d, ci=CI, n_boot=N_BOOT, seed=0)
    pos, neg, p_sign = sign_test(d)
    return {
        "mode": mode, "reference": ref,
        "n_pairs": len(common),
        "n_problems": len({p for p, _ in common}),
        "seeds": sorted({s for _, s in common}),
        "accuracy_mode": float(np.mean([b[k] for k in common])),
        "accuracy_reference": float(np.mean([a[k] for k in common])),
        "diff": float(d.mean()), "ci_low": lo, "ci_high": hi, "p_bootstrap": p_boot,
        "mode_better": pos, "reference_better": neg, "ties": len(common) - pos - neg,
        "p_sign": p_sign, "mdd": minimum_detectable_difference(d),
    }


def build_comparison(results: Sequence[CellResult], modes: Sequence[str]) -> dict:
    by_mode: dict[str, list[CellResult]] = {}
    for r in results:
        by_mode.setdefault(r.cell.mode, []).append(r)
    present = [m for m in modes if m in by_mode]
    summaries = [summarize_mode(m, by_mode[m]) for m in present]
    comps, done = [], set()
    for ref in REFERENCE_MODES:
        if ref not in by_mode:
            continue
        for m in present:
            if m == ref or frozenset((m, ref)) in done:
                continue
            done.add(frozenset((m, ref)))
            comps.append(compare_modes(ref, by_mode[ref], m, by_mode[m]))
    return {"summaries": summaries, "comparisons": comps}


def finished_cells(folder: Path, modes: Sequence[str]) -> tuple[list[CellResult], list[dict]]:
    """The finished cells of ``modes`` in a grid's ``--out`` folder (any seeds), with their
    ``cell.json`` records."""
    results, infos = [], []
    for sub in sorted(p for p in Path(folder).iterdir() if p.is_dir()):
        info = read_info(sub)
        if not info or info.get("mode") not in modes:
            continue
        steps = int(info["train_steps"])
        if cell_state(sub, steps)[0]:
            results.append(load_cell(sub, Cell(str(info["mode"]), int(info["seed"])), steps))
            infos.append(info)
    return results, infos


def compare_against(results: Sequence[CellResult], budget: dict, others: Sequence[Path],
                    modes: Sequence[str]) -> list[dict]:
    """Each mode of this grid against the same mode's cells in another grid's folder (``--
    against``): the same config and last step, other overrides (a variant of the method, as
    LoRA against full fine-tuning), matched (problem, seed) pairs at the last step. The other
    grid is the reference: ``diff`` is this grid's accuracy minus theirs."""

    rows: list[dict] = []
    for other in others:
        theirs, infos = finished_cells(Path(other), modes)
        if not theirs:
            raise GridError(f"--against {other}: no finished cell of modes {list(modes)}")
        for info in infos:
            if (info["config"], int(info["train_steps"])) != (budget["config"],
                                                              int(budget["train_steps"])):
                raise GridError(
                    f"--against {other}: its cells ran {info['config']} for "
                    f"{info['train_steps']} steps, this grid {budget['config']} for "
                    f"{budget['train_steps']}: only a grid of the same config and last step "
                    "can be compared pair by pair")
        overrides = sorted({" ".join(i["overrides"]) or "none" for i in infos})
        for m in modes:
            ours = [r for r in results if r.cell.mode == m]
            ref = [r for r in theirs if r.cell.mode == m]
            if not ours or not ref:
                continue
            row = compare_modes(f"{m} [{Path(other).name}]", ref, m, ours)
            row.update(against=str(other), against_overrides=overrides,
                       overrides=" ".join(budget["overrides"]) or "none",
                       per_seed=[compare_modes("", [a for a in ref if a.cell.seed == s], "",
                                               [b for b in ours if b.cell.seed == s])
                                 for s in row["seeds"]])
            rows.append(row)
    return rows


def _paired_cells(c: dict) -> str:
    """A paired comparison's table cells (compare_modes): both accuracies, the difference, its
    CI and p, better / worse / ties, the sign test's p and the MDD, each closed by ``|``."""
    return (f"{_f(c['accuracy_mode'])} | {_f(c['accuracy_reference'])} | "
            f"{_f(c['diff'], '+.3f')} | [{_f(c['ci_low'], '+.3f')}, {_f(c['ci_high'], '+.3f')}] "
            f"| {_f(c['p_bootstrap'], '.4f')} | {c['mode_better']} / {c['reference_better']} / "
            f"{c['ties']} | {_f(c['p_sign'], '.4g')} | {_f(c.get('mdd', float('nan')))} |")


def against_markdown(rows: Sequence[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        "", "## Against other grids (`--against`)", "",
        "Each mode of this grid minus the same mode's cells in another grid of the same config "
        "and last step (run with other overrides), over matched (problem, training seed) pairs "
        "at the last step; the statistics of the table above (paired bootstrap CI and p, exact "
        "sign test, MDD). Per seed: the difference and the sign test of that seed's problems.",
        "",
        "| mode - other grid's | this grid's overrides | the other's | pairs | seeds | this | "
        "other | diff | 95% CI | p (bootstrap) | better / worse / ties | p (sign test) | MDD "
        "| per seed: diff (better / worse, p) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in rows:
        per = "; ".join(
            f"seed {s}: {_f(p['diff'], '+.3f')} ({p['mode_better']} / {p['reference_better']}, "
            f"p {_f(p['p_sign'], '.3g')})" for s, p in zip(c["seeds"], c["per_seed"], strict=True))
        lines.append(
            f"| {c['mode']} - {c['reference']} | `{c['overrides']}` | "
            f"`{'`, `'.join(c['against_overrides'])}` | {c['n_pairs']} | {len(c['seeds'])} | "
            f"{_paired_cells(c)} {per} |")
    return lines


def report_markdown(comp: dict, header: Sequence[str], seeds: Sequence[int]) -> str:
    lines = [*header, ""]
    lab = " (in-sample)" if any(s["in_sample"] for s in comp["summaries"]) else ""
    lines += [
        "Accuracy at the last step (memory-free held-out evaluation; a unit is a (problem, "
        "training seed) pair scored as its mean reward). Mean over the pairs; 95% CI: "
        "percentile bootstrap resampling the pairs (10,000 draws); 95% CI (problems): "
        "resampling problems, each the mean over its seeds. Per-seed columns: accuracy (n "
        "problems)." + lab, "",
        "| mode | step | accuracy | 95% CI (pairs) | 95% CI (problems) | pairs | problems | "
        "seeds | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(seeds),
    ]
    for s in comp["summaries"]:
        per = [
            f"{_f(s['per_seed'][str(k)]['accuracy'])} (n={s['per_seed'][str(k)]['n_problems']})"
            if str(k) in s["per_seed"] else "missing" for k in seeds]
        lines.append(
            f"| {s['mode']} | {s['step']} | {_f(s['accuracy'])} | [{_f(s['ci_low'])}, "
            f"{_f(s['ci_high'])}] | [{_f(s['ci_problems_low'])}, {_f(s['ci_problems_high'])}] "
            f"| {s['n_pairs']} | {s['n_problems']} | {len(s['seeds'])} | " + " | ".join(per)
            + " |")
    if comp["comparisons"]:
        lines += [
            "", "Paired differences (mode - reference) over matched (problem, seed) pairs: mean, "
            "95% paired bootstrap CI and p-value (10,000 draws), exact two-sided sign test "
            "(ties dropped); MDD: the minimum detectable difference, the true mean difference "
            "that a two-sided test at alpha 0.05 finds with power 0.8 given the pairs' spread, "
            "(z_0.975 + z_0.8) sd / sqrt(pairs): a CI that holds 0 rules out only differences "
            "above about the MDD. References, in this order, those in the grid: "
            f"{', '.join(REFERENCE_MODES)}; each pair of modes once.", "",
            "| mode - reference | pairs | problems | seeds | mode | reference | diff | 95% CI | "
            "p (bootstrap) | mode better / reference better / ties | p (sign test) | MDD |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in comp["comparisons"]:
            lines.append(
                f"| {c['mode']} - {c['reference']} | {c['n_pairs']} | {c['n_problems']} | "
                f"{len(c['seeds'])} | {_paired_cells(c)}")
    return "\n".join(lines) + "\n"


def drift_and_retention(results: Sequence[CellResult], modes: Sequence[str]) -> list[dict]:
    """Per mode: KL(policy || initial) at the last measured step (mean, min, max over seeds)
    and, where the cells evaluated a retention set (eval.retention), its accuracy at the last
    step with the same statistics as the task accuracy."""
    rows = []
    for mode in modes:
        rs = [r for r in results if r.cell.mode == mode]
        if not rs:
            continue
        kls = [r.last_kl for r in rs if r.last_kl is not None]
        row: dict = {"mode": mode, "n_seeds": len(rs)}
        if kls:
            v = [k for _, k in kls]
            row.update(kl_step=sorted({s for s, _ in kls}), kl_mean=float(np.mean(v)),
                       kl_min=float(np.min(v)), kl_max=float(np.max(v)), kl_n_seeds=len(v))
        row.update(dg.token_summary([r.tokens for r in rs]))
        prompted = [r.in_prompt for r in rs if r.in_prompt is not None]
        if prompted:
            row["in_prompt"] = {"metric": prompted[0][0], "n_seeds": len(prompted),
                                "accuracy": float(np.mean([v for _, v in prompted]))}
        with_ret = [r for r in rs if r.retention_scores is not None]
        if with_ret:
            ret = [CellResult(r.cell, r.step, r.retention_scores or {}) for r in with_ret]
            s = summarize_mode(mode, ret)
            row["retention"] = {k: s[k] for k in ("accuracy", "ci_low", "ci_high", "n_pairs",
                                                  "n_problems", "seeds")}
            row["retention"]["task"] = sorted({r.retention_task for r in with_ret})
        rows.append(row)
    return rows


def drift_markdown(rows: Sequence[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        "", "Drift and forgetting at the last step. KL(policy || initial): the sampled-token "
        "estimate on the rollouts of the last measured point (KL step: the final weights' own "
        "batch with eval.kl_final, else the last training step's rollouts, "
        "train.kl_initial_every), nats per response token, mean [min, max] over seeds. "
        "Retention: memory-free accuracy on the off-task retention set (eval.retention; "
        "'not measured' when the cells ran without it), mean over (problem, seed) pairs with "
        "its 95% bootstrap CI.", "",
        "| mode | seeds | KL step | KL(policy ‖ initial) | retention task | retention "
        "accuracy | 95% CI | pairs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kl = (f"{_f(r['kl_mean'])} [{_f(r['kl_min'])}, {_f(r['kl_max'])}]"
              if "kl_mean" in r else "not measured")
        steps = ", ".join(str(s) for s in r.get("kl_step", [])) or "-"
        if "retention" in r:
            t = r["retention"]
            k = len(t["seeds"])  # cells run without eval.retention lack it
            some = f" ({k} of {r['n_seeds']} seeds)" if k < r["n_seeds"] else ""
            ret = (f"{', '.join(t['task'])} | {_f(t['accuracy'])}{some} | [{_f(t['ci_low'])}, "
                   f"{_f(t['ci_high'])}] | {t['n_pairs']}")
        else:
            ret = "- | not measured | - | -"
        lines.append(f"| {r['mode']} | {r['n_seeds']} | {steps} | {kl} | {ret} |")
    prompted = [r for r in rows if "in_prompt" in r]
    if prompted:
        lines += ["", "Deployed with text in the prompt (the table above is the weights alone): "
                  "fast_slow with its pool's best context (accuracy_deployed), memory_only with "
                  "its memory (accuracy_with_memory); accuracy at the last step, mean over "
                  "seeds.", "", "| mode | metric | seeds | accuracy |", "|---|---|---|---|"]
        lines += [f"| {r['mode']} | {r['in_prompt']['metric']} | {r['in_prompt']['n_seeds']} | "
                  f"{_f(r['in_prompt']['accuracy'])} |" for r in prompted]
    return lines


def plot_accuracy_vs_kl(results: Sequence[CellResult], modes: Sequence[str],
                        path: Path) -> Path | None:
    """Held-out accuracy against KL(policy || initial) at each evaluation that has a KL
    measurement, one line per cell, one colour per mode (FST's forgetting figure)."""
    pts = {m: [r for r in results if r.cell.mode == m and r.kl_points] for m in modes}
    pts = {m: rs for m, rs in pts.items() if rs}
    if not pts:
        return None
    # lazy: matplotlib only for the plots, which a run without plotting never draws
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib only for the plots, which a run without plotting never draws
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.4), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (mode, rs) in enumerate(pts.items()):
        color = colors[i % len(colors)]
        for j, r in enumerate(rs):
            xs = [p["kl"] for p in r.kl_points]
            ys = [p["accuracy"] for p in r.kl_points]
            ax.plot(xs, ys, color=color, lw=1.0, marker="o", ms=3, alpha=0.8,
                    label=mode if j == 0 else None)
    return ps.save_plot(fig, ax, path, "KL(policy || initial), nats / response token",
                        ACC_LABEL, "Held-out accuracy vs KL to the initial policy (one line per "
                        "seed)")


def accuracy_curves(results: Sequence[CellResult], modes: Sequence[str]) -> dict:
    """Per mode: the steps every seed of the mode evaluated at, and the mean / min / max
    over seeds of the held-out accuracy there (from the cells' metrics.jsonl)."""
    curves = {}
    for mode in modes:
        cs = [dict(r.curve) for r in results if r.cell.mode == mode]
        if not cs:
            continue
        steps = sorted(set.intersection(*(set(c) for c in cs)))
        ys = np.array([[c[s] for s in steps] for c in cs], dtype=np.float64).reshape(
            len(cs), len(steps))
        curves[mode] = {
            "steps": steps, "n_seeds": len(cs),
            "mean": ys.mean(axis=0).tolist(), "min": ys.min(axis=0).tolist(),
            "max": ys.max(axis=0).tolist(),
            "per_seed": {str(r.cell.seed): [list(x) for x in r.curve]
                         for r in results if r.cell.mode == mode},
        }
    return curves


def plot_curves(curves: dict, path: Path) -> Path:
    """Held-out accuracy vs step: per mode the mean over seeds (at the steps every seed of
    the mode evaluated), a min-max band over seeds, and thin per-seed lines."""
    return ps.plot_over_steps(
        curves, path, ACC_LABEL,
        "Held-out accuracy vs step (band: min-max over seeds; thin: each seed)")


def write_report(out: Path, cells: Sequence[Cell], modes: Sequence[str],
                 seeds: Sequence[int], against: Sequence[Path] = ()) -> dict:
    """Builds comparison.md / comparison.json / the plot from the finished cells in ``out``
    (each with its cell.json); the others are listed as missing. ``against``: other grids'
    folders whose cells of the same modes each mode is compared with (compare_against)."""
    finished: list[CellResult] = []
    missing: list[tuple[Cell, str]] = []
    infos: list[dict] = []
    for cell in cells:
        folder = out / cell.name
        info = read_info(folder)
        if not info:
            missing.append((cell, "not in --out"))
            continue
        ok, why = cell_state(folder, int(info["train_steps"]))
        if ok:
            finished.append(load_cell(folder, cell, int(info["train_steps"])))
            infos.append(info)
        else:
            missing.append((cell, why))
    for cell, why in missing:
        log.warning("cell %s missing from the comparison: %s", cell.key, why)
    if not finished:
        raise GridError(f"no finished cell in {out}: nothing to compare")
    budgets = {json.dumps({k: i[k] for k in ("config", "overrides", "train_steps")})
               for i in infos}
    if len(budgets) > 1:
        raise GridError(f"the finished cells in {out} have different budgets: {sorted(budgets)}")
    budget = infos[0]
    comp = build_comparison(finished, modes)
    comp["missing"] = [{"cell": c.key, "why": why} for c, why in missing]
    comp["budget"] = {k: budget[k] for k in ("config", "overrides", "train_steps")}
    comp["cells"] = [r.cell.key for r in finished]
    comp["curves"] = accuracy_curves(finished, modes)
    header = [
        "# Comparison grid", "",
        f"Config `{budget['config']}`, overrides (every cell): "
        f"`{' '.join(budget['overrides']) or 'none'}`; last step {budget['train_steps']}. "
        f"Cells finished: {len(finished)}/{len(cells)}"
        + (". Missing: " + "; ".join(f"{c.key} ({why})" for c, why in missing)
           if missing else "."),
        f"Plot: `{PLOT_FILE}` (mean over seeds, band min-max over seeds).",
    ]
    comp["drift"] = drift_and_retention(finished, modes)
    kl_plot = plot_accuracy_vs_kl(finished, modes, out / KL_PLOT_FILE)
    if kl_plot is not None:
        header.append(f"Plot: `{KL_PLOT_FILE}` (held-out accuracy against KL to the initial "
                      "policy at each evaluation with a KL measurement).")
    comp["per_step"] = ps.step_rows(finished, modes)
    comp["retention_per_step"] = ps.step_rows(finished, modes, "step_retention")
    comp["train_reward"] = ps.reward_curves(finished, modes)
    if ps.plot_rewards(comp["train_reward"], out / ps.TRAIN_REWARD_PLOT) is not None:
        header.append(f"Plot: `{ps.TRAIN_REWARD_PLOT}` (the training reward of each step's "
                      "rollouts).")
    comp["answers_not_options"] = dg.answers_not_options(finished, modes)
    comp["memory"] = dg.memory_rows(finished, modes)
    comp["cost"] = dg.cost_rows(finished, modes)
    comp["against"] = compare_against(finished, budget, against, modes)
    table = report_markdown(comp, header, seeds) + "\n".join(
        against_markdown(comp["against"])
        + ps.step_markdown(comp["per_step"], "Held-out accuracy")
        + ps.step_markdown(comp["retention_per_step"], "Retention-set accuracy")
        + ps.reward_markdown(comp["train_reward"])
        + drift_markdown(comp["drift"]) + dg.tokens_markdown(comp["drift"])
        + dg.answers_markdown(comp["answers_not_options"])
        + dg.memory_markdown(comp["memory"], int(budget["train_steps"]))
        + dg.cost_markdown(comp["cost"]))
    table = table.rstrip("\n") + "\n"
    (out / "comparison.md").write_text(table)
    (out / "comparison.json").write_text(json.dumps(comp, indent=2, default=str) + "\n")
    plot_curves(comp["curves"], out / PLOT_FILE)
    comp["markdown"] = table
    return comp
