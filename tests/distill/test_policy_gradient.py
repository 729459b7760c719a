"""GRPO and the GRPO + SDPO hybrid (:mod:`pmd_jax.distill.policy_gradient`) vs numpy and torch.

References: numpy for the advantages and the PPO clip values, torch autograd for the gradients
(the hybrid's on-policy gradient is the REINFORCE surrogate with the combined advantage).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pmd_jax.distill import losses as L
from pmd_jax.distill import policy_gradient as PG
from tests.distill.test_losses import ATOL, np_log_softmax, rand_inputs, torch_loss_and_grad


def test_grpo_advantages_match_numpy():
    rng = np.random.default_rng(12)
    r = rng.integers(0, 2, size=12).astype(np.float32)
    got = np.asarray(PG.grpo_advantages(jnp.asarray(r), 4))
    ref = (r.reshape(3, 4) - r.reshape(3, 4).mean(1, keepdims=True)).reshape(-1)
    np.testing.assert_allclose(got, ref, atol=1e-7)
    # no std normalisation: a group with rewards (1, 0, 0, 0) gives (0.75, -0.25, ...)
    np.testing.assert_allclose(
        PG.grpo_advantages(jnp.asarray([1.0, 0, 0, 0]), 4), [0.75, -0.25, -0.25, -0.25]
    )


def np_ppo(lp, old, adv, lo=0.2, hi=0.28, c=3.0):
    ratio = np.exp(np.clip(lp - old, -20, 20))
    l1 = -adv * ratio
    l2 = -adv * np.clip(ratio, 1 - lo, 1 + hi)
    loss = np.maximum(l1, l2)
    if c is not None:
        loss = np.where(adv < 0, np.minimum(loss, -adv * c), loss)
    return loss


@pytest.mark.parametrize("dual_clip", [3.0, None])
def test_ppo_clip_values_match_numpy(dual_clip):
    rng = np.random.default_rng(13)
    lp = rng.normal(size=(4, 50)) - 2
    old = lp + rng.normal(size=(4, 50)) * 0.8  # ratios well outside [0.8, 1.28] and > 3
    adv = rng.normal(size=(4, 50))
    got, clipped = PG.ppo_clip_per_token(
        jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), clip_ratio_c=dual_clip
    )
    np.testing.assert_allclose(np.asarray(got), np_ppo(lp, old, adv, c=dual_clip), atol=1e-6)
    assert 0 < float(np.mean(clipped)) < 1


def torch_pg_grad(lp, old, adv, mask, lo=0.2, hi=0.28, c=3.0, rw=None):
    x = torch.tensor(lp, requires_grad=True)
    ratio = torch.exp((x - torch.tensor(old)).clamp(-20, 20))
    a = torch.tensor(adv)
    l1, l2 = -a * ratio, -a * ratio.clamp(1 - lo, 1 + hi)
    loss = torch.maximum(l1, l2)
    if c is not None:
        loss = torch.where(a < 0, torch.minimum(loss, -a * c), loss)
    if rw is not None:
        loss = loss * torch.tensor(rw)
    m = torch.tensor(mask)
    tot = (loss * m).sum() / m.sum().clamp(min=1)
    tot.backward()
    return tot.item(), x.grad.numpy()


def test_grpo_loss_value_and_grad_match_torch():
    rng = np.random.default_rng(14)
    lp = rng.normal(size=(8, 6)) - 2
    old = lp + rng.normal(size=(8, 6)) * 0.3
    rewards = rng.integers(0, 2, size=8).astype(np.float64)
    mask = (rng.random((8, 6)) < 0.8).astype(np.float64)
    rw = rng.uniform(0.5, 2.0, size=(8, 6))
    with jax.enable_x64(True):
        adv = PG.grpo_advantages(jnp.asarray(rewards), 4)

        def f(x):
            return PG.grpo_loss(
                x,
                jnp.asarray(mask),
                adv,
                old_token_logp=jnp.asarray(old),
                rollout_is_weights=jnp.asarray(rw),
            )[0]

        val, g = jax.value_and_grad(f)(jnp.asarray(lp))
    adv_tok = np.broadcast_to(np.asarray(adv)[:, None], lp.shape)
    ref_val, ref_g = torch_pg_grad(lp, old, adv_tok, mask, rw=rw)
    assert float(val) == pytest.approx(ref_val, abs=ATOL)
    np.testing.assert_allclose(np.asarray(g), ref_g, atol=ATOL)


@pytest.mark.parametrize("lam", [0.0, 0.5, 0.9, 1.0])
def test_hybrid_loss_gradient_is_policy_gradient_with_combined_advantage(lam):
    """On-policy: grad = -sum m_bt A_bt grad logpi(y_bt) / sum m with Eq. 3's advantage."""
    s, te, tok, resp, sd = rand_inputs(15, b=4)
    rewards = np.asarray([1.0, 0.0, 0.0, 1.0])
    with jax.enable_x64(True):
        adv = PG.grpo_advantages(jnp.asarray(rewards), 2)
        t_tok = np.take_along_axis(np_log_softmax(te), tok[..., None], -1)[..., 0]

        def f(x):
            lp = L.token_log_probs(L.log_probs(x), jnp.asarray(tok))
            return PG.hybrid_loss(
                lp, jnp.asarray(t_tok), jnp.asarray(resp), adv, lam, sd_mask=jnp.asarray(sd)
            )[0]

        g = np.asarray(jax.grad(f)(jnp.asarray(s)))
    # torch reference: the REINFORCE surrogate with the combined (detached) advantage
    x = torch.tensor(s, requires_grad=True)
    lp = torch.log_softmax(x, -1).gather(-1, torch.tensor(tok, dtype=torch.long)[..., None])[..., 0]
    a_sd = (torch.tensor(t_tok) - lp).detach() * torch.tensor(sd)[:, None]
    a = lam * torch.tensor(np.asarray(adv))[:, None] + (1 - lam) * a_sd
    m = torch.tensor(resp)
    (-(a * lp * m).sum() / m.sum()).backward()
    np.testing.assert_allclose(g, x.grad.numpy(), atol=ATOL)
    if lam == 0.0:  # equals the sampled-token surrogate's gradient on distilled samples
        ref_g = torch_loss_and_grad(
            s, te, tok, resp * sd[:, None], np.ones(4), alpha=1.0, full=False
        )[1]
        np.testing.assert_allclose(g * resp.sum() / (resp * sd[:, None]).sum(), ref_g, atol=ATOL)


def test_hybrid_advantage_formula():
    s_tok = jnp.asarray([[-1.0, -2.0], [-0.5, -3.0]])
    t_tok = jnp.asarray([[-0.5, -2.5], [-1.0, -1.0]])
    a = PG.hybrid_advantages(jnp.asarray([0.5, -0.5]), s_tok, t_tok, 0.9, jnp.asarray([1.0, 0.0]))
    ref = np.asarray([[0.45 + 0.1 * 0.5, 0.45 + 0.1 * -0.5], [-0.45, -0.45]])
    np.testing.assert_allclose(np.asarray(a), ref, atol=1e-6)


def test_rewards_must_split_into_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        PG.grpo_advantages(jnp.zeros(6), 4)
