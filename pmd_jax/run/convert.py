"""Convert a run's checkpoints written with pickled host state to the current format, once.

    python -m pmd_jax.run.convert --run_dir=RUN_DIR [--dry_run]

Checkpoints written before host-state version 1 (``run/host_state.py``) pickled the memory,
the mode's state and the prefetched rollouts; a resume refuses them, because unpickling can
run code. This command unpickles them (so: only checkpoints you trust, e.g. your own) and
rewrites each such slot of every committed step as versioned JSON + arrays, then writes the
step's commit marker again. The train state (orbax arrays) is not touched. A step that fails
its commit check is left as it is and reported. Exit status: 0 when every step is in the
current format afterwards, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pmd_jax.run import host_state
from pmd_jax.run.checkpoint import verify_step_dir, write_commit_marker
from pmd_jax.run.slots import CheckpointError, load_pickle, write_bytes_sync

# the slots that held pickles ("fast_slow": the mode state's name before the mode registry)
PICKLED_SLOTS = ("memory", "prefetch", "mode_state", "fast_slow")
_BLOB, _KIND = "blob.bin", "kind"


def _as_tree(slot: str, obj: Any) -> Any:
    """What the current format stores for a slot's unpickled value."""
    if slot == "prefetch" and obj is not None and not isinstance(obj, dict):
        if not hasattr(obj, "messages"):  # (pickled before StepBatch carried them: the
            obj.messages = []  # resume asks the task for them again)
        return obj.to_tree()
    return obj


def convert_step(step_dir: Path, step: int, dry_run: bool = False) -> list[str]:
    """Rewrites ``step_dir``'s pickled slots; returns the slots converted (or to convert)."""
    verify_step_dir(step_dir, step)
    todo = [s for s in PICKLED_SLOTS
            if (step_dir / s / _KIND).is_file()
            and (step_dir / s / _KIND).read_text() == "bytes"]
    if dry_run or not todo:
        return todo
    for slot in todo:
        d = step_dir / slot
        state = host_state.encode(_as_tree(slot, load_pickle((d / _BLOB).read_bytes())))
        write_bytes_sync(d / host_state.STATE_FILE, state.doc_bytes())
        write_bytes_sync(d / host_state.ARRAYS_FILE, state.arrays_bytes())
        write_bytes_sync(d / _KIND, b"state")
        os.remove(d / _BLOB)
    write_commit_marker(step_dir, step)
    return todo


def convert_run(run_dir: Path, dry_run: bool = False, out: Any = None) -> int:
    """Converts every step of ``run_dir``'s checkpoints; prints a line per step to ``out``
    (stdout); 0 when all are in the current format afterwards."""
    out = out or sys.stdout
    root = Path(run_dir) / "checkpoints"
    steps = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) \
        if root.is_dir() else []
    if not steps:
        print(f"no checkpoint in {root}", file=out)
        return 1
    failed = 0
    for step in steps:
        try:
            done = convert_step(root / str(step), step, dry_run)
        except (CheckpointError, host_state.HostStateError) as e:
            print(f"step {step}: left as it is: {e}", file=out)
            failed += 1
            continue
        verb = "to convert" if dry_run else "converted"
        print(f"step {step}: {verb}: {', '.join(done)}" if done
              else f"step {step}: already in the current format", file=out)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pmd_jax.run.convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run_dir", required=True, type=Path)
    ap.add_argument("--dry_run", action="store_true", help="list what would be converted")
    args = ap.parse_args(argv)
    return convert_run(args.run_dir, args.dry_run)


if __name__ == "__main__":
    raise SystemExit(main())
