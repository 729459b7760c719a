"""Run-dir I/O through pmd_jax.run.paths: local folders and gs:// URLs.

The gs:// tests put fsspec's own in-memory file system (fsspec.implementations.memory, not our
code) behind the ``gs``/``gcs`` protocols, the way gcsfs is found on a real host; etils.epath
then reaches it through its fsspec backend exactly as it would reach GCS. Every test runs in
an empty working directory and checks that no local ``gs:`` folder appeared (what happens
when a gs:// string reaches open / os / pathlib).
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

fsspec = pytest.importorskip("fsspec")
from etils.epath import backend as epath_backend  # noqa: E402
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402

from pmd_jax.run import paths  # noqa: E402

# tensorboardX's GCS writer, whose constructor failed without google-cloud-storage, raises
# again in its __del__ when collected (in whichever test runs then): not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class _BucketFS(MemoryFileSystem):
    """fsspec's in-memory file system answering gs:// URLs (keys: "bucket/path")."""

    protocol = ("gs", "gcs")
    store: dict = {}
    pseudo_dirs = [""]
    root_marker = ""

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        for p in ("gs://", "gcs://"):
            path = path.removeprefix(p)
        return path.rstrip("/")


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """A fresh in-memory gs:// bucket; cwd is an empty folder checked for a stray 'gs:'."""
    saved = {k: fsspec.registry.get(k) for k in ("gs", "gcs")}
    for k in ("gs", "gcs"):
        fsspec.register_implementation(k, _BucketFS, clobber=True)
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
    monkeypatch.setattr("etils.epath.gpath._is_tf_installed", lambda: False, raising=False)
    _BucketFS.store.clear()
    _BucketFS.pseudo_dirs[:] = [""]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield _BucketFS.store
    assert os.listdir(cwd) == [], f"local files appeared for a gs:// path: {os.listdir(cwd)}"
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
    for k, v in saved.items():
        if v is not None:
            fsspec.register_implementation(k, v, clobber=True)


def _obj(store, key):
    v = store[key]
    return v.getvalue() if hasattr(v, "getvalue") else bytes(v)


# ------------------------------------------------------------------------------ helpers
def test_is_remote_and_run_path(tmp_path, monkeypatch):
    assert paths.is_remote("gs://b/run") and paths.is_remote("s3://b/x")
    assert not paths.is_remote("runs/x") and not paths.is_remote("/abs/gs://x")
    assert str(paths.run_path("gs://b/run/a")) == "gs://b/run/a"
    monkeypatch.chdir(tmp_path)
    assert os.fspath(paths.run_path("runs/x")) == str(tmp_path / "runs" / "x")
    with pytest.raises(ValueError, match="unsupported URL scheme"):
        paths.run_path("ftp://host/x")


def test_local_write_is_atomic_and_jsonl_appends(tmp_path):
    p = tmp_path / "d" / "f.txt"
    paths.write_text(p, "one")
    paths.write_text(p, "two")
    assert p.read_text() == "two" and os.listdir(p.parent) == ["f.txt"]  # no temp file left
    w = paths.JsonlWriter(tmp_path / "m.jsonl")
    w.write({"a": 1})
    w.write('{"a": 2}')
    # Appended on disk at once (another reader sees both lines before close).
    assert [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()] == [
        {"a": 1}, {"a": 2}]
    w.rewrite([{"a": 0}])
    w.write({"a": 3})
    w.close()
    assert (tmp_path / "m.jsonl").read_text() == '{"a": 0}\n{"a": 3}\n'


def test_remote_helpers_write_the_bucket(bucket):
    paths.write_text("gs://bkt/run/x/a.txt", "hello")
    assert _obj(bucket, "bkt/run/x/a.txt") == b"hello"
    assert paths.read_text("gs://bkt/run/x/a.txt") == "hello"
    assert paths.size("gs://bkt/run/x/a.txt") == 5 and paths.exists("gs://bkt/run/x/a.txt")
    w = paths.JsonlWriter("gs://bkt/run/m.jsonl")
    for i in range(3):
        w.write({"i": i})
        # Every record is in the object right away (rewritten: objects cannot be appended).
        assert _obj(bucket, "bkt/run/m.jsonl").decode().count("\n") == i + 1
    # A new writer (a resumed run) keeps the lines already there.
    w2 = paths.JsonlWriter("gs://bkt/run/m.jsonl")
    w2.write({"i": 3})
    assert [json.loads(x)["i"] for x in paths.read_lines("gs://bkt/run/m.jsonl")] == [0, 1, 2, 3]
    paths.replace("gs://bkt/run/x/a.txt", "gs://bkt/run/x/b.txt")
    assert "bkt/run/x/a.txt" not in bucket and _obj(bucket, "bkt/run/x/b.txt") == b"hello"


