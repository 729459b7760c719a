"""Our SDPO loss against the peer's: ``sdpo_rl.distillation.compute_self_distillation_loss``.

``sdpo-rl`` (PyPI, 0.0.3: "Self-Distilled Policy Optimization for TRL", a reimplementation of
the SDPO authors' verl code as a TRL ``GRPOTrainer`` subclass) is the trainer a Hugging Face
user would pick instead of ours (issue 53). Its distillation module needs torch alone; its
package ``__init__`` imports TRL, so the module is loaded from its file and TRL is not needed
(``scripts/install.sh --test`` installs the wheel with ``--no-deps``).

The torch side follows the peer's trainer: log-softmax of the logits at the temperature, the
student's top-K indices (``torch.topk``) for both distributions, the teacher detached, the
sampled tokens' log-probs for the importance ratio. Its loss's gradient with respect to the
student logits comes from torch autograd; ours from ``jax.grad`` of the unchunked loss
(``tests/distill/reference_losses.self_distillation_loss``, itself equal to the chunked loss
the train step runs: tests/distill/test_chunked.py).

Cases: alpha 0 / 0.25 / 0.5 / 1 x tail bucket on / off x importance sampling against old
log-probs on / off (with rollout IS weights), each with a sample masked out, plus the
sampled-token surrogate (``full_logit_distillation=False``). In float64 inputs the two agree
within ``ATOL64``: not to float64 rounding, because our token mean accumulates in float32 by
design (``losses.token_mean``); in float32 within ``ATOL32`` (the surrogate's loss value:
``ATOL32_LOSS``). Not compared: the peer's ``sdpo/kl_mean`` is the mean of its loss's
divergence, ours ``kl`` is the full-vocabulary KL(student || teacher), another quantity.
"""

from __future__ import annotations

import importlib.util
import itertools
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pmd_jax.distill import losses as L
from tests.distill import reference_losses as R

B, T, V, K = 4, 7, 50, 8
TEMP = 0.8
IS_CLIP = 2.0
ATOL64 = 1e-6
ATOL32 = 2e-6
# the surrogate's loss is a small sum of terms ~5 in size (log-ratio x log-prob): float32 sums
# of 28 such terms in another order differ by ~1e-5 of it
ATOL32_LOSS = 1e-5


def _peer() -> ModuleType:
    """``sdpo_rl/distillation.py`` loaded by path (its package ``__init__`` imports TRL)."""
    spec = importlib.util.find_spec("sdpo_rl")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("sdpo-rl is not installed: it is the reference of this test; install it "
                    "with `pip install --no-deps sdpo-rl==0.0.3` (scripts/install.sh --test)")
    path = f"{list(spec.submodule_search_locations)[0]}/distillation.py"
    mod_spec = importlib.util.spec_from_file_location("sdpo_rl_distillation", path)
    assert mod_spec is not None and mod_spec.loader is not None
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def peer() -> ModuleType:
    return _peer()


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    s = rng.normal(size=(B, T, V)) * 2.0
    # a teacher near the student, as a memory-conditioned copy is: top-K sets overlap
    te = s + rng.normal(size=(B, T, V)) * 1.0
    tok = rng.integers(0, V, size=(B, T))
    resp = (rng.random((B, T)) < 0.8).astype(np.float64)
    resp[:, 0] = 1.0
    sd = np.ones(B)
    sd[1] = 0.0  # a sample without teacher signal
    old = s + rng.normal(size=s.shape) * 0.5  # the rollout policy's logits
    rw = rng.uniform(0.2, 2.0, size=(B, T))
    return s, te, tok, resp, sd, old, rw


