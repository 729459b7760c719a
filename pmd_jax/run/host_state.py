"""A run's host state in a checkpoint as versioned JSON plus arrays: nothing is pickled.

The memory, a mode's state and the prefetched rollouts are trees of dicts, lists, strings,
numbers, booleans, None, bytes and numpy arrays. :func:`encode` turns such a tree into a JSON
document and a list of arrays; a checkpoint slot of kind ``"state"`` stores them as
``state.json`` and ``arrays.npz`` (``run/slots.py``). :func:`decode` reads them back with
``json`` and ``numpy.load(allow_pickle=False)``: loading a checkpoint never runs code, and a
renamed module cannot break a resume (no class is named in the files).

The document is ``{"format": FORMAT, "version": VERSION, "tree": ...}``; values JSON cannot hold
are tagged objects with one key that starts with ``$``:

- ``{"$array": i}``: the i-th array of ``arrays.npz`` (any numeric or bool dtype; object
  arrays are refused); ``{"$scalar": i}``: a numpy scalar, stored as a 0-d array (dtype and
  bits kept);
- ``{"$bytes": i}``: bytes, stored as the i-th array (uint8; a memory's ScaNN files are
  megabytes, which base64 in the JSON would grow by a third); ``{"$tuple": [...]}``;
  ``{"$float": "nan" | "inf" | "-inf"}``;
- ``{"$dict": [[key, value], ...]}``: a dict whose keys are not all strings, or that has a
  key starting with ``$`` (keys are encoded like values: ints stay ints).

Anything else (a class instance, a set, a function) is refused with the path of the value in
the tree, when the checkpoint is written (not when it is read back).

Checkpoints written before this format pickled these slots; :mod:`pmd_jax.run.convert` rewrites
them once (it unpickles, so only for checkpoints you trust); a resume refuses them with that
command (:class:`LegacyCheckpointError`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from typing import Any

import numpy as np

FORMAT = "pmd_jax.host_state"
VERSION = 1
STATE_FILE = "state.json"
ARRAYS_FILE = "arrays.npz"


class HostStateError(ValueError):
    """A value the format cannot hold, or files that are not a host state of this version."""


@dataclasses.dataclass
class HostState:
    """An encoded tree: the JSON document and its arrays (what a ``"state"`` slot holds)."""

    doc: dict[str, Any]
    arrays: list[np.ndarray]

    def arrays_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, *self.arrays)  # members arr_0, arr_1, ... in order
        return buf.getvalue()

    def doc_bytes(self) -> bytes:
        return json.dumps(self.doc, allow_nan=False, sort_keys=False).encode()

    @classmethod
    def from_bytes(cls, doc: bytes, arrays: bytes, where: str = "host state") -> HostState:
        try:
            d = json.loads(doc)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HostStateError(f"{where}: {STATE_FILE} is not valid JSON: {e}") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise HostStateError(f"{where}: {STATE_FILE} is not a {FORMAT} document")
        if d.get("version") != VERSION:
            raise HostStateError(f"{where}: {FORMAT} version {d.get('version')!r}; this "
                                 f"pmd_jax reads version {VERSION}")
        try:
            with np.load(io.BytesIO(arrays), allow_pickle=False) as z:
                arrs = [z[f"arr_{i}"] for i in range(len(z.files))]
        except (ValueError, OSError, KeyError) as e:  # object arrays: "allow_pickle=False"
            raise HostStateError(f"{where}: {ARRAYS_FILE} cannot be read without pickle: "
                                 f"{e}") from None
        return cls(d, arrs)


@dataclasses.dataclass
class StoredHostState:
    """A ``"state"`` slot's files as read, not yet parsed: the run checkpointer parses them
    after the restore, so a version this pmd_jax cannot read is a refusal, not a corrupt
    step to skip."""

    doc: bytes
    arrays: bytes
    where: str

    def load(self) -> Any:
        return decode(HostState.from_bytes(self.doc, self.arrays, self.where))


def encode(tree: Any) -> HostState:
    """``tree`` as a :class:`HostState` (raises :class:`HostStateError` naming the path of a
    value the format cannot hold)."""
    arrays: list[np.ndarray] = []

    def enc(v: Any, path: str) -> Any:
        if v is None or isinstance(v, bool | str):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            if math.isfinite(v):
                return v
            return {"$float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if isinstance(v, np.ndarray | np.generic):
            a = np.asarray(v)
            if a.dtype.kind not in "biufcSU":  # (no object arrays: they would pickle)
                raise HostStateError(f"{path}: a numpy array of dtype {a.dtype} (only numeric, "
                                     "bool and string arrays are stored)")
            arrays.append(a.copy(order="C"))  # (0-d stays 0-d)
            return {"$array" if isinstance(v, np.ndarray) else "$scalar": len(arrays) - 1}
        if isinstance(v, bytes | bytearray | memoryview):
            arrays.append(np.frombuffer(bytes(v), np.uint8).copy())
            return {"$bytes": len(arrays) - 1}
        if isinstance(v, tuple):
            return {"$tuple": [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [enc(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in v):
                return {k: enc(x, f"{path}.{k}") for k, x in v.items()}
            return {"$dict": [[enc(k, f"{path}<key>"), enc(x, f"{path}[{k!r}]")]
                              for k, x in v.items()]}
        raise HostStateError(f"{path or '<root>'}: a {type(v).__module__}.{type(v).__name__} "
                             "cannot be stored in a checkpoint's host state (dicts, lists, "
                             "tuples, str, int, float, bool, None, bytes and numpy arrays can)")

    return HostState({"format": FORMAT, "version": VERSION, "tree": enc(tree, "")}, arrays)


def decode(state: HostState) -> Any:
    """The tree :func:`encode` was given (arrays and scalars bit for bit)."""
    arrays = state.arrays

    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            return v
        if len(v) == 1:
            (tag, x), = v.items()
            if tag == "$array":
                return arrays[int(x)]
            if tag == "$scalar":
                return arrays[int(x)][()]
            if tag == "$bytes":
                return arrays[int(x)].tobytes()
            if tag == "$tuple":
                return tuple(dec(y) for y in x)
            if tag == "$float":
                return float(x)
            if tag == "$dict":
                return {_hashable(dec(k)): dec(y) for k, y in x}
        if any(k.startswith("$") for k in v):
            raise HostStateError(f"host state: unknown tag in {sorted(v)[:3]}")
        return {k: dec(y) for k, y in v.items()}

    return dec(state.doc["tree"])


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list | tuple) else k


class LegacyCheckpointError(RuntimeError):
    """A checkpoint slot written by the pickling format (before host-state version 1)."""

    def __init__(self, slot_dir: Any, run_dir: Any) -> None:
        super().__init__(
            f"checkpoint slot {slot_dir} holds pickled host state, written by an older "
            "pmd_jax; resuming would unpickle it, which can run code. If you trust the "
            "checkpoint, convert it once: python -m pmd_jax.run.convert "
            f"--run_dir={run_dir} (or start the run afresh with --config.resume=False)")