def test_local_dir_moves_onto_the_bucket(bucket, tmp_path):
    src = tmp_path / "slot"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(b"\x00\x01")
    (src / "sub" / "b.txt").write_text("b")
    paths.move(src, "gs://bkt/ck/dir")
    assert not src.exists()
    assert _obj(bucket, "bkt/ck/dir/a.bin") == b"\x00\x01"
    assert _obj(bucket, "bkt/ck/dir/sub/b.txt") == b"b"
    assert sorted(os.fspath(p) for p in paths.walk_files("gs://bkt/ck")) == [
        "gs://bkt/ck/dir/a.bin", "gs://bkt/ck/dir/sub/b.txt"]
    back = tmp_path / "back"
    paths.copytree("gs://bkt/ck/dir", back)
    assert (back / "sub" / "b.txt").read_text() == "b"


def test_staged_dir(bucket, tmp_path):
    with paths.staged_dir(tmp_path / "hf") as d:  # local: the folder itself
        assert d == str(tmp_path / "hf") and os.path.isdir(d)
    with paths.staged_dir("gs://bkt/run/final_hf") as d:
        assert os.path.isdir(d) and not paths.is_remote(d)
        with open(os.path.join(d, "config.json"), "w") as f:  # a local-only writer
            f.write("{}")
        staged = d
    assert _obj(bucket, "bkt/run/final_hf/config.json") == b"{}" and not os.path.exists(staged)
    with pytest.raises(RuntimeError), paths.staged_dir("gs://bkt/run/failed") as d:
        open(os.path.join(d, "x"), "w").close()
        raise RuntimeError("writer failed")
    assert not any(k.startswith("bkt/run/failed") for k in bucket)  # nothing half-uploaded


# ------------------------------------------------------------------------------ writers
def test_metrics_and_plots_on_gs(bucket, caplog):
    import matplotlib.image

    from pmd_jax.run.metrics import MetricsWriter, read_metrics, write_plots

    w = MetricsWriter("gs://bkt/run", use_tensorboard=False)
    for s in range(4):
        w.write("train", s, {"loss": 1.0 / (s + 1), "reward_mean": 0.1 * s})
    w.write("eval", 3, {"accuracy": 0.5, "accuracy_ci_low": 0.4, "accuracy_ci_high": 0.6})
    w.truncate_after(2)  # resume at step 2: steps 3 dropped
    w.write("train", 3, {"loss": 0.2})
    w.close()
    recs = [json.loads(x) for x in _obj(bucket, "bkt/run/metrics.jsonl").decode().splitlines()]
    assert [(r["kind"], r["step"]) for r in recs] == [("train", 0), ("train", 1), ("train", 2),
                                                      ("train", 3)]
    assert recs == read_metrics("gs://bkt/run/metrics.jsonl")
    written = write_plots("gs://bkt/run")
    assert {os.fspath(p) for p in written} >= {"gs://bkt/run/plots/loss.png",
                                               "gs://bkt/run/plots/reward.png"}
    png = _obj(bucket, "bkt/run/plots/loss.png")
    img = matplotlib.image.imread(io.BytesIO(png), format="png")  # a real PNG
    assert img.ndim == 3 and img.shape[0] > 100


def test_metrics_tensorboard_on_gs_without_gcs_client_warns(bucket, caplog):
    pytest.importorskip("tensorboardX")
    try:
        import google.cloud.storage  # noqa: F401

        pytest.skip("google-cloud-storage is installed: tensorboardX would call GCS")
    except ImportError:
        pass
    from pmd_jax.run.metrics import MetricsWriter

    with caplog.at_level("WARNING", logger="pmd_jax"):
        w = MetricsWriter("gs://bkt/run2", use_tensorboard=True)
    w.write("train", 0, {"loss": 1.0})
    w.close()
    assert "TensorBoard events are not written" in caplog.text
    assert "bkt/run2/metrics.jsonl" in bucket


def test_eval_results_on_gs(bucket):
    from pmd_jax.tasks.evaluation import EvalResult, load_results, save_results

    recs = [{"problem_id": f"p{i}", "seed": 0, "split": "validation",
             "rewards": [1.0, 0.0], "reasons": ["", ""], "mean": 0.5} for i in range(3)]
    save_results(EvalResult(name="step_000010", records=recs),
                 "gs://bkt/run/eval/step_000010/results.jsonl")
    assert _obj(bucket, "bkt/run/eval/step_000010/results.jsonl").decode().count("\n") == 3
    back = load_results("gs://bkt/run/eval/step_000010/results.jsonl")
    assert back.name == "step_000010" and back.summary["mean"] == pytest.approx(0.5)


def test_memory_exports_on_gs(bucket):
    from pmd_jax.memory.memory import ProceduralMemory
    from tests.memory.test_memory_levels import small_config

    mem = ProceduralMemory(small_config())
    mem.experience.problem_text["p<1>"] = "What is <b>?"
    n = mem.export_jsonl("gs://bkt/run/memory.jsonl")
    assert _obj(bucket, "bkt/run/memory.jsonl").decode().count("\n") == n
    mem.export_html("gs://bkt/run/memory.html")
    page = _obj(bucket, "bkt/run/memory.html").decode()
    assert page.startswith("<!doctype html>") and "Procedural memory" in page


