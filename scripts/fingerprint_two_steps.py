"""Fingerprint of the embedded default's first two steps, to prove a refactor changed nothing.

    python scripts/fingerprint_two_steps.py --run_dir=/tmp/fp_before --out=before.json
    ... move code ...
    python scripts/fingerprint_two_steps.py --run_dir=/tmp/fp_after --out=after.json
    python scripts/fingerprint_two_steps.py --compare before.json after.json

A run is ``python -m pmd_jax.main --config=configs/smollm2_sciq.py`` with two steps and no
evaluation (every other knob is the default, so the memory, the teacher and the reflections
all take part). The fingerprint holds the SHA-256 of every exported tensor (``final_hf``),
of ``memory.jsonl`` and of each step's metrics without the fields that measure time or host
memory. ``--compare`` prints every difference and exits 1 if there is one.
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
    return {
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
    for key in ("memory_jsonl_sha256", "memory_records"):
        if a[key] != b[key]:
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
    ap.add_argument("extra", nargs="*", help="more --config.* overrides")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        diffs = compare(a, b)
        for d in diffs:
            print(d)
        n = len(a["tensors"])
        print(f"{len(diffs)} differences ({n} tensors, {len(a['metrics'])} metrics records, "
              f"{a['memory_records']} memory records compared)")
        return 1 if diffs else 0
    if args.run_dir is None or args.out is None:
        ap.error("--run_dir and --out are needed (or --compare A B)")
    if not args.skip_run:
        run(args.run_dir, args.extra)
    fp = fingerprint(args.run_dir)
    args.out.write_text(json.dumps(fp, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}: {len(fp['tensors'])} tensors, {len(fp['metrics'])} metrics records, "
          f"{fp['memory_records']} memory records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
