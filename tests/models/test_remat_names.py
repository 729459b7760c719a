"""Remat by name (issue 50, part 4): the decoder layer's tensors carry ``checkpoint_name``s
(MaxText's names), the remat policies that save or offload them by name, and every policy's
forward and gradient against the others.

* The names are identities: for the policies of before (none, full, dots, dots_no_batch) the
  loss and gradient with the names are the very bits of the program without them (the names
  patched out).
* Every policy: the forward is the same bits; gradients equal within float32 rounding (a
  rematerialised layer is compiled into a different program than the saved one, so XLA may
  round a few elements differently: that was already so between none and full).
* What each policy saves (``jax.ad_checkpoint.print_saved_residuals``): the named tensors, and
  for the offloading ones the same tensors in host memory.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.models import decoder
from pmd_jax.models import remat as remat_lib
from pmd_jax.models.config import ConfigError
from tests.fakes import tiny_model_config

CFG = tiny_model_config("sampler")  # 2 layers, D 32, 4 heads over 2 KV heads of 8, F 64
B, T = 2, 12
OLD_POLICIES = ("none", "full", "dots", "dots_no_batch")


def _inputs():
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (B, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = jnp.asarray(np.arange(T)[None] < np.array([[T], [9]]))
    return tokens, pos, mask


PARAMS = decoder.init_params(CFG, jax.random.PRNGKey(0))
TOKENS, POS, MASK = _inputs()


def _loss(params, remat: str, per_layer: bool = False):
    if per_layer:
        params = decoder.unstack_layers(params)
    lg, _ = decoder.forward(params, TOKENS, POS, CFG, attn_mask=MASK, remat=remat)
    return jnp.sum(jax.nn.logsumexp(lg, -1) * MASK)


@jax.jit(static_argnums=(1, 2))
def _value_and_grad(params, remat: str, per_layer: bool = False):
    return jax.value_and_grad(_loss)(params, remat, per_layer)


@jax.jit(static_argnums=1)
def _logits(params, remat: str):
    return decoder.forward(params, TOKENS, POS, CFG, attn_mask=MASK, remat=remat)[0]


def test_policy_names():
    assert set(OLD_POLICIES) <= set(remat_lib.REMAT_POLICIES)
    for p in ("minimal", "save_qkv_proj", "save_out_proj", "save_dot_except_mlp",
              "qkv_proj_offloaded"):
        assert p in remat_lib.REMAT_POLICIES
    for names in (*remat_lib.SAVED_NAMES.values(), *remat_lib.OFFLOADED_NAMES.values()):
        assert set(names) <= set(remat_lib.REMAT_NAMES)
    with pytest.raises(ConfigError, match="not one of"):
        remat_lib.remat_policy("everything")
    from pmd_jax.distill.config import REMAT_POLICIES as knob_values

    assert set(knob_values) == set(remat_lib.REMAT_POLICIES) - {"none"}  # the knob takes them


@pytest.mark.parametrize("per_layer, policies", [
    (False, ("full", "dots_no_batch")),
    pytest.param(False, ("none", "dots"), marks=pytest.mark.slow),
    pytest.param(True, ("full", "dots_no_batch"), marks=pytest.mark.slow),
], ids=["scanned", "scanned_more", "unrolled"])
def test_names_change_no_bit(monkeypatch, per_layer, policies):
    """The policies of before: with and without the names, the same loss and gradient bits."""
    named = {p: _value_and_grad(PARAMS, p, per_layer) for p in policies}
    monkeypatch.setattr(decoder, "checkpoint_name", lambda x, name: x)
    for p in policies:
        plain = jax.jit(jax.value_and_grad(_loss), static_argnums=(1, 2))(PARAMS, p, per_layer)
        for a, b in zip(jax.tree.leaves(named[p]), jax.tree.leaves(plain), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=p)


# a few unmarked (each ~5 s on 2 cores), the rest with the slow runs
QUICK = ("full", "minimal", "save_qkv_proj", "qkv_proj_offloaded")


@pytest.mark.parametrize("policy", [p if p in QUICK else pytest.param(p, marks=pytest.mark.slow)
                                    for p in remat_lib.REMAT_POLICIES])
def test_every_policy_same_forward_and_gradient(policy):
    want_logits = np.asarray(_logits(PARAMS, "none"))
    np.testing.assert_array_equal(np.asarray(_logits(PARAMS, policy)), want_logits)
    (v0, g0), (v1, g1) = _value_and_grad(PARAMS, "none"), _value_and_grad(PARAMS, policy)
    assert abs(float(v1) - float(v0)) <= 1e-6 * abs(float(v0))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g0),
                            strict=True):
        a, b = np.asarray(a), np.asarray(b)
        # float32 rounding of a recomputed vs a saved layer (none vs full already differ so)
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-6 * np.abs(b).max(),
                                   err_msg=f"{policy} {jax.tree_util.keystr(path)}")
    if policy == "minimal":  # the same policy as dots_no_batch: the same program, same bits
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(
                _value_and_grad(PARAMS, "dots_no_batch")[1])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _saved_per_layer(policy: str, capsys) -> list[str]:
    """The residuals a policy keeps per layer: the layer scan's stacked outputs, as
    ``print_saved_residuals`` shows them (``f32[L,B,...]``, ``f32<host>[...]`` in host
    memory), without the scan's carry (the layer input, [L, B, T, D], saved by any policy)."""
    jax.ad_checkpoint.print_saved_residuals(lambda p: _loss(p, policy), PARAMS)
    out = capsys.readouterr().out
    L, D = CFG.num_layers, CFG.hidden_size
    shapes = [m.group(1) for m in re.finditer(r"^(\S+\[[0-9,]+\]) output of scan", out,
                                              re.MULTILINE)]
    rows = [s for s in shapes if re.search(rf"\[{L},{B},", s)]
    rows.remove(f"f32[{L},{B},{T},{D}]")  # the layer inputs
    return sorted(rows)


def test_named_policies_save_the_named_tensors(capsys):
    L, H, KV, hd, D = CFG.num_layers, CFG.num_heads, CFG.num_kv_heads, CFG.head_dim, \
        CFG.hidden_size
    q, kv = f"[{L},{B},{T},{H},{hd}]", f"[{L},{B},{T},{KV},{hd}]"
    assert _saved_per_layer("full", capsys) == []
    assert _saved_per_layer("save_qkv_proj", capsys) == sorted([f"f32{q}", f"f32{kv}",
                                                                f"f32{kv}"])
    assert _saved_per_layer("save_out_proj", capsys) == [f"f32[{L},{B},{T},{D}]"]
    assert _saved_per_layer("save_dot_except_mlp", capsys) == sorted(
        [f"f32{q}", f"f32{kv}", f"f32{kv}", f"f32[{L},{B},{T},{D}]"])
    # offloaded: the same q/k/v, in host memory
    assert _saved_per_layer("qkv_proj_offloaded", capsys) == sorted(
        [f"f32<host>{q}", f"f32<host>{kv}", f"f32<host>{kv}"])


def test_offload_refused_without_pinned_host(monkeypatch):
    monkeypatch.setattr(remat_lib, "host_offload_refusal",
                        lambda: "cpu devices have no pinned_host memory (memory kinds: [])")
    with pytest.raises(ConfigError, match="offloads saved activations to host memory"):
        remat_lib.remat_policy("qkv_proj_offloaded")
    assert remat_lib.remat_policy("save_qkv_proj") is not None  # on-device policies unaffected
