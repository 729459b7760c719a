"""train.offload_initial_policy: the initial policy written to a file and read back for the
KL to it (pmd_jax/distill/offload.py). Round trip bit for bit with each leaf's sharding, the
KL equal to the one computed from the arrays in memory, a missing file named in the error."""

import os
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pmd_jax.distill import kl
from pmd_jax.distill.offload import DiskParams
from pmd_jax.models import decoder
from pmd_jax.models.config import tiny_llama
from pmd_jax.run import sharding as sh


def test_round_trip_is_bitwise_with_dtypes_and_shardings(tmp_path):
    rng = np.random.default_rng(0)
    tree = {
        "w": jnp.asarray(rng.normal(size=(8, 6)).astype(np.float32)),
        "b16": jnp.asarray(rng.normal(size=(5,)).astype(ml_dtypes.bfloat16)),
        "ids": [jnp.arange(7, dtype=jnp.int32), jnp.float32(3.5)],
        "host": np.arange(6, dtype=np.int64).reshape(2, 3),  # a host value: loaded as one
    }
    if jax.device_count() >= 8:
        mesh = sh.make_mesh({"data": 2, "fsdp": 4, "tensor": 1}, devices=jax.devices()[:8])
        spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", None))
        tree["w"] = jax.device_put(tree["w"], spec)
    disk = DiskParams.write(tree, tmp_path / "p.bin")
    back = disk.load()
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True):
        assert type(a) is type(b) or (isinstance(a, jax.Array) and isinstance(b, jax.Array))
        assert a.dtype == b.dtype and a.shape == b.shape
        assert getattr(a, "sharding", None) == getattr(b, "sharding", None)
        np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                      np.asarray(b).reshape(-1).view(np.uint8))
    # every shard starts 64-byte aligned; a shard replicated over the data axis is written
    # once, so the file holds each leaf's bytes once (plus padding)
    assert all(s.offset % 64 == 0 for leaf in disk.leaves for s in leaf.shards)
    assert (tmp_path / "p.bin").stat().st_size == disk.nbytes_on_disk
    total = sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))
    assert total <= disk.nbytes_on_disk < total + 64 * 16
    assert not list(tmp_path.glob("*.tmp"))


def test_missing_or_truncated_file_is_named(tmp_path):
    disk = DiskParams.write({"w": jnp.ones((4, 4))}, tmp_path / "p.bin")
    with open(tmp_path / "p.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(FileNotFoundError, match="p.bin"):
        disk.load()
    disk.remove()
    assert not (tmp_path / "p.bin").exists()
    with pytest.raises(FileNotFoundError, match="missing"):
        disk.load()


def test_write_temp_names_the_file_by_run_and_remove_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    disk = DiskParams.write_temp({"w": jnp.ones((3,))}, "/runs/a")
    assert disk.path.parent == tmp_path and disk.path.name.startswith("pmd_jax_initial_policy_")
    # a restarted run (same run directory) overwrites its file; another run gets its own
    assert DiskParams.write_temp({"w": jnp.zeros((3,))}, "/runs/a").path == disk.path
    other = DiskParams.write_temp({"w": jnp.ones((3,))}, "/runs/b")
    assert other.path != disk.path and len(list(tmp_path.iterdir())) == 2
    np.testing.assert_array_equal(disk.load()["w"], np.zeros(3))
    disk.remove()
    other.remove()
    assert not list(tmp_path.iterdir())


def test_a_failed_write_leaves_no_partial_file_and_a_killed_writers_is_removed(
        tmp_path, monkeypatch):
    """A write that fails (a full disk) removes its temporary file and raises; the temporary
    file of a writer that was killed (it cannot remove its own) is removed by the next write
    of the same file, while a live writer's is kept."""
    import subprocess
    import sys
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    real = np.ascontiguousarray
    calls = []

    def disk_full_on_second(a):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(a)

    monkeypatch.setattr(np, "ascontiguousarray", disk_full_on_second)
    with pytest.raises(OSError, match="No space left"):
        DiskParams.write({"a": jnp.ones((3,)), "b": jnp.ones((4,))}, tmp_path / "x.bin")
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(np, "ascontiguousarray", real)

    name = DiskParams.write_temp({"w": jnp.ones((3,))}, "/runs/a").path.name
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / f"{name}.{dead}.tmp").write_bytes(b"partial")
    (tmp_path / f"{name}.{os.getppid()}.tmp").write_bytes(b"being written")
    DiskParams.write_temp({"w": jnp.zeros((3,))}, "/runs/a")
    assert sorted(p.name for p in tmp_path.iterdir()) == [name, f"{name}.{os.getppid()}.tmp"]


def _run_cfg(run_dir, offload_optimizer: bool, microbatch_rows: int = 0):
    return types.SimpleNamespace(
        run_dir=str(run_dir),
        distill=types.SimpleNamespace(loss=types.SimpleNamespace(temperature=1.0)),
        train=types.SimpleNamespace(shared_prefix="auto",
                                    offload_optimizer_during_kl=offload_optimizer,
                                    microbatch_rows=microbatch_rows))


