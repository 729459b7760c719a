"""Versioned weight exchange over tensorstore: the trainer publishes, samplers read.

Layout under a root (a local path, ``file://`` URL or ``gs://bucket/prefix``)::

    data/v000000000042/<hf name>/zarr.json, c/...   one zarr3 array per HF tensor
    data/v000000000042/_crc/p00000.json             per-process chunk checksums (multi-host)
    manifests/v000000000042.json                    the commit marker, written LAST

A version is *committed* once its manifest exists; readers only list manifests, so they
never see a version that is still being written. The manifest is written atomically
(temp file + ``os.replace`` locally; a single object write on GCS, which is atomic).
Array names, shapes, chunking and checksums: ``weight_format.py``.

Garbage collection keeps the newest ``keep`` committed versions and deletes older ones
(manifest first, then data). A reader that loses the race (its version was deleted while it
read) notices it because the manifest is gone after the data read, and retries with the then
newest version; a read whose manifest still exists after the data read finished cannot have
been affected by deletion, because deletion starts by removing the manifest.

Every remote operation runs under a deadline (``timeout_s``): an unreachable store raises
``WeightStoreError`` saying what timed out, instead of hanging.

This module and ``weight_format.py`` need only numpy and tensorstore: the vLLM worker
extension (``third_party/pmd_vllm``) loads this file by path, without jax or pmd_jax.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import tensorstore as ts

if __package__:  # imported as pmd_jax.sampling.weight_store
    from pmd_jax.sampling import weight_format as fmt
else:  # loaded from its file (third_party/pmd_vllm): the format module from its file, too
    import importlib.util
    import sys

    _spec = importlib.util.spec_from_file_location(
        f"{__name__}_format", os.path.join(os.path.dirname(__file__), "weight_format.py"))
    assert _spec is not None and _spec.loader is not None
    fmt = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(fmt)

# The format's names used here and by callers of this module.
Manifest = fmt.Manifest
TransferMetrics = fmt.TransferMetrics
VersionVanishedError = fmt.VersionVanishedError
WeightStoreError = fmt.WeightStoreError
checksum = fmt.checksum
parse_store_url = fmt.parse_store_url


class WeightStore:
    """Publish and read versions of named arrays under one root.

    ``timeout_s`` bounds every blocking tensorstore call; ``keep`` is how many committed
    versions garbage collection keeps (``publish`` collects after committing when
    ``gc_on_publish``). ``file_io_sync`` makes local writes durable (fsync) before the
    manifest is committed; without it a crash can leave a committed version whose chunks
    were lost, which the checksums then report.

    ``direct_io`` (default: on for local stores): tensorstore writes each array's zarr3
    metadata, but chunk files are read and written with plain file I/O straight from / into
    the numpy buffers. With the ``bytes`` codec a zarr3 chunk file is exactly the chunk's
    little-endian C-order bytes, so the result is the same zarr3 array (tensorstore reads it,
    and this class reads tensorstore-written arrays); it saves tensorstore's intermediate
    copies. gs:// stores always go through tensorstore.
    """

    def __init__(
        self,
        url: str | os.PathLike,
        *,
        timeout_s: float = 60.0,
        keep: int = 2,
        gc_on_publish: bool = True,
        max_chunk_bytes: int = 64 << 20,
        file_io_sync: bool = True,
        concurrency: int = 8,
        direct_io: bool | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> None:
        if keep < 1:
            raise WeightStoreError(f"keep must be >= 1, got {keep}")
        if timeout_s <= 0:
            raise WeightStoreError(f"timeout_s must be > 0, got {timeout_s}")
        self.url = os.fspath(url)
        self.kvspec = parse_store_url(url)
        self.is_local = self.kvspec["driver"] == "file"
        self.timeout_s = float(timeout_s)
        self.keep = keep
        self.gc_on_publish = gc_on_publish
        self.max_chunk_bytes = max_chunk_bytes
        self.concurrency = max(1, concurrency)
        self.file_io_sync = file_io_sync
        self.direct_io = self.is_local if direct_io is None else bool(direct_io)
        if self.direct_io and not self.is_local:
            raise WeightStoreError("direct_io needs a local store")
        self._process_index = process_index
        self._process_count = process_count
        self.context = ts.Context(
            {
                "file_io_sync": file_io_sync,
                "file_io_concurrency": {"limit": concurrency},
                "data_copy_concurrency": {"limit": concurrency},
                "cache_pool": {"total_bytes_limit": 0},
            }
        )
        self._kv: ts.KvStore | None = None
        self.history: list[TransferMetrics] = []

    # ----------------------------------------------------------------------------- helpers
    def _wait(self, fut: Any, what: str, deadline: float | None = None) -> Any:
        remaining = self.timeout_s if deadline is None else deadline - time.monotonic()
        try:
            return fut.result(timeout=max(remaining, 0.0))
        except TimeoutError as e:
            fut.cancel()
            raise WeightStoreError(
                f"timed out after {self.timeout_s:.1f}s {what} (store {self.url!r}); "
                "is the store reachable?"
            ) from e

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _kvstore(self) -> ts.KvStore:
        if self._kv is None:
            self._kv = self._wait(
                ts.KvStore.open(self.kvspec, context=self.context), "opening the kvstore"
            )
        return self._kv

    def _array_spec(self, version: int, name: str) -> dict[str, Any]:
        kv = dict(self.kvspec)
        kv["path"] = kv["path"] + f"data/{fmt.version_dir(version)}/{name}/"
        return {"driver": "zarr3", "kvstore": kv}

    def _data_prefix(self, version: int) -> str:
        return f"data/{fmt.version_dir(version)}/"

    def _manifest_key(self, version: int) -> str:
        return f"manifests/{fmt.version_dir(version)}.json"

    def _proc(self) -> tuple[int, int]:
        if self._process_index is not None:
            return self._process_index, self._process_count or 1
        return 0, self._process_count or 1

    # ----------------------------------------------------------------------------- listing
    def list_versions(self) -> list[int]:
        """Committed versions (manifest present), ascending."""
        if self.is_local:
            mdir = os.path.join(self.kvspec["path"], "manifests")
            try:
                entries = os.listdir(mdir)
            except FileNotFoundError:
                return []
            except OSError as e:
                raise WeightStoreError(f"cannot list {mdir!r}: {e}") from e
        else:
            keys = self._wait(
                self._kvstore().list(ts.KvStore.KeyRange("manifests/", "manifests0")),
                "listing manifests",
            )
            entries = [k.decode().rsplit("/", 1)[-1] for k in keys]
        out = []
        for entry in entries:
            m = fmt.MANIFEST_RE.match(entry)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_version(self) -> int | None:
        versions = self.list_versions()
        return versions[-1] if versions else None

    def read_manifest(self, version: int) -> Manifest:
        where = f"{self.url}/{self._manifest_key(version)}"
        res = self._wait(
            self._kvstore().read(self._manifest_key(version)), f"reading manifest {where}"
        )
        if res.state != "value":
            raise VersionVanishedError(f"version {version} is not committed (no manifest {where})")
        return Manifest.from_json(res.value, where)

    def _manifest_exists(self, version: int) -> bool:
        res = self._wait(
            self._kvstore().read(self._manifest_key(version)), f"checking manifest v{version}"
        )
        return res.state == "value"

    # ----------------------------------------------------------------------------- publish
    def publish(
        self,
        arrays: Mapping[str, Any],
        version: int,
        step: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> TransferMetrics:
        """Write ``arrays`` (name -> numpy or jax.Array) as ``version`` and commit its manifest.

        On multi-process jax runs every process calls this with the same global arrays;
        each writes its own shards and process 0 commits the manifest once all processes
        have reported their chunk digests.
        """
        t0 = time.perf_counter()
        if not arrays:
            raise WeightStoreError("publish: no arrays given")
        if version < 0 or version >= 10**fmt.VERSION_DIGITS:
            raise WeightStoreError(f"publish: version must be in [0, 1e12), got {version}")
        for name in arrays:
            if not isinstance(name, str) or not fmt.NAME_RE.match(name) or ".." in name.split("/"):
                raise WeightStoreError(f"publish: invalid array name {name!r}")
            if name == "_crc" or name.startswith("_crc/"):
                raise WeightStoreError(f"publish: array name {name!r} is reserved")
        pidx, pcount = self._proc()
        if any(fmt.is_jax_array(a) for a in arrays.values()) and self._process_index is None:
            # lazy: third_party/pmd_vllm loads this file where jax is not installed
            import jax

            pidx, pcount = jax.process_index(), jax.process_count()
        if pidx == 0 and version in self.list_versions():
            raise WeightStoreError(f"publish: version {version} is already committed")

        deadline = self._deadline()
        # 1. create every array (process 0 writes metadata; others open it) and write slices.
        plans = {name: fmt.plan_array(name, arr, pidx, self.max_chunk_bytes)
                 for name, arr in arrays.items()}
        t_write = time.perf_counter()
        kv = self._kvstore()
        prefix = self._data_prefix(version)
        if pidx == 0:
            # Leftovers of a crashed publish of this same (uncommitted) version go first.
            self._wait(
                kv.delete_range(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")),
                f"clearing uncommitted data of version {version}",
                deadline,
            )
        open_futs = {}
        for name, p in plans.items():
            spec = self._array_spec(version, name)
            spec["metadata"] = fmt.zarr_metadata(p)
            # Chunks equal to the fill value must still be written: a missing chunk is an error.
            spec["store_data_equal_to_fill_value"] = True
            if pidx == 0:
                spec["create"] = True
                open_futs[name] = ts.open(spec, context=self.context)
        if pcount > 1:
            # Process 0 created the metadata; the others open the arrays once it is there.
            for name in open_futs:
                self._wait(open_futs[name], f"creating array {name!r}", deadline)
            _barrier(f"pmd_weight_store_create_v{version}")
            for name in plans:
                if name not in open_futs:
                    spec = self._array_spec(version, name)
                    spec["open"] = True
                    open_futs[name] = ts.open(spec, context=self.context)
        write_futs = []
        nbytes = 0
        local_crcs: dict[str, dict[str, str]] = {}
        for name, p in plans.items():
            store = self._wait(open_futs[name], f"creating array {name!r}", deadline)
            p["host"] = []
            for idx, data in p["pieces"]:
                host = np.asarray(data)
                nbytes += host.nbytes
                p["host"].append((idx, host))
                if not self.direct_io:
                    write_futs.append(
                        (name, store[idx].write(host, can_reference_source_data_indefinitely=True))
                    )
        t_crc = 0.0
        if self.direct_io:
            jobs = [(name, p, idx, host) for name, p in plans.items() for idx, host in p["host"]]
            with ThreadPoolExecutor(self.concurrency) as pool:
                results = list(
                    pool.map(lambda j: (j[0], self._direct_write_piece(version, *j[1:])), jobs)
                )
            for name, (crcs, secs) in results:
                local_crcs.setdefault(name, {}).update(crcs)
                t_crc += secs
        else:
            # Checksums of this process's chunks, computed while tensorstore writes.
            t_crc = time.perf_counter()
            for name, p in plans.items():
                for idx, host in p["host"]:
                    local_crcs.setdefault(name, {}).update(
                        fmt.piece_checksums(host, idx, p["chunk_shape"], p["shape"])
                    )
            t_crc = time.perf_counter() - t_crc
        for name, fut in write_futs:
            try:
                self._wait(fut.commit, f"writing array {name!r}", deadline)
            except WeightStoreError:
                raise
            except Exception as e:
                raise WeightStoreError(f"publish: writing array {name!r} failed: {e}") from e
        t_write = time.perf_counter() - t_write

        # 3. commit (process 0, after gathering every process's digests).
        t_man = time.perf_counter()
        if pcount > 1:
            self._wait(
                kv.write(f"{prefix}_crc/p{pidx:05d}.json", json.dumps(local_crcs).encode()),
                "writing chunk digests",
                deadline,
            )
        if pidx == 0:
            all_crcs: dict[str, dict[str, str]] = {n: {} for n in plans}
            if pcount > 1:
                for q in range(pcount):
                    key = f"{prefix}_crc/p{q:05d}.json"
                    while True:
                        res = self._wait(kv.read(key), f"waiting for {key}", deadline)
                        if res.state == "value":
                            break
                        if time.monotonic() > deadline:
                            raise WeightStoreError(
                                f"publish: process {q} did not report its chunk digests for "
                                f"version {version} within {self.timeout_s:.0f}s"
                            )
                        time.sleep(0.05)
                    for n, d in json.loads(res.value).items():
                        all_crcs.setdefault(n, {}).update(d)
            else:
                for n, d in local_crcs.items():
                    all_crcs[n].update(d)
            manifest = fmt.build_manifest(version, step, plans, all_crcs,
                                          dict(extra or {}, host=socket.gethostname(),
                                               processes=pcount))
            self._commit_manifest(version, manifest.to_json().encode(), deadline)
        t_man = time.perf_counter() - t_man

        metrics = TransferMetrics(
            op="publish",
            version=version,
            num_arrays=len(plans),
            bytes=nbytes,
            seconds=time.perf_counter() - t0,
            write_or_read_seconds=t_write,
            checksum_seconds=t_crc,
            manifest_seconds=t_man,
        )
        self.history.append(metrics)
        if pidx == 0 and self.gc_on_publish:
            self.gc()
        return metrics

    def _direct_write_piece(
        self, version: int, p: Mapping[str, Any], idx: tuple[slice, ...], host: np.ndarray
    ) -> tuple[dict[str, str], float]:
        """Write the chunks of one piece as plain files; returns (digests, checksum seconds)."""
        return fmt.direct_write_piece(
            self.kvspec["path"], version, p, idx, host, self.file_io_sync)

    def _direct_read_array(
        self, version: int, name: str, meta: Mapping[str, Any], verify: bool
    ) -> tuple[np.ndarray, dict[str, str] | None, float]:
        """Read one array from its chunk files; with ``verify`` also its chunk digests."""
        return fmt.direct_read_array(self.kvspec["path"], version, name, meta, verify)

    def _commit_manifest(self, version: int, payload: bytes, deadline: float) -> None:
        key = self._manifest_key(version)
        if self.is_local:
            mdir = os.path.join(self.kvspec["path"], "manifests")
            os.makedirs(mdir, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=mdir)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(payload)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, os.path.join(self.kvspec["path"], key))
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        else:
            self._wait(self._kvstore().write(key, payload), f"writing manifest {key}", deadline)

    # ----------------------------------------------------------------------------- read
    def read(
        self,
        version: int | None = None,
        names: Iterable[str] | None = None,
        *,
        verify: bool = True,
        retries: int = 3,
    ) -> tuple[dict[str, np.ndarray], Manifest]:
        """Read a committed version (the newest when ``version`` is None) as numpy arrays.

        When reading the newest version and it is garbage-collected mid-read, retries with
        the then newest version (up to ``retries`` times). A named version that vanished
        raises ``VersionVanishedError``.
        """
        for attempt in range(retries + 1):
            v = version
            if v is None:
                v = self.latest_version()
                if v is None:
                    where = self.kvspec["path"] if self.is_local else self.url
                    exists = "" if not self.is_local or os.path.isdir(where) else " (no such path)"
                    raise WeightStoreError(
                        f"no committed weight version under {self.url!r}{exists}"
                    )
            try:
                return self._read_version(v, names, verify)
            except VersionVanishedError:
                if version is not None or attempt == retries:
                    raise
        raise AssertionError("unreachable")

    def _read_version(
        self, version: int, names: Iterable[str] | None, verify: bool
    ) -> tuple[dict[str, np.ndarray], Manifest]:
        t0 = time.perf_counter()
        deadline = self._deadline()
        manifest = self.read_manifest(version)
        wanted = list(manifest.arrays) if names is None else list(names)
        unknown = [n for n in wanted if n not in manifest.arrays]
        if unknown:
            raise WeightStoreError(f"version {version} has no arrays named {unknown[:5]}")
        t_read = time.perf_counter()
        open_futs = {}
        for name in wanted:
            spec = self._array_spec(version, name)
            spec.update(open=True, fill_missing_data_reads=False)
            open_futs[name] = ts.open(spec, context=self.context)
        read_futs = {}
        errors: dict[str, str] = {}
        for name in wanted:
            try:
                store = self._wait(open_futs[name], f"opening array {name!r}", deadline)
            except WeightStoreError:
                raise
            except Exception as e:  # missing metadata
                errors[name] = f"cannot open: {e}"
                continue
            meta = manifest.arrays[name]
            if list(store.shape) != list(meta["shape"]) or store.dtype.name != meta["dtype"]:
                errors[name] = (
                    f"stored shape/dtype {list(store.shape)}/{store.dtype.name} != manifest "
                    f"{meta['shape']}/{meta['dtype']}"
                )
                continue
            if not self.direct_io:
                read_futs[name] = store.read()
        out: dict[str, np.ndarray] = {}
        pre_crcs: dict[str, dict[str, str]] = {}
        worker_crc_s = 0.0  # checksum time inside the reader threads (overlaps the I/O)
        if self.direct_io:
            ok = [n for n in wanted if n not in errors]

            def job(name: str) -> tuple[str, Any]:
                try:
                    return name, self._direct_read_array(
                        version, name, manifest.arrays[name], verify
                    )
                except (OSError, ValueError) as e:
                    return name, e

            with ThreadPoolExecutor(self.concurrency) as pool:
                for name, res in pool.map(job, ok):
                    if isinstance(res, Exception):
                        errors[name] = str(res)
                    else:
                        out[name], crcs, secs = res
                        worker_crc_s += secs
                        if crcs is not None:
                            pre_crcs[name] = crcs
        for name, fut in read_futs.items():
            try:
                out[name] = self._wait(fut, f"reading array {name!r}", deadline)
            except WeightStoreError:
                raise
            except Exception as e:
                errors[name] = str(e)
        t_read = time.perf_counter() - t_read
        t_crc = time.perf_counter()
        if verify:
            errors.update(fmt.checksum_errors(out, manifest, pre_crcs))
        t_crc = time.perf_counter() - t_crc + worker_crc_s
        # Deletion removes the manifest first: if it is still there, nothing we read was deleted.
        t_man = time.perf_counter()
        if not self._manifest_exists(version):
            raise VersionVanishedError(f"version {version} was garbage-collected while reading")
        t_man = time.perf_counter() - t_man
        if errors:
            lines = "; ".join(f"{n}: {msg}" for n, msg in list(errors.items())[:5])
            raise WeightStoreError(
                f"version {version} under {self.url!r} is damaged: "
                f"{len(errors)} array(s) failed ({', '.join(list(errors)[:5])}): {lines}"
            )
        metrics = TransferMetrics(
            op="read",
            version=version,
            num_arrays=len(out),
            bytes=sum(a.nbytes for a in out.values()),
            seconds=time.perf_counter() - t0,
            write_or_read_seconds=t_read,
            checksum_seconds=t_crc,
            manifest_seconds=t_man,
        )
        self.history.append(metrics)
        return out, manifest

    # ----------------------------------------------------------------------------- gc
    def gc(self, keep: int | None = None) -> list[int]:
        """Delete all but the newest ``keep`` committed versions (manifest first, then data).

        Also removes data of uncommitted versions older than the oldest kept one (left by
        a crashed publish). Returns the deleted versions.
        """
        keep = self.keep if keep is None else keep
        if keep < 1:
            raise WeightStoreError(f"gc: keep must be >= 1, got {keep}")
        versions = self.list_versions()
        doomed = versions[:-keep] if len(versions) > keep else []
        kv = self._kvstore()
        for v in doomed:
            self._delete_key(self._manifest_key(v))
        for v in doomed:
            self._wait(
                kv.delete_range(
                    ts.KvStore.KeyRange(self._data_prefix(v), self._data_prefix(v)[:-1] + "0")
                ),
                f"deleting version {v}",
            )
        removed = list(doomed)
        if versions and len(versions) > keep:
            oldest_kept = versions[-keep]
            for v in self._data_versions():
                if v < oldest_kept and v not in doomed:
                    self._wait(
                        kv.delete_range(
                            ts.KvStore.KeyRange(
                                self._data_prefix(v), self._data_prefix(v)[:-1] + "0"
                            )
                        ),
                        f"deleting orphan data of version {v}",
                    )
                    removed.append(v)
        if self.is_local:
            for v in removed:
                _remove_empty_dirs(os.path.join(self.kvspec["path"], "data", fmt.version_dir(v)))
        return doomed

    def _delete_key(self, key: str) -> None:
        if self.is_local:
            try:
                os.unlink(os.path.join(self.kvspec["path"], key))
            except FileNotFoundError:
                pass
        else:
            self._wait(self._kvstore().delete_range(ts.KvStore.KeyRange(key, key + "\0")), key)

    def _data_versions(self) -> list[int]:
        if not self.is_local:
            return []  # listing every chunk key on GCS is costly; orphans there are left
        try:
            entries = os.listdir(os.path.join(self.kvspec["path"], "data"))
        except FileNotFoundError:
            return []
        out = []
        for e in entries:
            m = fmt.VERSION_DIR_RE.match(e)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)


def _barrier(name: str) -> None:
    """All jax processes reach this point before any goes on (multi-host publish)."""
    # lazy: third_party/pmd_vllm loads this file where jax is not installed
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def _remove_empty_dirs(path: str) -> None:
    for root, _dirs, files in os.walk(path, topdown=False):
        if not files and not os.listdir(root):
            try:
                os.rmdir(root)
            except OSError:
                pass
