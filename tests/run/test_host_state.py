"""A checkpoint's host state without pickle (run/host_state.py): every value the memory, the
mode states and the prefetched rollouts hold comes back bit for bit; what the format cannot
hold is refused when written; a crafted pickle in a slot never runs; a checkpoint of the old
format is refused with the command that converts it, and that command's output resumes."""

from __future__ import annotations

import os
import pickle
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from pmd_jax.loop.rollout import StepBatch
from pmd_jax.run import host_state
from pmd_jax.run.checkpoint import RunCheckpointer, write_commit_marker
from pmd_jax.run.convert import convert_run
from pmd_jax.sampling.base import Rollout, Rollouts
from tests.fakes import assert_same_tree


def _tree():
    return {
        "version": 3, "name": "memory", "none": None, "flag": True, "pi": 3.25,
        "nan": float("nan"), "inf": float("-inf"), "big": 2**62,
        "vectors": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
        "ids": np.array([1, 2, 3], np.int64), "mask": np.array([True, False]),
        "empty": np.zeros((0, 384), np.float32), "words": np.array(["a", "bc"]),
        "scalar32": np.float32(0.1), "scalar64": np.int64(-5),
        "files": {"dataset.npy": b"\x93NUMPY\x00\x01", "cfg.pb": b""},
        "pairs": [(1, "a"), (2, "b")], "nested": [[1, [2, {"x": (3,)}]]],
        "by_step": {5: {0: 1, 1: 2}, 7: {}}, "$odd": "a key with a dollar",
        "tuple_key": {(1, 2): "t"},
    }


def test_every_kind_of_value_round_trips_bit_for_bit_through_the_files():
    st = host_state.encode(_tree())
    back = host_state.HostState.from_bytes(st.doc_bytes(), st.arrays_bytes())
    assert_same_tree(_tree(), host_state.decode(back))
    assert b"$array" in st.doc_bytes() and len(st.arrays) == 9  # 7 arrays, 2 bytes values


@pytest.mark.parametrize("bad, where", [
    ({"a": [1, {2, 3}]}, "a[1]: a builtins.set"),
    ({"m": {"x": object()}}, ".m.x: a builtins.object"),
    ({"arr": np.array([{"k": 1}], dtype=object)}, ".arr: a numpy array of dtype object"),
    ({"f": len}, ".f: a builtins.builtin_function_or_method"),
])
def test_a_value_the_format_cannot_hold_is_refused_with_its_path(bad, where):
    with pytest.raises(host_state.HostStateError, match=where.replace("[", r"\[")
                       .replace("]", r"\]").replace(".", r"\.")):
        host_state.encode(bad)


def test_files_of_another_version_or_with_an_object_array_are_refused():
    st = host_state.encode({"a": 1})
    doc = st.doc_bytes().replace(b'"version": 1', b'"version": 99')
    with pytest.raises(host_state.HostStateError, match="version 99; this pmd_jax reads"):
        host_state.HostState.from_bytes(doc, st.arrays_bytes())
    import io

    buf = io.BytesIO()
    np.savez(buf, np.array([{"x": 1}], dtype=object))  # (pickled inside the npz)
    with pytest.raises(host_state.HostStateError, match="cannot be read without pickle"):
        host_state.HostState.from_bytes(st.doc_bytes(), buf.getvalue())


# ----------------------------------------------------------------------------- a run's slots
def _bundle():
    state = {"w": jax.numpy.arange(4, dtype=jax.numpy.float32)}
    sds = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sds),
                            state)
    return types.SimpleNamespace(state=state,
                                 step_fn=types.SimpleNamespace(abstract_state=lambda: abstract))


def _batch(problems):
    ro = Rollouts([Rollout(i, s, np.array([5 + s, 9], np.int32),
                           np.array([-0.5, -1.25], np.float32), "stop" if s else "length")
                   for i in range(len(problems)) for s in range(2)], weights_version=3)
    return StepBatch(list(problems), [[1, 2, 3], [4]], ro, ["t0", "t1", "t2", "t3"],
                     np.zeros(0), [], step=4, weights_version=3, skipped=1,
                     sample_seconds=1.5, messages=[[{"role": "user", "content": "q"}]] * 2)


def _problems():
    return [types.SimpleNamespace(id=f"p{i}") for i in range(3)]


