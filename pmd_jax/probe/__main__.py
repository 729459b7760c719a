"""Command line of the memory content probe.

    python -m pmd_jax.probe --config=configs/smollm2_sciq.py \
        --memory=runs/probe/sciq_memory_only_seed0/memory.jsonl --out=docs/results/probe_sciq \
        [--samples=16] [--screen_samples=8] [--max_train=64] [--max_heldout=100] \
        [--train_arms=none,own_insights,...] [--heldout_arms=...] [--config.*=...]

The config is the one of the run that wrote the memory (its task, model and sampling
settings; ``--config.*`` overrides as for ``pmd_jax.main``: another model reads the same
memory with ``--config.model.source=...``). Writes ``probe.json``, ``probe.md`` and
``probe.png`` under ``--out``; progress lines with rate and ETA on stderr. A bad config or
flag fails before any model is loaded (exit 2). Each finished batch of attempts is appended
to ``--out``/probe_batches.jsonl: a killed probe restarted with the same command redoes only
the batch it was in.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from absl import flags
from ml_collections import config_flags

from pmd_jax.config.cache import setup_compilation_cache
from pmd_jax.config.cli import apply_taken, run_command, setup_logging
from pmd_jax.config.cli import report_errors as _report
from pmd_jax.config.modes import apply_mode
from pmd_jax.config.validate import config_errors, freeze
from pmd_jax.probe import arms as arms_mod
from pmd_jax.probe.memory_file import MemoryFileError, load_memory_file
from pmd_jax.probe.run import ProbeError, ProbeRunner, write_outputs

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config (as for pmd_jax.main).",
                                          lock_config=True)
_MEMORY = flags.DEFINE_string("memory", None, "memory.jsonl of a run, or its run folder.")
_OUT = flags.DEFINE_string("out", None, "Folder for probe.json / probe.md / probe.png.")
_SAMPLES = flags.DEFINE_integer("samples", 16, "Attempts per (problem, arm).")
_SCREEN = flags.DEFINE_integer("screen_samples", 8, "Screening attempts per problem.")
_MAX_TRAIN = flags.DEFINE_integer("max_train", 64, "Training problems kept after screening.")
_MAX_HELDOUT = flags.DEFINE_integer("max_heldout", 100,
                                    "Held-out problems kept after screening (0: none).")
_HELDOUT_CANDIDATES = flags.DEFINE_integer(
    "heldout_candidates", 200, "Held-out problems screened (the evaluation split's first).")
_TRAIN_ARMS = flags.DEFINE_list("train_arms", list(arms_mod.TRAIN_ARMS),
                                f"Arms on training problems: {', '.join(arms_mod.TRAIN_ARMS)}.")
_HELDOUT_ARMS = flags.DEFINE_list(
    "heldout_arms", list(arms_mod.HELDOUT_ARMS),
    f"Arms on held-out problems: {', '.join(arms_mod.HELDOUT_ARMS)}.")

_COMMAND_LINE: list = []


def main(argv: list[str]) -> int:
    del argv

    setup_logging()

    cfg = _CONFIG.value
    line = _COMMAND_LINE[-1] if _COMMAND_LINE else None
    errs = list(line.errors) if line is not None else []
    if cfg is None:
        return _report(["--config=configs/<name>.py is required"])
    if line is not None:
        apply_taken(cfg, line)
    errs += config_errors(apply_mode(cfg))
    if not _MEMORY.value:
        errs.append("--memory=<run folder or memory.jsonl> is required")
    if not _OUT.value:
        errs.append("--out=<folder> is required")
    for name, v, lo in (("samples", _SAMPLES.value, 2), ("screen_samples", _SCREEN.value, 2),
                        ("max_train", _MAX_TRAIN.value, 1), ("max_heldout", _MAX_HELDOUT.value, 0)):
        if v < lo:
            errs.append(f"--{name}={v}: must be >= {lo}")
    for group, given in (("train", _TRAIN_ARMS.value), ("heldout", _HELDOUT_ARMS.value)):
        try:
            arms_mod.check_arms(group, given)
        except ValueError as e:
            errs.append(str(e))
    memory = None
    if _MEMORY.value:
        try:
            memory = load_memory_file(_MEMORY.value)
        except MemoryFileError as e:
            errs.append(str(e))
    if errs or memory is None:
        return _report(errs)
    run_cfg = freeze(cfg)
    setup_compilation_cache(run_cfg.train)

    t0 = time.time()
    try:
        runner = ProbeRunner(run_cfg, memory, samples=_SAMPLES.value,
                             screen_samples=_SCREEN.value, max_train=_MAX_TRAIN.value,
                             max_heldout=_MAX_HELDOUT.value,
                             heldout_candidates=_HELDOUT_CANDIDATES.value,
                             train_arms=_TRAIN_ARMS.value, heldout_arms=_HELDOUT_ARMS.value,
                             resume_dir=Path(str(_OUT.value)))
        result = runner.run()
    except ProbeError as e:
        return _report([str(e)])
    setup = {
        "command": "python -m pmd_jax.probe " + " ".join(sys.argv[1:]),
        "memory": memory.summary(), "model": run_cfg.model.source, "task": run_cfg.task.name,
        "grading split (training problems)": runner.split, "samples": _SAMPLES.value,
        "screen_samples": _SCREEN.value, "temperature": run_cfg.rollout.temperature,
        "max_tokens": run_cfg.rollout.max_tokens, "seed": run_cfg.seed,
        "behavior.top_k": run_cfg.memory.behavior.top_k,
        "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(t0)),
    }
    data = write_outputs(Path(str(_OUT.value)), setup, result)
    for c in data["contrasts"]:
        print(f"{c['group']:8s} {c['a']:>18s} - {c['b']:<16s} n={c['problems']:3d} "
              f"{c['mean']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}] "
              f"MDD {c['mdd']:.3f}  {c['verdict']}")
    print(json.dumps({"out": _OUT.value, "minutes": round((time.time() - t0) / 60, 1)}))
    return 0


def run() -> None:
    run_command(main, _COMMAND_LINE)


if __name__ == "__main__":
    run()
