"""Rematerialisation of the decoder layer: the named tensors and the policies by name.

The decoder layer names its tensors with ``checkpoint_name`` (MaxText's names, :data:`REMAT_NAMES`);
a policy (:func:`remat_policy`, the ``distill.precision.remat_policy`` knob) says which of the
layer's tensors the backward keeps and which it recomputes: MaxText's ``minimal``,
``save_qkv_proj``, ``save_out_proj``, ... and their host-offloaded variants.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from pmd_jax.models.config import ConfigError

# Names of the decoder layer's tensors (``checkpoint_name``, MaxText's names), for the remat
# policies that save or offload named tensors.
QKV_NAMES: tuple[str, ...] = ("query_proj", "key_proj", "value_proj")
REMAT_NAMES: tuple[str, ...] = (*QKV_NAMES, "context", "out_proj", "mlpwi_0", "mlpwi_1",
                                "mlpwo")
# policy -> the named tensors it saves (the rest of the layer is recomputed)
SAVED_NAMES: dict[str, tuple[str, ...]] = {
    "save_qkv_proj": QKV_NAMES,
    "save_out_proj": ("out_proj",),
    "save_dot_except_mlp": (*QKV_NAMES, "out_proj"),
    "save_dot_with_context_except_mlp": (*QKV_NAMES, "context", "out_proj"),
    "save_dot_except_mlpwi": (*QKV_NAMES, "out_proj", "mlpwo"),
}
# policy -> the named tensors it moves to host memory (pinned_host) between the passes
OFFLOADED_NAMES: dict[str, tuple[str, ...]] = {
    "qkv_proj_offloaded": QKV_NAMES,
    "save_dot_except_mlp_offloaded": (*QKV_NAMES, "out_proj"),
}
REMAT_POLICIES: tuple[str, ...] = ("none", "full", "dots", "dots_no_batch", "minimal",
                                   *SAVED_NAMES, *OFFLOADED_NAMES, "minimal_offloaded")


def host_offload_refusal() -> str | None:
    """Why this backend cannot offload saved activations to host memory (None: it can): its
    first device must have a ``pinned_host`` memory space."""
    dev = jax.devices()[0]
    try:
        kinds = [m.kind for m in dev.addressable_memories()]
    except Exception as e:  # noqa: BLE001  (a backend without memory spaces)
        return f"{dev.platform} devices expose no memory spaces ({type(e).__name__}: {e})"
    if "pinned_host" not in kinds:
        return f"{dev.platform} devices have no pinned_host memory (memory kinds: {kinds})"
    return None


def remat_policy(policy: str) -> Callable | None:
    """The ``jax.checkpoint`` policy a remat name means (None: "none", no checkpoint):

    * ``full``: nothing saved, the layer is recomputed from its input;
    * ``dots``: every matmul output saved (attention scores included);
    * ``dots_no_batch`` / ``minimal`` (MaxText's name): the outputs of matmuls without batch
      dimensions, i.e. the weight projections (the attention's batched products recomputed);
    * ``save_qkv_proj``, ``save_out_proj``, ``save_dot_except_mlp``,
      ``save_dot_with_context_except_mlp``, ``save_dot_except_mlpwi``: only the named tensors
      of :data:`SAVED_NAMES` (MaxText's policies of those names);
    * ``qkv_proj_offloaded``, ``save_dot_except_mlp_offloaded``: the named tensors of
      :data:`OFFLOADED_NAMES` saved in host memory (``pinned_host``) between the forward and
      the backward, nothing kept on the device; ``minimal_offloaded``: ``minimal``'s tensors
      offloaded. Refused (``ConfigError``) where the device has no pinned host memory.
    """
    cp = jax.checkpoint_policies
    if policy == "none":
        return None
    fixed = {"full": cp.nothing_saveable, "dots": cp.checkpoint_dots,
             "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
             "minimal": cp.dots_with_no_batch_dims_saveable}
    if policy in fixed:
        return fixed[policy]
    if policy in SAVED_NAMES:
        return cp.save_only_these_names(*SAVED_NAMES[policy])
    if policy in OFFLOADED_NAMES or policy == "minimal_offloaded":
        why = host_offload_refusal()
        if why:
            raise ConfigError(f"remat policy {policy!r} offloads saved activations to host "
                              f"memory, and {why}; use a policy that keeps them on the device "
                              "(e.g. 'save_qkv_proj' or 'minimal')")
        if policy == "minimal_offloaded":
            return cp.offload_dot_with_no_batch_dims(offload_src="device",
                                                     offload_dst="pinned_host")
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(
                OFFLOADED_NAMES[policy]), offload_src="device", offload_dst="pinned_host")
    raise ConfigError(f"remat policy {policy!r} is not one of {REMAT_POLICIES}")


def remat(fn: Callable, policy: str, prevent_cse: bool = False) -> Callable:
    """``jax.checkpoint`` with a named policy (:func:`remat_policy`). ``prevent_cse=False`` is
    only safe inside a scan (which already keeps XLA from merging the recompute into the
    forward); an unrolled layer loop needs True or the remat is optimised away."""
    pol = remat_policy(policy)
    if pol is None:
        return fn
    return jax.checkpoint(fn, policy=pol, prevent_cse=prevent_cse)
