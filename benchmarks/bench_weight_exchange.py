"""Weight exchange: WeightStore publish + read vs raw sequential write + read of the same bytes.

Weights: the embedded SmolLM2-135M-Instruct in float32 (~540 MB, 272 HF-named arrays).
Peer: ``ndarray.tofile`` of every array into one file, then ``np.fromfile`` back (no
checksums, no manifest, no chunking), in the same run, on the same disk. Both sides end with
the arrays in memory as numpy. Reported: seconds of each, and throughput ratios
(raw seconds / store seconds; >= 0.7 is the target). Both sides run ``--repeats`` times and
the best run counts (the machine is shared; the minimum is the least disturbed).

With ``--vllm-url`` (a server started by launch/vllm_server.sh on the same weights) it also
times ``VLLMSampler.set_weights`` of the published version: store read + verification +
``load_weights`` inside the server + prefix-cache reset.

  python benchmarks/bench_weight_exchange.py [--dir DIR] [--repeats 3] [--sync]
      [--vllm-url http://127.0.0.1:8000 --vllm-model MODEL_DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np


def smollm2_fp32_arrays() -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    from pmd_jax.models.gguf_io import smollm2_hf_dir

    d = smollm2_hf_dir()
    arrays: dict[str, np.ndarray] = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        arrays.update(load_file(f))
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items()}


def raw_roundtrip(arrays: dict[str, np.ndarray], path: Path, sync: bool) -> tuple[float, float]:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for a in arrays.values():
            a.tofile(f)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    t_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = {}
    with open(path, "rb") as f:
        for k, a in arrays.items():
            out[k] = np.fromfile(f, dtype=a.dtype, count=a.size).reshape(a.shape)
    t_read = time.perf_counter() - t0
    assert all(out[k].shape == a.shape for k, a in arrays.items())
    return t_write, t_read


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="scratch dir (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sync", action="store_true", help="fsync data on both sides")
    ap.add_argument("--vllm-url", default=None)
    ap.add_argument("--vllm-model", default=None)
    ap.add_argument("--reloads", type=int, default=3)
    args = ap.parse_args()

    from pmd_jax.sampling.weight_store import WeightStore

    arrays = smollm2_fp32_arrays()
    nbytes = sum(a.nbytes for a in arrays.values())
    print(f"SmolLM2-135M fp32: {len(arrays)} arrays, {nbytes / 1e6:.1f} MB")
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="bench-wx-"))
    scratch.mkdir(parents=True, exist_ok=True)
    store_dir = scratch / "store"
    raw_path = scratch / "raw.bin"
    shutil.rmtree(store_dir, ignore_errors=True)
    ws = WeightStore(store_dir, keep=1, file_io_sync=args.sync)

    raw_w, raw_r, st_w, st_r = [], [], [], []
    for rep in range(args.repeats):
        w, r = raw_roundtrip(arrays, raw_path, args.sync)
        raw_w.append(w)
        raw_r.append(r)
        m = ws.publish(arrays, version=rep)
        t0 = time.perf_counter()
        out, _ = ws.read(rep)
        st_r.append(time.perf_counter() - t0)
        st_w.append(m.seconds)
        assert all(np.array_equal(out[k], a) for k, a in arrays.items())
        print(
            f"  rep {rep}: raw write {w:.3f}s read {r:.3f}s | store publish {m.seconds:.3f}s "
            f"(write {m.write_or_read_seconds:.3f}, digests {m.checksum_seconds:.3f}, "
            f"manifest {m.manifest_seconds:.3f}) read {st_r[-1]:.3f}s "
            f"(digests {ws.history[-1].checksum_seconds:.3f})"
        )
    raw_total = min(a + b for a, b in zip(raw_w, raw_r, strict=True))
    st_total = min(a + b for a, b in zip(st_w, st_r, strict=True))
    res = {
        "bytes": nbytes,
        "sync": args.sync,
        "raw_write_s": min(raw_w),
        "raw_read_s": min(raw_r),
        "store_publish_s": min(st_w),
        "store_read_s": min(st_r),
        "publish_ratio": min(raw_w) / min(st_w),
        "read_ratio": min(raw_r) / min(st_r),
        "roundtrip_ratio": raw_total / st_total,
    }
    print(
        f"raw   : write {res['raw_write_s']:.3f}s  read {res['raw_read_s']:.3f}s  "
        f"({nbytes / raw_total / 1e9:.2f} GB/s round trip)"
    )
    print(
        f"store : publish {res['store_publish_s']:.3f}s  read {res['store_read_s']:.3f}s  "
        f"({nbytes / st_total / 1e9:.2f} GB/s round trip)"
    )
    print(
        f"ratio (raw time / store time): publish {res['publish_ratio']:.2f}  "
        f"read {res['read_ratio']:.2f}  round trip {res['roundtrip_ratio']:.2f}  (target >= 0.70)"
    )

    if args.vllm_url:
        from pmd_jax.sampling.vllm_client import VLLMSampler

        smp = VLLMSampler(args.vllm_url, args.vllm_model or "", store_url=str(store_dir))
        smp.wait_until_ready(600)
        lat = []
        for i in range(args.reloads):
            v = args.repeats + i
            ws.publish(arrays, version=v)
            t0 = time.perf_counter()
            smp.set_weights(v)
            lat.append(time.perf_counter() - t0)
            print(f"  vLLM reload v{v}: {lat[-1]:.3f}s  server side {smp.last_reload}")
        res["vllm_reload_s"] = min(lat)
        print(f"vLLM reload latency (set_weights, best of {len(lat)}): {min(lat):.3f}s")
    print(json.dumps(res))
    if args.dir is None:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