def _kl_batch(b: int = 3, s: int = 12, r: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, (b, s)).astype(np.int32)
    return {
        "student_tokens": tokens,
        "student_positions": np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy(),
        "student_attn_mask": np.ones((b, s), np.int32),
        "student_index": np.broadcast_to(np.arange(s - r - 1, s - 1, dtype=np.int32),
                                         (b, r)).copy(),
        "responses": tokens[:, s - r:],
        "response_mask": np.ones((b, r), np.int32),
        "sampler_logp": rng.normal(-2.0, 0.5, (b, r)).astype(np.float32),
    }


def test_optimizer_waits_in_a_file_during_the_kl_forward(tmp_path, monkeypatch):
    """train.offload_optimizer_during_kl: while the initial policy's forward runs, the
    optimizer state is in a file and not in the train state; after it (and after a forward
    that raised) it is back bit for bit with its shardings, the file gone; the KL is the
    same as without."""
    from pmd_jax.distill.step import TrainState

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    cfg = tiny_llama().replace(vocab_size=256)
    init = decoder.init_params(cfg, jax.random.PRNGKey(0))
    mu = jax.tree.map(lambda x: x * 0.5, init)
    if jax.device_count() >= 8:
        mesh = sh.make_mesh({"data": 2, "fsdp": 4, "tensor": 1}, devices=jax.devices()[:8])
        spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
        mu["embed"] = jax.device_put(mu["embed"], spec)
    opt = {"mu": mu, "nu": jax.tree.map(jnp.square, init), "count": jnp.int32(7)}
    state = TrainState(step=jnp.int32(7), params=init, opt_state=opt, teacher={},
                       rng=jnp.zeros((2,), jnp.uint32))
    bundle = types.SimpleNamespace(state=state, initial_params=init)
    batch = _kl_batch()
    plain = kl.kl_to_initial(_run_cfg(tmp_path, False), types.SimpleNamespace(cfg=cfg),
                             types.SimpleNamespace(initial_params=init), batch)
    seen = []
    real = kl._initial_logprobs

    def spy(*a, **k):
        seen.append((bundle.state.opt_state, sorted(p.name for p in tmp_path.iterdir())))
        return real(*a, **k)

    monkeypatch.setattr(kl, "_initial_logprobs", spy)
    run_cfg = _run_cfg(tmp_path / "run", True)
    assert kl.kl_to_initial(run_cfg, types.SimpleNamespace(cfg=cfg), bundle, batch) == plain
    ((during, files),) = seen
    assert during is None and len(files) == 1 and files[0].startswith("pmd_jax_optimizer_")

    def same(a, b):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            assert x.sharding == y.sharding and x.dtype == y.dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    same(bundle.state.opt_state, opt)
    assert bundle.state.params is init and not list(tmp_path.iterdir())

    def boom(*a, **k):
        raise RuntimeError("forward failed")

    monkeypatch.setattr(kl, "_initial_logprobs", boom)
    with pytest.raises(RuntimeError, match="forward failed"):
        kl.kl_to_initial(run_cfg, types.SimpleNamespace(cfg=cfg), bundle, batch)
    same(bundle.state.opt_state, opt)
    assert not list(tmp_path.iterdir())


def test_kl_to_initial_reads_the_offloaded_policy(tmp_path):
    """The KL to the initial policy from its file equals the KL from the arrays in memory
    (the same forward on the same bits), and differs once the policy moved."""
    cfg = tiny_llama().replace(vocab_size=256)
    init = decoder.init_params(cfg, jax.random.PRNGKey(0))
    batch = _kl_batch()
    run_cfg = _run_cfg(tmp_path, offload_optimizer=False)
    model = types.SimpleNamespace(cfg=cfg)
    in_memory = kl.kl_to_initial(run_cfg, model, types.SimpleNamespace(initial_params=init),
                                 batch)
    disk = DiskParams.write(init, tmp_path / "init.bin")
    from_disk = kl.kl_to_initial(run_cfg, model, types.SimpleNamespace(initial_params=disk),
                                 batch)
    assert from_disk == in_memory
    moved = jax.tree.map(lambda x: x * 1.01, init)
    other = DiskParams.write(moved, tmp_path / "moved.bin")
    assert kl.kl_to_initial(run_cfg, model, types.SimpleNamespace(initial_params=other),
                            batch) != in_memory