def test_checkpoint_files_on_gs(bucket):
    """The checkpointer's own files (slot blobs, commit marker, its verification) on gs://;
    orbax's arrays go through tensorstore's GCS driver, which this fake does not serve."""
    from pmd_jax.run import checkpoint as ck
    from pmd_jax.run import slots

    step = "gs://bkt/run/checkpoints/7"
    h = slots.BlobCheckpointHandler(staging_root="gs://bkt/run/checkpoints")
    h.save(paths.run_path(step + "/memory"), slots.BlobSave(b"\x01\x02\x03"))
    h.save(paths.run_path(step + "/data_cursor"), slots.BlobSave({"pos": 5}))
    ck.write_commit_marker(paths.run_path(step), 7)
    marker = json.loads(_obj(bucket, "bkt/run/checkpoints/7/pmd_commit.json"))
    assert marker["files"]["memory/blob.bin"][0] == 3
    assert "bkt/run/checkpoints/7/.pmd_commit.json.tmp" not in bucket
    ck.verify_step_dir(paths.run_path(step), 7)
    assert h.restore(paths.run_path(step + "/memory")) == b"\x01\x02\x03"
    assert h.restore(paths.run_path(step + "/data_cursor")) == {"pos": 5}
    fsspec.filesystem("gs").pipe_file("gs://bkt/run/checkpoints/7/memory/blob.bin",
                                      b"\x01\x02")  # truncated
    with pytest.raises(ck.CheckpointError, match="blob.bin has 2 bytes"):
        ck.verify_step_dir(paths.run_path(step), 7)


def test_checkpoint_dir_slot_onto_gs(bucket, tmp_path):
    from pmd_jax.run import checkpoint as ck
    from pmd_jax.run import slots

    src = tmp_path / "index"
    src.mkdir()
    (src / "vecs.npy").write_bytes(np.arange(4, dtype=np.int32).tobytes())
    h = slots.BlobCheckpointHandler(staging_root="gs://bkt/run/checkpoints")
    h.save(paths.run_path("gs://bkt/run/checkpoints/1/memory"), slots.BlobSave(src))
    assert src.exists()  # the source is copied, not moved
    assert _obj(bucket, "bkt/run/checkpoints/1/memory/dir/vecs.npy") == src.joinpath(
        "vecs.npy").read_bytes()
    out = h.restore(paths.run_path("gs://bkt/run/checkpoints/1/memory"),
                    ck.BlobRestore(target_dir=tmp_path / "restored"))
    assert (tmp_path / "restored" / "vecs.npy").read_bytes() == (src / "vecs.npy").read_bytes()
    assert os.fspath(out) == str(tmp_path / "restored")


# ------------------------------------------------------------------------------ config
def test_run_dir_validation_accepts_gs_and_logs(caplog):
    from pmd_jax.config import _run_dir_errors

    with caplog.at_level("WARNING", logger="pmd_jax"):
        assert _run_dir_errors("gs://bkt/pmd_runs/olmo3") == []
    assert "not checked for writability" in caplog.text
    (err,) = _run_dir_errors("ftp://host/run")
    assert "unsupported URL scheme" in err


def test_vllm_with_several_processes_is_refused(monkeypatch):
    from pmd_jax.config import base_config, config_errors, env_process_count

    c = base_config()
    c.rollout.sampler = "vllm"
    c.rollout.weight_store = "file:///tmp/pmd_weights_test"
    for k in ("PMD_COORDINATOR", "PMD_NUM_PROCESSES", "PMD_PROCESS_ID", "PMD_DISTRIBUTED"):
        monkeypatch.delenv(k, raising=False)
    assert env_process_count() == 1
    assert not [e for e in config_errors(c) if "single JAX process" in e]
    monkeypatch.setenv("PMD_COORDINATOR", "127.0.0.1:12345")
    monkeypatch.setenv("PMD_NUM_PROCESSES", "2")
    monkeypatch.setenv("PMD_PROCESS_ID", "0")
    (err,) = [e for e in config_errors(c) if "single JAX process" in e]
    assert "PMD_NUM_PROCESSES=2" in err and "rollout.sampler='jax'" in err
    c.rollout.sampler = "jax"
    assert not [e for e in config_errors(c) if "single JAX process" in e]
    monkeypatch.delenv("PMD_COORDINATOR")
    monkeypatch.setenv("PMD_DISTRIBUTED", "auto")
    assert env_process_count() is None
    c.rollout.sampler = "vllm"
    (err,) = [e for e in config_errors(c) if "single JAX process" in e]
    assert "PMD_DISTRIBUTED=auto" in err
