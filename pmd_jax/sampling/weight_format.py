"""The weight store's format: layout, manifest, checksums, and chunk-file I/O.

The version protocol (publish, commit, read, garbage collection) is ``weight_store.py``;
this module, like that one, needs only numpy and tensorstore (no jax, no pmd_jax).

Layout under a root (a local path, ``file://`` URL or ``gs://bucket/prefix``)::

    data/v000000000042/<hf name>/zarr.json, c/...   one zarr3 array per HF tensor
    data/v000000000042/_crc/p00000.json             per-process chunk checksums (multi-host)
    manifests/v000000000042.json                    the commit marker, written LAST

Arrays are named exactly as in the HF checkpoint ("model.layers.0.self_attn.q_proj.weight")
with HF shapes ([out, in] for linear layers), so vLLM's ``load_weights`` takes them as they
are. ``direct_io`` stores read and write the chunk files themselves (:func:`direct_write_piece`,
:func:`direct_read_array`): with the ``bytes`` codec a zarr3 chunk file is exactly the
chunk's little-endian C-order bytes, so tensorstore reads them and vice versa.

Sharded ``jax.Array`` inputs: the zarr chunk grid equals the array's shard shape, and every
process writes only its addressable shards with ``replica_id == 0`` (so each unique slice is
written exactly once across all processes). Plain numpy arrays are chunked along axis 0 into
chunks of at most ``max_chunk_bytes``.

Checksums (``CHECKSUM_ALGO``): per chunk, a Fletcher-style pair of 64-bit sums over the
chunk's C-order bytes: the bytes are cut into 4 KiB blocks (the last one zero-padded) read as
uint64 words; ``s1`` is the sum of all words and ``s2`` the sum of each block's word sum
times its 1-based block index, both mod 2**64; the digest is ``"<nbytes hex>:<s1>:<s2>"``.
Any change of a single word changes ``s1``; moved, swapped, zeroed or truncated blocks change
``s2`` or the length. It is not cryptographic and does not see reorderings within one 4 KiB
block. It runs at memory speed in numpy (several times faster than a software CRC), is
computed per shard on the host that writes it (a shard is exactly one chunk), and the manifest
combines them as the list of chunk digests in C order of the chunk grid. Readers recompute the
digests from the arrays they read and compare; a mismatch raises ``WeightStoreError`` naming
the array and chunk. Missing chunks are read errors (``fill_missing_data_reads=False``), never
silent zeros.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

MANIFEST_FORMAT = "pmd_jax.weights/1"
CHECKSUM_ALGO = "sum64x2-4k"
_BLOCK_WORDS = 512  # 4 KiB blocks
VERSION_DIGITS = 12
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)*$")
MANIFEST_RE = re.compile(rf"^v(\d{{{VERSION_DIGITS}}})\.json$")
VERSION_DIR_RE = re.compile(rf"^v(\d{{{VERSION_DIGITS}}})$")


class WeightStoreError(RuntimeError):
    """The store could not publish or serve a version (unreachable, corrupt, missing, bad input)."""


class VersionVanishedError(WeightStoreError):
    """The version being read was garbage-collected while it was read (readers retry)."""


@dataclasses.dataclass(frozen=True)
class TransferMetrics:
    """Timings and volume of one publish or read."""

    op: str  # "publish" or "read"
    version: int
    num_arrays: int
    bytes: int
    seconds: float
    write_or_read_seconds: float  # the data transfer part
    checksum_seconds: float  # computing / verifying digests (summed over threads)
    manifest_seconds: float

    @property
    def gbytes_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclasses.dataclass(frozen=True)
class Manifest:
    version: int
    step: int
    created: float
    arrays: dict[str, dict[str, Any]]  # name -> {shape, dtype, chunk_shape, checksums}
    extra: dict[str, Any]

    @property
    def names(self) -> list[str]:
        return list(self.arrays)

    @property
    def nbytes(self) -> int:
        return sum(
            math.prod(a["shape"]) * np.dtype(np_dtype(a["dtype"])).itemsize
            for a in self.arrays.values()
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": MANIFEST_FORMAT,
                "version": self.version,
                "step": self.step,
                "created": self.created,
                "names": self.names,
                "checksum": CHECKSUM_ALGO,
                "arrays": self.arrays,
                "extra": self.extra,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: bytes | str, where: str) -> Manifest:
        try:
            d = json.loads(text)
            if d.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format {d.get('format')!r} != {MANIFEST_FORMAT!r}")
            if d.get("checksum") != CHECKSUM_ALGO:
                raise ValueError(f"checksum {d.get('checksum')!r} != {CHECKSUM_ALGO!r}")
            arrays = d["arrays"]
            for name, a in arrays.items():
                for key in ("shape", "dtype", "chunk_shape", "checksums"):
                    if key not in a:
                        raise ValueError(f"array {name!r} lacks {key!r}")
            return cls(
                version=int(d["version"]),
                step=int(d["step"]),
                created=float(d["created"]),
                arrays=arrays,
                extra=dict(d.get("extra", {})),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise WeightStoreError(f"malformed manifest {where}: {e}") from e


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        # lazy: also loaded by the vLLM worker's environment (tensorstore, numpy; no jax)
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def zarr_dtype(dtype: np.dtype) -> str:
    name = np.dtype(dtype).name
    allowed = {
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64",
    }  # fmt: skip
    if name not in allowed:
        raise WeightStoreError(f"unsupported dtype {name!r} (supported: {sorted(allowed)})")
    return name


def chunk_grid(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-s // c) if c else 0 for s, c in zip(shape, chunk_shape, strict=True))


def chunk_key(idx: tuple[int, ...]) -> str:
    return "c/" + "/".join(str(i) for i in idx) if idx else "c"


def version_dir(version: int) -> str:
    return f"v{version:0{VERSION_DIGITS}d}"


def parse_store_url(url: str | os.PathLike) -> dict[str, Any]:
    """A local path, ``file:///abs/path`` or ``gs://bucket/prefix`` -> tensorstore kvstore spec."""
    url = os.fspath(url)
    if url.startswith("gs://"):
        bucket, _, path = url[len("gs://") :].partition("/")
        if not bucket:
            raise WeightStoreError(f"store URL {url!r} has no bucket")
        path = path.strip("/")
        return {"driver": "gcs", "bucket": bucket, "path": path + "/" if path else ""}
    if url.startswith("file://"):
        url = url[len("file://") :]
    elif "://" in url:
        raise WeightStoreError(f"unsupported store URL {url!r} (use a local path or gs://)")
    return {"driver": "file", "path": os.path.abspath(url) + "/"}


