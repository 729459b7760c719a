"""Run metrics: JSONL + TensorBoard event files, progress lines with rate and ETA, PNG plots.

``MetricsWriter`` is the only place the trainer sends numbers to. Plots are drawn from the JSONL
file after the run (or at any time), so a resumed run plots its whole history.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from etils import epath
from tqdm import tqdm

from pmd_jax.run import paths

log = logging.getLogger("pmd_jax")


def _scalar(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f


class NoMetrics:
    """The metrics writer of processes other than 0 (which alone writes metrics)."""

    def write(self, kind: str, step: int, values: Any) -> None:
        pass

    def truncate_after(self, step: int, keep: tuple[str, int] | None = None) -> int:
        return 0

    def last(self, kind: str, step: int) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        pass


class MetricsWriter:
    """Appends one JSON object per record to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    Records carry a ``kind`` ("train", "eval", "phase", ...) and a ``step``.
    """

    def __init__(self, run_dir: str | os.PathLike, use_tensorboard: bool = True) -> None:
        # A gs:// run dir stays a URL (pmd_jax.run.paths); metrics.jsonl is rewritten per record
        # there (objects cannot be appended to), appended to locally.
        self.run_dir = paths.makedirs(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._fh = paths.JsonlWriter(self.path)
        self._tb = None
        if use_tensorboard:
            try:
                # lazy: tensorboardX (protobuf) only when a TensorBoard writer is asked for
                from tensorboardX import SummaryWriter

                # tensorboardX writes gs:// itself (through google-cloud-storage).
                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            except ImportError as e:  # tensorboardX, or google-cloud-storage for a gs:// dir
                log.warning("TensorBoard events are not written (%s)", e)

    def write(self, kind: str, step: int, values: Mapping[str, Any]) -> None:
        rec = {"kind": kind, "step": int(step), "time": time.time()}
        for k, v in values.items():
            s = _scalar(v)
            rec[k] = s if s is not None and not isinstance(v, str) else v
        self._fh.write(json.dumps(rec, default=str))
        if self._tb is not None:
            for k, v in values.items():
                s = _scalar(v)
                if s is not None and not isinstance(v, str | bool) and math.isfinite(s):
                    self._tb.add_scalar(f"{kind}/{k}", s, int(step))

    def truncate_after(self, step: int, keep: tuple[str, int] | None = None) -> int:
        """Drop records past ``step`` (used on resume, so a replayed step is not logged twice),
        except those of ``keep``'s (kind, step); returns how many were dropped."""
        old = read_metrics(self.path)
        kept = [r for r in old if r.get("step", 0) <= step
                or (keep is not None and (r.get("kind"), r.get("step")) == keep)]
        if len(kept) < len(old):
            self._fh.rewrite(kept)
        return len(old) - len(kept)

    def last(self, kind: str, step: int) -> dict[str, Any] | None:
        """The last record of ``kind`` at ``step`` in metrics.jsonl, or None."""
        found = [r for r in read_metrics(self.path)
                 if r.get("kind") == kind and r.get("step") == step]
        return found[-1] if found else None

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Reads a metrics.jsonl, skipping a torn last line (a crash mid-write)."""
    out: list[dict[str, Any]] = []
    for line in paths.read_lines(path):
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class Progress:
    """A log line per update with rate and ETA (tqdm bar when attached to a terminal)."""

    def __init__(self, total: int, desc: str, start: int = 0, unit: str = "step") -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.start_count = start
        self.count = start
        self.t0 = time.time()
        self._bar = None
        if os.isatty(2):
            self._bar = tqdm(total=total, initial=start, desc=desc, unit=unit, dynamic_ncols=True)

    def update(self, n: int = 1, **postfix: Any) -> str:
        self.count += n
        done = self.count - self.start_count
        el = time.time() - self.t0
        rate = done / el if el > 0 else 0.0
        eta = (self.total - self.count) / rate if rate > 0 else float("nan")
        extra = " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in postfix.items()
        )
        line = (
            f"{self.desc} {self.count}/{self.total} | {rate * 60:.2f} {self.unit}/min | "
            f"elapsed {_fmt(el)} | ETA {_fmt(eta)} | {extra}"
        )
        if self._bar is not None:
            self._bar.set_postfix_str(extra)
            self._bar.update(n)
        else:
            log.info(line)
        return line

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _fmt(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


# ------------------------------------------------------------------------ plots
_PLOTS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    # (file, title, metric keys, record kind)
    ("val_accuracy.png", "Memory-free validation accuracy", ("accuracy",), "eval"),
    ("memory_check.png", "Check before use: items by state, rows with memory",
     ("verify_memory_admitted", "verify_memory_pending", "verify_memory_rejected",
      "verify_memory_retired", "verify_items_tested"), "train"),
    ("teacher_signal.png", "Rows with a teacher signal, with memory items, memory alone",
     ("reprompt_sample_fraction", "memory_item_row_fraction", "memory_signal_row_fraction",
      "format_ok_fraction"), "train"),
    ("retention_accuracy.png", "Off-task retention accuracy (eval.retention)",
     ("retention_accuracy",), "eval"),
    ("reward.png", "Rollout reward (train)", ("reward_mean", "success_group_fraction"), "train"),
    ("loss.png", "Training loss", ("loss",), "train"),
    (
        "kl.png",
        "KL(student || teacher) and KL(policy || initial)",
        ("kl", "kl_policy_initial"),
        "train",
    ),
    (
        "memory_size.png",
        "Memory size by level",
        (
            "memory_experiences", "memory_insights", "memory_strategies", "memory_lessons",
            "memory_behaviors", "memory_clusters",
        ),
        "train",
    ),
    (
        "phase_times.png",
        "Per-phase time (s)",
        (
            "time_sample", "time_verify", "time_reflect", "time_memory", "time_train",
            "time_publish", "time_eval",
        ),
        "train",
    ),
)


def write_plots(run_dir: str | os.PathLike) -> list[epath.Path]:
    """Draws the standard PNG plots from ``run_dir/metrics.jsonl``; returns the files written."""
    # lazy: matplotlib only for the plots, which a run without plotting never draws
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib only for the plots, which a run without plotting never draws
    import matplotlib.pyplot as plt

    root = paths.run_path(run_dir)
    recs = read_metrics(root / "metrics.jsonl")
    plot_dir = paths.makedirs(root / "plots")
    written: list[epath.Path] = []
    for fname, title, keys, kind in _PLOTS:
        rows = [r for r in recs if r.get("kind") == kind]
        series = {
            k: [(r["step"], r[k]) for r in rows if isinstance(r.get(k), int | float)] for k in keys
        }
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        for k, pts in series.items():
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=k)
            if kind == "eval":
                lo = _all_numbers(
                    [r.get(f"{k}_ci_low") for r in rows if isinstance(r.get(k), int | float)])
                hi = _all_numbers(
                    [r.get(f"{k}_ci_high") for r in rows if isinstance(r.get(k), int | float)])
                if lo is not None and hi is not None:
                    ax.fill_between(xs, lo, hi, alpha=0.2, label=f"{k} 95% CI")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out = plot_dir / fname
        paths.save_figure(fig, out)  # PNG bytes through epath: works on gs:// too
        plt.close(fig)
        written.append(out)
    points = eval_kl_points(recs)
    if points:
        out = plot_dir / "accuracy_vs_kl.png"
        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        for key, label in (("accuracy", "held-out accuracy"),
                           ("retention_accuracy", "retention accuracy")):
            kl_pts = [p for p in points if p.get(key) is not None]
            if not kl_pts:
                continue
            kls, accs = [p["kl"] for p in kl_pts], [p[key] for p in kl_pts]
            line = ax.plot(kls, accs, marker="o", ms=3, label=label)[0]
            for p in kl_pts:
                ax.annotate(str(p["step"]), (p["kl"], p[key]), fontsize=6,
                            color=line.get_color(), xytext=(2, 2), textcoords="offset points")
        ax.set_title("Accuracy against KL(policy || initial) (labels: step)")
        ax.set_xlabel("KL(policy || initial), nats / token")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.save_figure(fig, out)
        plt.close(fig)
        written.append(out)
    return written


def _all_numbers(vals: list[Any]) -> list[int | float] | None:
    """``vals`` when every one is a number (int or float), else None."""
    nums = [v for v in vals if isinstance(v, int | float)]
    return nums if len(nums) == len(vals) else None


def eval_kl_points(recs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each evaluation with the KL(policy || initial) of the policy it evaluated.

    The evaluation at step s sees the weights after s updates: the policy that sampled train
    step s's rollouts, whose record carries ``kl_policy_initial`` (measured on those rollouts
    with the sampler's log-probs, pmd_jax.distill.kl). An evaluation record's own
    ``kl_policy_initial`` (measured at the evaluation) wins. An evaluation without either
    (the one after the last step, or a step ``train.kl_initial_every`` skipped) is left out.
    Returns dicts with step, kl, accuracy and (when measured) retention_accuracy."""
    kl = {int(r["step"]): float(r["kl_policy_initial"]) for r in recs
          if r.get("kind") == "train" and isinstance(r.get("kl_policy_initial"), int | float)}
    out: list[dict[str, Any]] = []
    for r in recs:
        if r.get("kind") != "eval" or not isinstance(r.get("accuracy"), int | float):
            continue
        step = int(r["step"])
        own = r.get("kl_policy_initial")
        k = float(own) if isinstance(own, int | float) else kl.get(step)
        if k is None:
            continue
        ret = r.get("retention_accuracy")
        out.append({"step": step, "kl": k, "accuracy": float(r["accuracy"]),
                    "retention_accuracy": float(ret) if isinstance(ret, int | float) else None})
    return out