def test_the_run_checkpointer_stores_memory_mode_state_and_prefetch_without_pickle(tmp_path):
    probs = _problems()
    extras = {"data_cursor": {"epoch": 0, "position": 2}, "memory": _tree(),
              "mode_state": {"version": 1, "draws": {4: {0: 1}}},
              "prefetch": _batch(probs[1:]).to_tree()}
    ck = RunCheckpointer(tmp_path, keep=2)
    ck.save(4, _bundle(), extras)
    ck.wait()
    step_dir = tmp_path / "checkpoints" / "4"
    for slot in ("memory", "mode_state", "prefetch"):
        assert (step_dir / slot / "kind").read_text() == "state"
        assert not (step_dir / slot / "blob.bin").exists()
    for f in step_dir.rglob("*"):  # no file of the step holds a pickle
        if f.is_file() and f.suffix != ".npz":
            assert not f.read_bytes().startswith(b"\x80"), f
    _, back = RunCheckpointer(tmp_path, keep=2).restore_latest(_bundle())
    assert_same_tree(_tree(), back["memory"])
    assert back["mode_state"] == {"version": 1, "draws": {4: {0: 1}}}
    sb = StepBatch.from_tree(back["prefetch"], probs)
    want = _batch(probs[1:])
    assert sb.problems == want.problems and sb.texts == want.texts and sb.step == 4
    assert sb.rollouts.weights_version == 3 and sb.messages == want.messages
    for a, b in zip(sb.rollouts, want.rollouts, strict=True):
        assert (a.prompt_index, a.sample_index, a.finish_reason) == \
            (b.prompt_index, b.sample_index, b.finish_reason)
        assert a.tokens.dtype == b.tokens.dtype and a.tokens.tobytes() == b.tokens.tobytes()
        assert a.logprobs.tobytes() == b.logprobs.tobytes()
    with pytest.raises(ValueError, match="problem 'p1', which this run's training problems "
                       "hold 0 times"):
        StepBatch.from_tree(back["prefetch"], probs[:1])


class _Boom:
    """Unpickling this runs code (writes the marker file): a crafted checkpoint's payload."""

    marker: str = ""

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant_pickle(step_dir: Path, slot: str, payload: bytes) -> None:
    d = step_dir / slot
    for f in d.iterdir():
        if f.name not in ("commit_success.txt",):
            f.unlink()
    (d / "blob.bin").write_bytes(payload)
    (d / "kind").write_text("bytes")
    write_commit_marker(step_dir, int(step_dir.name))  # (the crafted step passes its check)


def test_a_crafted_checkpoint_cannot_run_code_and_names_the_converter(tmp_path):
    ck = RunCheckpointer(tmp_path, keep=2)
    ck.save(2, _bundle(), {"data_cursor": {"epoch": 0, "position": 0}, "memory": {"a": 1}})
    ck.wait()
    marker = tmp_path / "ran"
    _Boom.marker = str(marker)
    _plant_pickle(tmp_path / "checkpoints" / "2", "memory", pickle.dumps(_Boom()))
    with pytest.raises(host_state.LegacyCheckpointError,
                       match=r"pickled host state.*python -m pmd_jax.run.convert "
                             rf"--run_dir={tmp_path}"):
        RunCheckpointer(tmp_path, keep=2).restore_latest(_bundle())
    assert not marker.exists(), "the crafted pickle ran"
    assert (tmp_path / "checkpoints" / "2").is_dir()  # refused, not moved aside as corrupt


def test_the_converter_rewrites_an_old_checkpoint_once_and_it_resumes(tmp_path, capsys):
    probs = _problems()
    ck = RunCheckpointer(tmp_path, keep=2)
    ck.save(4, _bundle(), {"data_cursor": {"epoch": 1, "position": 0}, "memory": {"a": 1},
                           "mode_state": {"x": 1}})
    ck.wait()
    step_dir = tmp_path / "checkpoints" / "4"
    old_batch = _batch(probs[:2])
    del old_batch.__dict__["messages"]  # (pickled before StepBatch carried its messages)
    # the slots as the pickling format wrote them (the mode state under its oldest name)
    _plant_pickle(step_dir, "memory", pickle.dumps(_tree(), protocol=5))
    os.rename(step_dir / "mode_state", step_dir / "fast_slow")
    _plant_pickle(step_dir, "fast_slow", pickle.dumps({"draws": {4: {0: 2}}}, protocol=5))
    (step_dir / "prefetch").mkdir()
    _plant_pickle(step_dir, "prefetch", pickle.dumps(old_batch, protocol=5))
    assert convert_run(tmp_path, dry_run=True) == 0
    assert "step 4: to convert: memory, prefetch, fast_slow" in capsys.readouterr().out
    assert convert_run(tmp_path) == 0
    assert convert_run(tmp_path) == 0
    assert "step 4: already in the current format" in capsys.readouterr().out
    _, back = RunCheckpointer(tmp_path, keep=2).restore_latest(_bundle())
    assert_same_tree(_tree(), back["memory"])
    assert back["mode_state"] == {"draws": {4: {0: 2}}}
    sb = StepBatch.from_tree(back["prefetch"], probs)
    assert [p.id for p in sb.problems] == ["p0", "p1"] and sb.messages == []