def test_kl_to_initial_in_microbatches(tmp_path, monkeypatch):
    """With train.microbatch_rows the initial policy's forward runs mb rows at a time (its
    activations and logits bounded by mb rows, as the step's are): the same log-probs as one
    forward of every row, the forward called rows / mb times on mb-row inputs."""
    cfg = tiny_llama().replace(vocab_size=256)
    init = decoder.init_params(cfg, jax.random.PRNGKey(0))
    batch = _kl_batch(b=6)
    model, bundle = types.SimpleNamespace(cfg=cfg), types.SimpleNamespace(initial_params=init)
    whole = kl.kl_to_initial(_run_cfg(tmp_path, False), model, bundle, batch)
    real = kl._initial_logprobs
    lps: list[np.ndarray] = []
    monkeypatch.setattr(kl, "_initial_logprobs", lambda *a: lps.append(real(*a)) or lps[-1])
    kl.kl_to_initial(_run_cfg(tmp_path, False), model, bundle, batch)
    (fn_key,) = [k for k in kl._KL_FNS if k[0] == cfg]
    calls: list[int] = []
    real_fn = kl._KL_FNS[fn_key]
    monkeypatch.setitem(kl._KL_FNS, fn_key,
                        lambda p, b: calls.append(len(b["student_tokens"])) or real_fn(p, b))
    split = kl.kl_to_initial(_run_cfg(tmp_path, False, microbatch_rows=2), model, bundle, batch)
    assert calls == [2, 2, 2]
    np.testing.assert_allclose(lps[1], lps[0], rtol=1e-5, atol=1e-6)
    assert split == pytest.approx(whole, rel=1e-5, abs=1e-7)
    assert len(lps) == 2 and lps[1].shape == (6, 5)
    calls.clear()  # a batch mb does not divide (never made by the trainer): one forward
    kl.kl_to_initial(_run_cfg(tmp_path, False, microbatch_rows=4), model, bundle, batch)
    assert calls == [6]


def test_load_reads_without_a_mapping_and_lets_go_of_its_host_copies(tmp_path, monkeypatch):
    """Each leaf is read into a host array (a mapping of the file would count its pages in
    the process's resident set until unmapped) and placed; by the time load returns, no host
    copy is alive (jax keeps a reference to what it placed that only the cyclic collector
    drops: without the collection, the loaded tree was resident twice)."""
    import weakref

    from pmd_jax.distill import offload

    tree = {"a": jnp.arange(300_000, dtype=jnp.float32), "b": jnp.ones((40, 50)),
            "c": [jnp.float32(2.0)]}
    disk = DiskParams.write(tree, tmp_path / "t.bin")

    def no_map(*a, **k):
        raise AssertionError("load mapped the file")

    made = []
    real_empty = np.empty

    def tracked_empty(*a, **k):
        x = real_empty(*a, **k)
        made.append(weakref.ref(x))
        return x

    monkeypatch.setattr(offload.np, "memmap", no_map)
    monkeypatch.setattr(offload.np, "empty", tracked_empty)
    monkeypatch.setattr(offload, "_COLLECT_EVERY", 1_000_000)  # one collection mid-load too
    back = disk.load()
    assert len(made) == 3
    # On CPU, device_put may place a 64-byte-aligned host array without copying it (the
    # placed array's buffer is that array): alive then, but not a second copy. Which arrays
    # happen to be aligned depends on the allocator, so only those may still be alive.
    placed = {s.data.unsafe_buffer_pointer()
              for x in jax.tree.leaves(back) for s in x.addressable_shards}
    alive = [r() for r in made if r() is not None]
    assert all(a.ctypes.data in placed for a in alive), "host copies still alive after load"
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_offload_files_are_sized_and_checked_against_the_temp_disk(tmp_path, monkeypatch):
    """offload.temp_files: the initial policy's and the moments' bytes, as the options say;
    disk.check_temp_space names the directory and the options when they cannot fit."""
    from pmd_jax.distill import offload
    from pmd_jax.distill.step import TrainState
    from pmd_jax.run import disk

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    init = {"w": jnp.ones((100, 10)), "b": jnp.ones((10,))}  # 4,040 bytes
    opt = {"mu": init, "nu": init, "count": jnp.int32(0)}  # 8,084 bytes
    bundle = types.SimpleNamespace(initial_params=init, state=TrainState(
        step=jnp.int32(0), params=init, opt_state=opt, teacher={},
        rng=jnp.zeros((2,), jnp.uint32)), step_fn=types.SimpleNamespace(trains=True))

    def train_cfg(**kw):
        base = dict(offload_initial_policy=False, kl_initial_every=1,
                    offload_optimizer_during_kl=False, offload_optimizer_during_grads=False)
        return types.SimpleNamespace(**{**base, **kw})

    assert offload.temp_files(train_cfg(), bundle) == []
    assert offload.temp_files(train_cfg(offload_initial_policy=True, kl_initial_every=0),
                              bundle) == []
    files = offload.temp_files(train_cfg(offload_initial_policy=True,
                                         offload_optimizer_during_grads=True), bundle)
    assert [n for _, n in files] == [4040, 8084]
    assert "offload_initial_policy" in files[0][0] and "_grads" in files[1][0]
    assert str(tmp_path) in disk.check_temp_space(files)
    # a mode that never trains writes neither (no moments, no KL to the initial policy)
    frozen = types.SimpleNamespace(**{**vars(bundle),
                                      "step_fn": types.SimpleNamespace(trains=False)})
    assert offload.temp_files(train_cfg(offload_initial_policy=True,
                                        offload_optimizer_during_grads=True), frozen) == []
    monkeypatch.setattr(disk, "free_bytes", lambda d: 10_000)
    with pytest.raises(disk.DiskSpaceError, match=r"temp directory .*offload_initial_policy"):
        disk.check_temp_space(files)