def _peer_loss_and_grad(peer, s, te, tok, resp, sd, old, rw, *, alpha, tail, with_is, full,
                        dtype):
    x = torch.tensor(s, dtype=dtype, requires_grad=True)
    s_lp = torch.log_softmax(x / TEMP, dim=-1)
    t_lp = torch.log_softmax(torch.tensor(te, dtype=dtype) / TEMP, dim=-1).detach()
    idx = torch.tensor(tok, dtype=torch.long)[..., None]
    kw = {}
    if full:
        top = torch.topk(s_lp, K, dim=-1).indices
        kw = dict(student_topk_log_probs=s_lp.gather(-1, top),
                  teacher_topk_log_probs=t_lp.gather(-1, top))
    if with_is:
        old_lp = torch.log_softmax(torch.tensor(old, dtype=dtype) / TEMP, dim=-1)
        kw.update(old_log_probs=old_lp.gather(-1, idx)[..., 0],
                  rollout_is_weights=torch.tensor(rw, dtype=dtype))
    loss, _ = peer.compute_self_distillation_loss(
        student_log_probs=s_lp.gather(-1, idx)[..., 0],
        teacher_log_probs=t_lp.gather(-1, idx)[..., 0],
        response_mask=torch.tensor(resp, dtype=dtype),
        alpha=alpha,
        is_clip=IS_CLIP if with_is else None,
        add_tail=tail,
        self_distillation_mask=torch.tensor(sd, dtype=dtype),
        **kw,
    )
    loss.backward()
    return loss.item(), x.grad.numpy()


def _our_loss_and_grad(s, te, tok, resp, sd, old, rw, *, alpha, tail, with_is, full, dtype):
    cfg = L.DistillLossConfig(alpha=alpha, topk=K if full else None, add_tail=tail,
                              temperature=TEMP, full_logit_distillation=full,
                              is_clip=IS_CLIP if with_is else None)
    kw = {}
    if with_is:
        old_lp = jax.nn.log_softmax(jnp.asarray(old, dtype) / TEMP, axis=-1)
        kw = dict(old_token_logp=jnp.take_along_axis(old_lp, jnp.asarray(tok)[..., None],
                                                     -1)[..., 0],
                  rollout_is_weights=jnp.asarray(rw, dtype))

    def f(x):
        return R.self_distillation_loss(
            x, jnp.asarray(te, dtype), jnp.asarray(tok, jnp.int32), jnp.asarray(resp, dtype),
            jnp.asarray(sd, dtype), cfg, **kw)[0]

    val, grad = jax.jit(jax.value_and_grad(f))(jnp.asarray(s, dtype))
    return float(val), np.asarray(grad)


CASES = [dict(alpha=a, tail=t, with_is=i, full=True)
         for a, t, i in itertools.product((0.0, 0.25, 0.5, 1.0), (True, False), (False, True))]
CASES += [dict(alpha=1.0, tail=True, with_is=i, full=False) for i in (False, True)]


@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sdpo_loss_and_gradient_equal_sdpo_rl(peer, case):
    inputs = _inputs(3)
    with jax.enable_x64(True):
        ours, g_ours = _our_loss_and_grad(*inputs, **case, dtype=jnp.float64)
    theirs, g_theirs = _peer_loss_and_grad(peer, *inputs, **case, dtype=torch.float64)
    assert ours == pytest.approx(theirs, abs=ATOL64, rel=ATOL64)
    np.testing.assert_allclose(g_ours, g_theirs, atol=ATOL64, rtol=0)
    assert np.abs(g_theirs).max() > 1e-3  # not vacuous
    # the masked sample gets no gradient from either
    assert np.all(g_theirs[1] == 0.0) and np.all(g_ours[1] == 0.0)
    ours32, g32 = _our_loss_and_grad(*inputs, **case, dtype=jnp.float32)
    theirs32, gt32 = _peer_loss_and_grad(peer, *inputs, **case, dtype=torch.float32)
    assert ours32 == pytest.approx(theirs32, abs=ATOL32_LOSS, rel=ATOL32)
    np.testing.assert_allclose(g32, gt32, atol=ATOL32, rtol=0)


def test_the_comparison_sees_a_changed_loss(peer):
    """A different alpha or K on our side is caught: the reference is not blind to the knobs."""
    inputs = _inputs(5)
    base = dict(tail=True, with_is=False, full=True)
    with jax.enable_x64(True):
        theirs, g_theirs = _peer_loss_and_grad(peer, *inputs, alpha=0.5, **base,
                                               dtype=torch.float64)
        other, g_other = _our_loss_and_grad(*inputs, alpha=0.25, **base, dtype=jnp.float64)
    assert abs(other - theirs) > 1e3 * ATOL64 or np.abs(g_other - g_theirs).max() > 1e3 * ATOL64