def is_jax_array(x: Any) -> bool:
    return hasattr(x, "addressable_shards") and hasattr(x, "sharding")


def zarr_metadata(plan: Mapping[str, Any]) -> dict[str, Any]:
    """The zarr3 metadata of a planned array (little-endian ``bytes`` codec, fill value 0)."""
    return {
        "shape": list(plan["shape"]),
        "data_type": plan["dtype"],
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": list(plan["chunk_shape"])},
        },
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "fill_value": 0,
    }


def chunk_keys(shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> list[str]:
    """The keys of every chunk of an array, in C order of the chunk grid."""
    grid = chunk_grid(shape, chunk_shape)
    return [chunk_key(i) for i in np.ndindex(*grid)] if grid else ["c"]


def chunk_path(root: str, version: int, name: str, ci: tuple[int, ...]) -> str:
    """The file of chunk ``ci`` of array ``name`` of ``version`` under a local ``root``."""
    return os.path.join(root, "data", version_dir(version), name, *chunk_key(ci).split("/"))


def build_manifest(version: int, step: int | None, plans: Mapping[str, Mapping[str, Any]],
                   all_crcs: Mapping[str, Mapping[str, str]], extra: dict[str, Any]) -> Manifest:
    """The manifest of a published version from its array plans (:func:`plan_array`) and
    every process's chunk digests; WeightStoreError if some chunk was written by no one."""
    marrays: dict[str, dict[str, Any]] = {}
    for name, p in plans.items():
        keys = chunk_keys(p["shape"], p["chunk_shape"])
        missing = [k for k in keys if k not in all_crcs[name]]
        if missing:
            raise WeightStoreError(
                f"publish: array {name!r} chunks {missing[:4]} were written by no process"
            )
        marrays[name] = {
            "shape": list(p["shape"]),
            "dtype": p["dtype"],
            "chunk_shape": list(p["chunk_shape"]),
            "checksums": [all_crcs[name][k] for k in keys],
        }
    return Manifest(
        version=version,
        step=version if step is None else int(step),
        created=time.time(),
        arrays=marrays,
        extra=extra,
    )


def checksum_errors(out: Mapping[str, np.ndarray], manifest: Manifest,
                    pre_crcs: Mapping[str, dict[str, str]]) -> dict[str, str]:
    """Arrays read whose chunk digests (``pre_crcs``, computed while reading, else now) do
    not match the manifest's: name -> error."""
    errors: dict[str, str] = {}
    for n, arr in out.items():
        meta = manifest.arrays[n]
        shape, chunk_shape = tuple(meta["shape"]), tuple(meta["chunk_shape"])
        got = pre_crcs.get(n) or piece_checksums(
            arr, tuple(slice(0, d) for d in shape), chunk_shape, shape
        )
        keys = chunk_keys(shape, chunk_shape)
        bad = [
            k
            for k, want in zip(keys, meta["checksums"], strict=False)
            if got.get(k) != want
        ]
        if bad or len(keys) != len(meta["checksums"]):
            errors[n] = f"checksum mismatch against the manifest in chunks {bad[:4]}"
    return errors


def plan_array(name: str, arr: Any, pidx: int, max_chunk_bytes: int) -> dict[str, Any]:
    """How one array is written: shape, zarr dtype, chunk shape and the pieces this process
    writes (a sharded ``jax.Array``: its ``replica_id == 0`` shards, one chunk each; numpy:
    the whole array on process 0, chunked along axis 0 into at most ``max_chunk_bytes``)."""
    shape = tuple(int(s) for s in arr.shape)
    dtype = zarr_dtype(arr.dtype)
    itemsize = np.dtype(np_dtype(dtype)).itemsize
    if is_jax_array(arr):
        pieces = []
        shard_shape = None
        for shard in arr.addressable_shards:
            idx = tuple(
                slice(*sl.indices(d)[:2]) for sl, d in zip(shard.index, shape, strict=True)
            )
            this = tuple(s.stop - s.start for s in idx)
            if shard_shape is None:
                shard_shape = this
            if shard.replica_id == 0:
                pieces.append((idx, shard.data))
        chunk_shape = tuple(max(c, 1) for c in (shard_shape or shape))
        for idx, _ in pieces:
            for s, c in zip(idx, chunk_shape, strict=True):
                if s.start % c:
                    raise WeightStoreError(
                        f"publish: shards of {name!r} are not aligned to a regular grid "
                        f"(shard start {s.start} not a multiple of {c})"
                    )
    else:
        a = np.asarray(arr)
        rows = max(1, max_chunk_bytes // max(1, itemsize * math.prod(shape[1:])))
        chunk_shape = (min(shape[0], rows), *shape[1:]) if shape else ()
        chunk_shape = tuple(max(c, 1) for c in chunk_shape)
        pieces = [(tuple(slice(0, d) for d in shape), a)] if pidx == 0 else []
    return {
        "shape": shape,
        "dtype": dtype,
        "chunk_shape": chunk_shape,
        "pieces": pieces,
        "itemsize": itemsize,
        "name": name,
    }


def direct_write_piece(
    root: str, version: int, p: Mapping[str, Any], idx: tuple[slice, ...], host: np.ndarray,
    sync: bool,
) -> tuple[dict[str, str], float]:
    """Write the chunks of one piece as plain files; returns (digests, checksum seconds)."""
    shape, chunk_shape = p["shape"], p["chunk_shape"]
    ranges = [
        range(sl.start // c, -(-sl.stop // c)) for sl, c in zip(idx, chunk_shape, strict=True)
    ]
    crcs: dict[str, str] = {}
    t_crc = 0.0
    for ci in _product(ranges):
        local = tuple(
            slice(i * c - sl.start, min((i + 1) * c, d) - sl.start)
            for i, c, sl, d in zip(ci, chunk_shape, idx, shape, strict=True)
        )
        region = np.require(host[local] if local else host, requirements="C")
        t = time.perf_counter()
        crcs[chunk_key(ci)] = checksum(region)
        t_crc += time.perf_counter() - t
        if region.shape != tuple(chunk_shape):  # zarr3 stores edge chunks full size
            full = np.zeros(chunk_shape, region.dtype)
            full[tuple(slice(0, n) for n in region.shape)] = region
            region = full
        path = chunk_path(root, version, p["name"], ci)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(region.reshape(-1).view(np.uint8).data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
    return crcs, t_crc


def direct_read_array(
    root: str, version: int, name: str, meta: Mapping[str, Any], verify: bool
) -> tuple[np.ndarray, dict[str, str] | None, float]:
    """Read one array from its chunk files; with ``verify`` also its chunk digests."""
    shape, chunk_shape = tuple(meta["shape"]), tuple(meta["chunk_shape"])
    t_crc = 0.0
    dtype = np_dtype(meta["dtype"])
    out = np.empty(shape, dtype)
    chunk_bytes = math.prod(chunk_shape) * dtype.itemsize
    grid = chunk_grid(shape, chunk_shape)
    crcs: dict[str, str] | None = {} if verify else None
    for ci in np.ndindex(*grid) if grid else [()]:
        region = tuple(
            slice(i * c, min((i + 1) * c, d))
            for i, c, d in zip(ci, chunk_shape, shape, strict=True)
        )
        path = chunk_path(root, version, name, ci)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise ValueError(f"chunk {chunk_key(ci)} is missing ({path})") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != chunk_bytes:
                raise ValueError(
                    f"chunk {chunk_key(ci)} has {size} bytes, expected {chunk_bytes}"
                )
            target = out[region] if region else out[...]
            if target.shape == chunk_shape and target.flags.c_contiguous:
                buf = target
            else:
                buf = np.empty(chunk_shape, dtype)
            if f.readinto(buf.reshape(-1).view(np.uint8).data) != chunk_bytes:
                raise ValueError(f"chunk {chunk_key(ci)} was truncated while reading")
            if buf is not target:
                target[...] = buf[tuple(slice(0, n) for n in target.shape)]
        if crcs is not None:
            t = time.perf_counter()
            crcs[chunk_key(ci)] = checksum(out[region] if region else out)
            t_crc += time.perf_counter() - t
    return out, crcs, t_crc


def checksum(data: np.ndarray) -> str:
    """``CHECKSUM_ALGO`` digest of an array's C-order bytes (see the module docstring)."""
    b = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    nbytes = b.size
    block = _BLOCK_WORDS * 8
    n_main = nbytes // block * block
    sums = [b[:n_main].view(np.uint64).reshape(-1, _BLOCK_WORDS).sum(axis=1, dtype=np.uint64)]
    if nbytes > n_main:
        tail = np.zeros(block, np.uint8)
        tail[: nbytes - n_main] = b[n_main:]
        sums.append(tail.view(np.uint64).sum(dtype=np.uint64, keepdims=True))
    bs = np.concatenate(sums)
    with np.errstate(over="ignore"):
        s1 = int(bs.sum(dtype=np.uint64))
        s2 = int((bs * np.arange(1, bs.size + 1, dtype=np.uint64)).sum(dtype=np.uint64))
    return f"{nbytes:x}:{s1:016x}:{s2:016x}"


def piece_checksums(
    host: np.ndarray,
    idx: tuple[slice, ...],
    chunk_shape: tuple[int, ...],
    shape: tuple[int, ...],
) -> dict[str, str]:
    """Digests of every chunk inside ``host`` = global[idx] (idx aligned to the chunk grid)."""
    ranges = [
        range(sl.start // c, -(-sl.stop // c)) for sl, c in zip(idx, chunk_shape, strict=True)
    ]
    out = {}
    for ci in _product(ranges):
        local = tuple(
            slice(i * c - sl.start, min((i + 1) * c, d) - sl.start)
            for i, c, sl, d in zip(ci, chunk_shape, idx, shape, strict=True)
        )
        out[chunk_key(ci)] = checksum(host[local])
    return out


def _product(ranges: list[range]) -> Iterable[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)
