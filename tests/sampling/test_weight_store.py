"""Versioned weight exchange over tensorstore: races, corruption, missing data, timeouts, GC."""

import json
import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pmd_jax.sampling.weight_store import (
    VersionVanishedError,
    WeightStore,
    WeightStoreError,
)
from tests.host import need_devices

SHAPES = {
    "model.embed_tokens.weight": (512, 256),  # 512 KiB fp32
    "model.layers.0.self_attn.q_proj.weight": (256, 256),
    "model.layers.0.mlp.down_proj.weight": (256, 640),
    "model.norm.weight": (256,),
}


def version_arrays(v: int) -> dict[str, np.ndarray]:
    """Every element of version v encodes v (so a torn read mixing versions is visible)."""
    out = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        n = int(np.prod(shape))
        out[name] = (
            (v * 1_000_000 + i * 100_000 + np.arange(n) % 1000).astype(np.float32).reshape(shape)
        )
    return out


def chunk_files(root: Path, version: int, name: str) -> list[Path]:
    d = root / "data" / f"v{version:012d}" / name / "c"
    return sorted(p for p in d.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- round trip
def test_roundtrip_dtypes_and_chunking(tmp_path):
    ws = WeightStore(tmp_path / "w", max_chunk_bytes=64 << 10)
    arrays = {
        "a.weight": np.random.default_rng(0).standard_normal((300, 100)).astype(np.float32),
        "b.bf16": np.random.default_rng(1).standard_normal((7, 5)).astype(ml_dtypes.bfloat16),
        "c.ids": np.arange(11, dtype=np.int32),
        "d.scalar": np.array(2.5, np.float32),
    }
    m = ws.publish(arrays, version=3, step=30)
    assert m.bytes == sum(a.nbytes for a in arrays.values()) and m.num_arrays == 4
    out, man = ws.read()
    assert man.version == 3 and man.step == 30 and man.names == list(arrays)
    for k, a in arrays.items():
        assert out[k].dtype == a.dtype and out[k].shape == a.shape
        np.testing.assert_array_equal(out[k], a)
    # 300 rows x 400 B = 120 KB > 64 KiB: split into several chunks, each with its own digest.
    assert len(man.arrays["a.weight"]["checksums"]) == 2
    assert ws.history[-1].op == "read" and ws.history[-1].bytes == m.bytes


def test_manifest_is_committed_last_and_atomic(tmp_path):
    ws = WeightStore(tmp_path / "w")
    ws.publish(version_arrays(1), version=1)
    mdir = tmp_path / "w" / "manifests"
    assert [p.name for p in mdir.iterdir()] == ["v000000000001.json"]  # no temp files left
    d = json.loads((mdir / "v000000000001.json").read_text())
    assert d["version"] == 1 and d["names"] == list(SHAPES)
    assert d["arrays"]["model.norm.weight"]["shape"] == [256]
    assert d["arrays"]["model.norm.weight"]["dtype"] == "float32"
    assert isinstance(d["created"], float)
    # data without a manifest is not a committed version
    shutil.copytree(
        tmp_path / "w" / "data" / "v000000000001", tmp_path / "w" / "data" / "v000000000002"
    )
    assert ws.list_versions() == [1]


def test_bad_input(tmp_path):
    ws = WeightStore(tmp_path / "w")
    with pytest.raises(WeightStoreError, match="no arrays"):
        ws.publish({}, version=0)
    for bad in ["../x", "/abs", "a b", "", "a//b"]:
        with pytest.raises(WeightStoreError, match="invalid array name"):
            ws.publish({bad: np.zeros(2, np.float32)}, version=0)
    with pytest.raises(WeightStoreError, match="unsupported dtype"):
        ws.publish({"x": np.zeros(2, np.complex64)}, version=0)
    ws.publish({"x": np.zeros(2, np.float32)}, version=0)
    with pytest.raises(WeightStoreError, match="already committed"):
        ws.publish({"x": np.zeros(2, np.float32)}, version=0)
    with pytest.raises(WeightStoreError, match="no arrays named"):
        ws.read(0, names=["y"])
    with pytest.raises(WeightStoreError, match="unsupported store URL"):
        WeightStore("s3://bucket/x")
    with pytest.raises(WeightStoreError, match="keep"):
        WeightStore(tmp_path / "w", keep=0)


# ----------------------------------------------------------------------------- race
def _writer(root: str, versions: int, keep: int, q) -> None:
    try:
        ws = WeightStore(root, keep=keep, file_io_sync=False)
        for v in range(versions):
            ws.publish(version_arrays(v), version=v)
        q.put(("writer", "ok", versions))
    except BaseException as e:  # report, never hang the parent
        q.put(("writer", "error", repr(e)))


def _reader(root: str, stop_path: str, q) -> None:
    try:
        ws = WeightStore(root, file_io_sync=False)
        seen: list[int] = []
        vanished = 0
        while True:
            done = os.path.exists(stop_path)
            if ws.latest_version() is not None:
                try:
                    arrays, man = ws.read(retries=0)
                except VersionVanishedError:
                    vanished += 1
                    continue
                expect = version_arrays(man.version)
                for name in SHAPES:
                    if not np.array_equal(arrays[name], expect[name]):
                        q.put(("reader", "torn", f"v{man.version} {name}"))
                        return
                seen.append(man.version)
            if done:
                break
        q.put(("reader", "ok", (seen, vanished)))
    except BaseException as e:
        q.put(("reader", "error", repr(e)))


def test_writer_and_reader_race_never_tear(tmp_path):
    root = str(tmp_path / "w")
    stop = str(tmp_path / "stop")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    nver, keep = 30, 2
    reader = ctx.Process(target=_reader, args=(root, stop, q))
    writer = ctx.Process(target=_writer, args=(root, nver, keep, q))
    reader.start()
    writer.start()
    results = {}
    try:
        msg = q.get(timeout=150)
        results[msg[0]] = msg
        if msg[0] == "writer":
            Path(stop).touch()
        msg = q.get(timeout=60)
        results[msg[0]] = msg
        if msg[0] == "writer":
            Path(stop).touch()
            results["reader"] = q.get(timeout=60)
    finally:
        Path(stop).touch()
        for p in (reader, writer):
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results["writer"][1] == "ok", results["writer"]
    assert results["reader"][1] == "ok", results["reader"]
    seen, _vanished = results["reader"][2]
    assert len(set(seen)) >= 2, f"reader did not overlap the writer: {seen}"
    assert seen == sorted(seen)  # versions only move forward
    assert seen[-1] == nver - 1  # after the writer finished, the reader saw the last one
    assert WeightStore(root).list_versions() == list(range(nver - keep, nver))


# ----------------------------------------------------------------------------- damage
def test_corrupted_chunk_is_caught_naming_the_array(tmp_path):
    ws = WeightStore(tmp_path / "w")
    ws.publish(version_arrays(1), version=1)
    name = "model.layers.0.mlp.down_proj.weight"
    f = chunk_files(tmp_path / "w", 1, name)[0]
    raw = bytearray(f.read_bytes())
    raw[1000] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(WeightStoreError, match=r"damaged.*down_proj") as ei:
        ws.read(1)
    assert "q_proj" not in str(ei.value).split(":")[1]  # only the damaged array is named
    # the other arrays still read
    out, _ = ws.read(1, names=["model.norm.weight"])
    np.testing.assert_array_equal(out["model.norm.weight"], version_arrays(1)["model.norm.weight"])


def test_stale_chunk_from_another_version_is_caught(tmp_path):
    """A chunk file that is valid by itself but from another version fails the manifest."""
    ws = WeightStore(tmp_path / "w", keep=5)
    ws.publish(version_arrays(1), version=1)
    ws.publish(version_arrays(2), version=2)
    name = "model.layers.0.self_attn.q_proj.weight"
    src = chunk_files(tmp_path / "w", 1, name)[0]
    dst = chunk_files(tmp_path / "w", 2, name)[0]
    shutil.copyfile(src, dst)
    with pytest.raises(WeightStoreError, match=r"q_proj.*checksum mismatch against the manifest"):
        ws.read(2)


def test_manifest_pointing_at_missing_arrays(tmp_path):
    ws = WeightStore(tmp_path / "w")
    ws.publish(version_arrays(1), version=1)
    # a whole array gone
    shutil.rmtree(tmp_path / "w" / "data" / "v000000000001" / "model.norm.weight")
    with pytest.raises(WeightStoreError, match=r"model\.norm\.weight.*cannot open"):
        ws.read(1)
    # one chunk gone: never silently read as zeros
    f = chunk_files(tmp_path / "w", 1, "model.embed_tokens.weight")[0]
    f.unlink()
    with pytest.raises(WeightStoreError, match=r"embed_tokens"):
        ws.read(1, names=["model.embed_tokens.weight"])
    # a manifest naming an array that was never written
    mpath = tmp_path / "w" / "manifests" / "v000000000001.json"
    d = json.loads(mpath.read_text())
    d["arrays"]["model.ghost.weight"] = dict(d["arrays"]["model.norm.weight"])
    mpath.write_text(json.dumps(d))
    with pytest.raises(WeightStoreError, match=r"model\.ghost\.weight"):
        ws.read(1, names=["model.ghost.weight"])
    # a malformed manifest
    mpath.write_text("{not json")
    with pytest.raises(WeightStoreError, match="malformed manifest"):
        ws.read(1)


# ----------------------------------------------------------------------------- unreachable
def test_nonexistent_local_store_is_a_clear_error(tmp_path):
    ws = WeightStore(tmp_path / "does" / "not" / "exist", timeout_s=2)
    assert ws.list_versions() == []
    with pytest.raises(WeightStoreError, match="no committed weight version.*no such path"):
        ws.read()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises((WeightStoreError, OSError)):
        WeightStore(blocker / "sub", timeout_s=5).publish({"x": np.zeros(3, np.float32)}, 0)


def test_unreachable_gcs_store_times_out_with_a_clear_error():
    """No network (or no credentials) here: the call must fail within the timeout, not hang."""
    ws = WeightStore("gs://pmd-jax-test-no-such-bucket-7f3a/weights", timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(WeightStoreError, match="pmd-jax-test-no-such-bucket-7f3a"):
        ws.read()
    assert time.monotonic() - t0 < 15.0
    t0 = time.monotonic()
    with pytest.raises(WeightStoreError, match="gs://pmd-jax-test-no-such-bucket-7f3a"):
        ws.publish({"x": np.zeros(3, np.float32)}, version=0)
    assert time.monotonic() - t0 < 15.0


# ----------------------------------------------------------------------------- gc
def test_gc_keeps_newest_k(tmp_path):
    ws = WeightStore(tmp_path / "w", keep=3)
    for v in range(7):
        ws.publish({"x": np.full(10, v, np.float32)}, version=v)
    assert ws.list_versions() == [4, 5, 6]
    assert sorted(p.name for p in (tmp_path / "w" / "data").iterdir()) == [
        "v000000000004",
        "v000000000005",
        "v000000000006",
    ]
    with pytest.raises(VersionVanishedError, match="not committed"):
        ws.read(2)
    # an orphan (crashed publish, no manifest) older than the kept ones is collected too
    shutil.copytree(
        tmp_path / "w" / "data" / "v000000000004", tmp_path / "w" / "data" / "v000000000001"
    )
    assert ws.gc(keep=1) == [4, 5]
    assert ws.list_versions() == [6]
    assert [p.name for p in (tmp_path / "w" / "data").iterdir()] == ["v000000000006"]
    np.testing.assert_array_equal(ws.read()[0]["x"], np.full(10, 6, np.float32))


# ----------------------------------------------------------------------------- sharded
def test_sharded_publish_on_8_devices_reads_back_equal(tmp_path):
    mesh = Mesh(np.array(need_devices(8)).reshape(4, 2), ("x", "y"))
    rng = np.random.default_rng(0)
    host = {
        "two_axes.weight": rng.standard_normal((64, 32)).astype(np.float32),
        "rows_replicated_over_y.weight": rng.standard_normal((64, 48)).astype(np.float32),
        "replicated.weight": rng.standard_normal((40,)).astype(np.float32),
        "bf16.weight": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
    }
    specs = {
        "two_axes.weight": P("x", "y"),
        "rows_replicated_over_y.weight": P("x", None),
        "replicated.weight": P(),
        "bf16.weight": P(None, "y"),
    }
    arrays = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    ws = WeightStore(tmp_path / "w")
    m = ws.publish(arrays, version=0)
    # each unique slice written once: replicas are not written again
    assert m.bytes == sum(a.nbytes for a in host.values())
    out, man = ws.read(0)
    for k, a in host.items():
        np.testing.assert_array_equal(out[k], a)
    assert man.arrays["two_axes.weight"]["chunk_shape"] == [16, 16]
    assert len(man.arrays["two_axes.weight"]["checksums"]) == 8
    assert man.arrays["rows_replicated_over_y.weight"]["chunk_shape"] == [16, 48]
    assert man.arrays["replicated.weight"]["chunk_shape"] == [40]
    # the same values published unsharded carry the same content; only chunking differs
    ws.publish(host, version=1)
    out1, _ = ws.read(1)
    for k in host:
        np.testing.assert_array_equal(out1[k], out[k])


# ----------------------------------------------------------------------------- checksum
def _reference_checksum(data: bytes) -> str:
    """The documented algorithm, written out with Python integers."""
    n = len(data)
    padded = data + bytes(-n % 4096)
    words = [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)]
    blocks = [sum(words[i : i + 512]) % 2**64 for i in range(0, len(words), 512)]
    s1 = sum(blocks) % 2**64
    s2 = sum((k + 1) * b for k, b in enumerate(blocks)) % 2**64
    return f"{n:x}:{s1:016x}:{s2:016x}"


def test_checksum_matches_reference_and_sees_damage():
    from pmd_jax.sampling.weight_store import checksum

    rng = np.random.default_rng(0)
    for n in [1, 7, 8, 4096, 4097, 20011]:
        a = rng.integers(0, 256, n, dtype=np.uint8)
        assert checksum(a) == _reference_checksum(a.tobytes())
    x = rng.standard_normal((64, 96)).astype(np.float32)  # 24 KiB = 6 blocks
    assert checksum(x) == _reference_checksum(x.tobytes())
    assert checksum(x.astype(ml_dtypes.bfloat16)) == _reference_checksum(
        x.astype(ml_dtypes.bfloat16).tobytes()
    )
    flipped = x.copy()
    flipped.view(np.uint32)[10, 3] ^= 1 << 7
    swapped = x.copy()
    swapped[:16], swapped[16:32] = x[16:32], x[:16]  # two 4 KiB blocks exchanged
    zeroed = x.copy()
    zeroed[32:48] = 0
    digests = {checksum(v) for v in (x, flipped, swapped, zeroed, x[:-1])}
    assert len(digests) == 5


@pytest.mark.parametrize("writer_direct,reader_direct", [(True, False), (False, True)])
def test_direct_io_and_tensorstore_paths_interoperate(tmp_path, writer_direct, reader_direct):
    """Plain-file chunk I/O and tensorstore's zarr3 driver read each other's arrays."""
    rng = np.random.default_rng(3)
    arrays = {
        "multi.chunk": rng.standard_normal((300, 70)).astype(np.float32),  # edge chunk padded
        "bf16": rng.standard_normal((9, 4)).astype(ml_dtypes.bfloat16),
        "scalar": np.array(7, np.int32),
    }
    kw = {"max_chunk_bytes": 32 << 10}
    WeightStore(tmp_path / "w", direct_io=writer_direct, **kw).publish(arrays, version=0)
    out, man = WeightStore(tmp_path / "w", direct_io=reader_direct, **kw).read(0)
    assert len(man.arrays["multi.chunk"]["checksums"]) == 3
    for k, a in arrays.items():
        assert out[k].shape == a.shape and out[k].dtype == a.dtype
        np.testing.assert_array_equal(out[k], a)
    # and with tensorstore itself, independent of our reader
    import tensorstore as ts

    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(tmp_path / "w/data/v000000000000/multi.chunk")},
    }
    np.testing.assert_array_equal(ts.open(spec).result().read().result(), arrays["multi.chunk"])


