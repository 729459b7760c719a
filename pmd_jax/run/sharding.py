"""Mesh construction and logical-axis sharding rules.

Every parameter (and the main activations) carries a tuple of *logical* axis names such as
``("vocab", "embed")``. A ``ShardingRules`` map, taken from config, sends each logical name to
zero or more *mesh* axes (``data``, ``fsdp``, ``tensor``). Nothing else in the code base names
mesh axes directly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")

# Logical axis names used by the models and the train step.
LOGICAL_AXES: tuple[str, ...] = (
    "batch", "seq", "vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "layers", "norm",
    "q_proj", "kv_proj", "cache_seq", "lora_rank",
)

# Default rules: FSDP over "embed" (params) and batch over data+fsdp (activations); tensor
# parallelism over heads / mlp / vocab.
DEFAULT_RULES: dict[str, tuple[str, ...] | str | None] = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "cache_seq": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "q_proj": "tensor",
    "kv_proj": "tensor",
    "head_dim": None,
    "layers": None,
    "norm": None,
    "lora_rank": None,  # LoRA adapters (models/lora.py): the rank is small, replicated
}


class ShardingError(ValueError):
    """A config cannot be placed on the mesh; the message names the setting or tensor."""


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    rules: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | None = None) -> ShardingRules:
        merged: dict[str, Any] = dict(DEFAULT_RULES)
        if m is not None:
            for k, v in dict(m).items():
                if k not in LOGICAL_AXES:
                    raise ShardingError(
                        f"sharding rule for unknown logical axis {k!r}; known: {LOGICAL_AXES}"
                    )
                merged[k] = v
        norm: list[tuple[str, tuple[str, ...]]] = []
        for k, v in merged.items():
            axes: tuple[str, ...]
            if v is None:
                axes = ()
            elif isinstance(v, str):
                axes = (v,)
            else:
                axes = tuple(v)
            for a in axes:
                if a not in MESH_AXES:
                    raise ShardingError(
                        f"sharding rule {k!r} -> {a!r}: {a!r} is not a mesh axis {MESH_AXES}"
                    )
            norm.append((k, axes))
        return cls(tuple(sorted(norm)))

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        table = dict(self.rules)
        if logical not in table:
            raise ShardingError(f"no sharding rule for logical axis {logical!r}")
        return table[logical]

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        """PartitionSpec for one array; a mesh axis is used at most once per array."""
        used: set[str] = set()
        out: list[Any] = []
        for name in logical_axes:
            axes = tuple(a for a in self.mesh_axes(name) if a not in used)
            used.update(axes)
            out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
        return PartitionSpec(*out)


def make_mesh(
    shape: Mapping[str, int] | None = None, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A mesh with axes (data, fsdp, tensor). One size may be -1 (takes the remaining devices).

    ``shape`` is e.g. ``{"data": 1, "fsdp": -1, "tensor": 1}``; missing axes have size 1.
    """
    devices = list(devices if devices is not None else jax.devices())
    shape = dict(shape or {"fsdp": -1})
    for k in shape:
        if k not in MESH_AXES:
            raise ShardingError(f"mesh axis {k!r} is not one of {MESH_AXES}")
    sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
    if sum(1 for s in sizes if s == -1) > 1:
        raise ShardingError(f"mesh shape {shape}: at most one axis may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if any(s == 0 or s < -1 for s in sizes):
        raise ShardingError(f"mesh shape {shape}: sizes must be positive or -1")
    if -1 in sizes:
        if len(devices) % known:
            raise ShardingError(
                f"mesh shape {shape}: {len(devices)} devices not divisible by {known}"
            )
        sizes[sizes.index(-1)] = len(devices) // known
    if math.prod(sizes) != len(devices):
        raise ShardingError(
            f"mesh shape {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
            f"have {len(devices)}"
        )
    try:
        arr = mesh_utils.create_device_mesh(sizes, devices=devices)
    except Exception:  # noqa: BLE001 - fake/abstract devices: plain reshape is fine
        arr = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(arr, MESH_AXES)


def named_sharding(mesh: Mesh, rules: ShardingRules, logical_axes: Sequence[str | None]):
    return NamedSharding(mesh, rules.spec(logical_axes))


def tree_shardings(mesh: Mesh, rules: ShardingRules, axes_tree: Any) -> Any:
    """Map a pytree of logical-axis tuples to a pytree of NamedShardings."""
    return jax.tree.map(
        lambda ax: named_sharding(mesh, rules, ax), axes_tree, is_leaf=_is_axes_leaf
    )


def _is_axes_leaf(x: Any) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def check_divisible(mesh: Mesh, rules: ShardingRules, shapes_tree: Any, axes_tree: Any) -> None:
    """Fail with the tensor's path if a dimension is not divisible by its mesh axes' size."""
    flat_axes = jax.tree_util.tree_flatten_with_path(axes_tree, is_leaf=_is_axes_leaf)[0]
    flat_shapes = jax.tree.leaves(shapes_tree)
    if len(flat_axes) != len(flat_shapes):
        raise ShardingError(
            f"axes tree has {len(flat_axes)} leaves but shapes tree has {len(flat_shapes)}"
        )
    for (path, axes), shp in zip(flat_axes, flat_shapes):
        shape = tuple(getattr(shp, "shape", shp))
        if len(shape) != len(axes):
            raise ShardingError(
                f"{jax.tree_util.keystr(path)}: shape {shape} has rank {len(shape)} but "
                f"logical axes {axes} have {len(axes)}"
            )
        spec = rules.spec(axes)
        for dim, (size, part) in enumerate(zip(shape, spec)):
            if part is None:
                continue
            parts = (part,) if isinstance(part, str) else part
            n = math.prod(mesh.shape[p] for p in parts)
            if size % n:
                raise ShardingError(
                    f"{jax.tree_util.keystr(path)}: dim {dim} (logical {axes[dim]!r}, size "
                    f"{size}) is not divisible by mesh axes {parts} of total size {n}"
                )


def shard_tree(tree: Any, mesh: Mesh, rules: ShardingRules, axes_tree: Any) -> Any:
    """Place a host pytree onto the mesh per the rules (after a divisibility check)."""
    check_divisible(mesh, rules, tree, axes_tree)
    shardings = tree_shardings(mesh, rules, axes_tree)
    return jax.tree.map(jax.device_put, tree, shardings)
