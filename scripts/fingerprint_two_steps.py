"""Fingerprint of the embedded default's first two steps, to prove a refactor changed nothing.

    python scripts/fingerprint_two_steps.py --run_dir=/tmp/fp_before --out=before.json
    ... move code ...
    python scripts/fingerprint_two_steps.py --run_dir=/tmp/fp_after --out=after.json
    python scripts/fingerprint_two_steps.py --compare before.json after.json

A run is ``python -m pmd_jax.main --config=configs/smollm2_sciq.py`` with two steps and one
evaluation at the end (every other knob is the default, so the memory, the teacher and the
reflections all take part). The fingerprint holds the SHA-256 of every exported tensor
(``final_hf``), of ``memory.jsonl``, of each evaluation's per-problem records
(``eval/*/*.jsonl``) and of each step's metrics without the fields that measure time or host
memory. ``--compare`` prints every difference and exits 1 if there is one.

``--modes``: instead, tiny two-step runs of every registered mode (``tests/tiny_runs.TINY``: a
random tiny Llama with SmolLM2's tokenizer on real SciQ problems), one fingerprint per mode in
one file (``--compare`` takes two such files too)::

    python scripts/fingerprint_two_steps.py --modes --run_dir=/tmp/fpm_before --out=before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

# metrics that measure the machine (wall time, host memory, rates), not the computation
_VOLATILE_PREFIXES = ("time", "rss_", "wall")
_VOLATILE_SUFFIXES = ("_s", "_per_s", "_per_min", "_gib", "_eta")


def _volatile(key: str) -> bool:
    k = key.lower()
    return k.startswith(_VOLATILE_PREFIXES) or k.endswith(_VOLATILE_SUFFIXES)


def run(run_dir: Path, extra: list[str]) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pmd_jax.main",
        "--config=configs/smollm2_sciq.py",
        f"--config.run_dir={run_dir}",
        "--config.train.steps=2",
        "--config.train.eval_at_start=False",
        "--config.train.eval_every=0",
        "--config.resume=False",
        *extra,
    ]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def run_modes(run_dir: Path, extra: list[str]) -> dict[str, dict]:
    """A tiny two-step run of every registered mode, fingerprinted (mode -> fingerprint)."""
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from pmd_jax.modes import mode_names
    from tests.tiny_runs import TINY

    out = {}
    for mode in mode_names():
        d = run_dir / mode
        # steps=2 and no checkpoints beyond the defaults' (TINY's steps=3 comes first)
        # and an evaluation at the end (its texts are fingerprinted too)
        run(d, [*TINY, f"--config.mode={mode}", "--config.train.steps=2",
                "--config.train.eval_every=0", *extra])
        out[mode] = fingerprint(d)
        print(f"{mode}: {len(out[mode]['tensors'])} tensors, {len(out[mode]['metrics'])} "
              "metrics records", flush=True)
    return out


def fingerprint(run_dir: Path) -> dict:
    from safetensors.numpy import load_file

    tensors: dict[str, str] = {}
    for f in sorted((run_dir / "final_hf").glob("*.safetensors")):
        for name, arr in sorted(load_file(str(f)).items()):
            h = hashlib.sha256(arr.tobytes()).hexdigest()
            tensors[name] = f"{arr.dtype}{list(arr.shape)}:{h}"
    metrics = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        metrics.append({k: v for k, v in sorted(rec.items()) if not _volatile(k)})
    mem = run_dir / "memory.jsonl"
    evals = {str(f.relative_to(run_dir)): hashlib.sha256(f.read_bytes()).hexdigest()
             for f in sorted(run_dir.glob("eval/*/*.jsonl"))}
    return {
        "eval_files": evals,
        "tensors": tensors,
        "metrics": metrics,
        "memory_jsonl_sha256": hashlib.sha256(mem.read_bytes()).hexdigest()
        if mem.exists()
        else None,
        "memory_records": len(mem.read_text().splitlines()) if mem.exists() else 0,
    }


def compare(a: dict, b: dict) -> list[str]:
    diffs = []
    for name in sorted(set(a["tensors"]) | set(b["tensors"])):
        if a["tensors"].get(name) != b["tensors"].get(name):
            diffs.append(f"tensor {name}: {a['tensors'].get(name)} != {b['tensors'].get(name)}")
    for key in ("memory_jsonl_sha256", "memory_records", "eval_files"):
        if a.get(key) != b.get(key):
            diffs.append(f"{key}: {a[key]} != {b[key]}")
    if len(a["metrics"]) != len(b["metrics"]):
        diffs.append(f"metrics records: {len(a['metrics'])} != {len(b['metrics'])}")
    for i, (ra, rb) in enumerate(zip(a["metrics"], b["metrics"], strict=False)):
        for k in sorted(set(ra) | set(rb)):
            if ra.get(k) != rb.get(k):
                diffs.append(f"metrics[{i}].{k}: {ra.get(k)!r} != {rb.get(k)!r}")
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--run_dir", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", nargs=2, type=Path)
    ap.add_argument("--skip_run", action="store_true", help="fingerprint an existing run_dir")
    ap.add_argument("--modes", action="store_true",
                    help="tiny two-step runs of every mode instead of the embedded default")
    ap.add_argument("extra", nargs="*", help="more --config.* overrides")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        pairs = ({m: (a[m], b.get(m)) for m in a} if "tensors" not in a
                 else {"": (a, b)})
        total = 0
        for name, (fa, fb) in pairs.items():
            if fb is None:
                print(f"{name}: missing from {args.compare[1]}")
                total += 1
                continue
            diffs = compare(fa, fb)
            total += len(diffs)
            for d in diffs:
                print(f"{name}: {d}" if name else d)
            print(f"{name or 'run'}: {len(diffs)} differences ({len(fa['tensors'])} tensors, "
                  f"{len(fa['metrics'])} metrics records, {fa['memory_records']} memory "
                  "records compared)")
        return 1 if total else 0
    if args.run_dir is None or args.out is None:
        ap.error("--run_dir and --out are needed (or --compare A B)")
    if args.modes:
        fps = run_modes(args.run_dir, args.extra)
        args.out.write_text(json.dumps(fps, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.out}: {len(fps)} modes")
        return 0
    if not args.skip_run:
        run(args.run_dir, args.extra)
    fp = fingerprint(args.run_dir)
    args.out.write_text(json.dumps(fp, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}: {len(fp['tensors'])} tensors, {len(fp['metrics'])} metrics records, "
          f"{fp['memory_records']} memory records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