def test_version_collected_mid_read_is_detected_and_retried(tmp_path):
    """GC deletes the version a reader is in the middle of: never a torn or zero-filled read."""
    writer = WeightStore(tmp_path / "w", keep=1)
    writer.publish(version_arrays(0), version=0)

    class CollectedMidRead(WeightStore):
        fired = False

        def _direct_read_array(self, version, name, meta, verify):
            if not CollectedMidRead.fired:
                CollectedMidRead.fired = True
                writer.publish(version_arrays(1), version=1)  # keep=1: deletes version 0
            return super()._direct_read_array(version, name, meta, verify)

    reader = CollectedMidRead(tmp_path / "w", concurrency=1)
    arrays, man = reader.read()  # latest: retried on version 1
    assert man.version == 1
    for k, a in version_arrays(1).items():
        np.testing.assert_array_equal(arrays[k], a)
    CollectedMidRead.fired = False
    writer.gc_on_publish = False
    writer.publish(version_arrays(2), version=2)

    class CollectedMidRead2(CollectedMidRead):
        def _direct_read_array(self, version, name, meta, verify):
            if not CollectedMidRead.fired:
                CollectedMidRead.fired = True
                writer.gc(keep=1)  # deletes version 1 while it is read
            return WeightStore._direct_read_array(self, version, name, meta, verify)

    with pytest.raises(VersionVanishedError, match="version 1 was garbage-collected"):
        CollectedMidRead2(tmp_path / "w", concurrency=1).read(1)
