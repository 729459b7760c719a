"""Hardware targets for ``--dry_run --config.dry_run.target=NAME``, and the fit / roofline maths.

Per-chip figures (public sources, read 2026-11):

* TPU v5p: Google Cloud TPU docs, "TPU v5p" system architecture table
  (cloud.google.com/tpu/docs/v5p): 459 TFLOP/s peak bf16 per chip, 95 GB HBM2e at
  2765 GB/s; a v5p-N slice is N TensorCores = N/2 chips (2 TensorCores per chip, e.g.
  "v5p-32 has 16 chips"), so v5p-64 is 32 chips.
* TPU v5e: Google Cloud TPU docs, "TPU v5e" (cloud.google.com/tpu/docs/v5e): 197 TFLOP/s
  peak bf16 per chip, 16 GB HBM2 at 819 GB/s, one TensorCore per chip; v5e-256 = 256 chips.
* H100 SXM: NVIDIA H100 Tensor Core GPU datasheet: 80 GB HBM3, 3.35 TB/s, BF16 Tensor Core
  1,979 TFLOP/s *with sparsity*, i.e. 989 TFLOP/s dense (what a dense matmul can reach).
* H200 SXM: NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e, 4.8 TB/s, BF16 Tensor Core
  1,979 TFLOP/s with sparsity, 989 TFLOP/s dense.

GB here is 10^9 bytes as the vendors write it. Usable memory is lower than the HBM size (the
runtime, XLA's own reservations; ``XLA_PYTHON_CLIENT_MEM_FRACTION`` defaults to 75% on GPU):
the verdict reports headroom against the full HBM, so read a small headroom as "does not fit".
"""

from __future__ import annotations

import dataclasses
from typing import Any

GB = 10**9
GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    chips: int  # devices of the mesh (one JAX device per chip: v5p megacore, one GPU)
    hbm_bytes: int  # per chip
    peak_bf16_flops: float  # per chip, dense, per second
    hbm_bytes_per_s: float  # per chip
    source: str


TARGETS: dict[str, Target] = {
    t.name: t for t in (
        Target("v5p-64", 32, 95 * GB, 459e12, 2765e9, "Google Cloud TPU docs, TPU v5p"),
        Target("v5e-256", 256, 16 * GB, 197e12, 819e9, "Google Cloud TPU docs, TPU v5e"),
        Target("8xH100", 8, 80 * GB, 989e12, 3.35e12, "NVIDIA H100 SXM datasheet"),
        Target("8xH200", 8, 141 * GB, 989e12, 4.8e12, "NVIDIA H200 SXM datasheet"),
    )
}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"unknown dry-run target {name!r}; known: {sorted(TARGETS)}")
    return TARGETS[name]


@dataclasses.dataclass(frozen=True)
class Verdict:
    fits: bool
    need_bytes: int
    hbm_bytes: int
    headroom_bytes: int  # hbm - need (negative: short by that much)
    headroom_frac: float  # headroom / hbm

    @property
    def word(self) -> str:
        return "FITS" if self.fits else "DOES NOT FIT"


def verdict(need_bytes: float, hbm_bytes: float) -> Verdict:
    """Per-device memory need vs the chip's HBM: fits iff need <= HBM."""
    if hbm_bytes <= 0:
        raise ValueError(f"HBM size must be > 0, got {hbm_bytes}")
    if need_bytes < 0:
        raise ValueError(f"memory need must be >= 0, got {need_bytes}")
    head = int(hbm_bytes) - int(need_bytes)
    return Verdict(head >= 0, int(need_bytes), int(hbm_bytes), head, head / float(hbm_bytes))


def memory_need(ma: Any) -> dict[str, int]:
    """Per-device bytes from ``compiled.memory_analysis()``: arguments, outputs, aliased
    (donated outputs that reuse an argument buffer), temporaries, and the total
    ``arguments + outputs - aliased + temporaries`` (XLA:CPU reports no peak)."""
    get = lambda k: int(getattr(ma, k, 0) or 0)  # noqa: E731
    out = {
        "arguments": get("argument_size_in_bytes"),
        "outputs": get("output_size_in_bytes"),
        "aliased": get("alias_size_in_bytes"),
        "temporaries": get("temp_size_in_bytes"),
    }
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    return out


@dataclasses.dataclass(frozen=True)
class Roofline:
    seconds: float  # max(compute, memory) time: a LOWER BOUND on the step time
    compute_s: float
    memory_s: float
    bound: str  # "compute" or "memory"
    mfu: float  # model FLOPs / (seconds * peak): the best MFU this roofline allows


def roofline(flops: float, bytes_accessed: float, t: Target,
             model_flops: float | None = None) -> Roofline:
    """Per device: ``time = max(flops / peak, bytes / bandwidth)``. ``model_flops`` (useful
    FLOPs per device, e.g. without remat recompute) for the MFU; default ``flops``."""
    if flops < 0 or bytes_accessed < 0:
        raise ValueError(f"flops and bytes must be >= 0, got {flops}, {bytes_accessed}")
    c = flops / t.peak_bf16_flops
    m = bytes_accessed / t.hbm_bytes_per_s
    s = max(c, m)
    useful = flops if model_flops is None else model_flops
    mfu = useful / (s * t.peak_bf16_flops) if s > 0 else 0.0
    return Roofline(s, c, m, "compute" if c >= m else "memory", mfu)
