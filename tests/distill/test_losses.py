"""Losses vs direct references: numpy formulas for values, torch autograd for gradients.

(GRPO and the hybrid: tests/distill/test_policy_gradient.py; the unchunked SDPO loss under test is
``tests/distill/reference_losses.self_distillation_loss``, itself checked against torch here.)

The torch reference follows METHOD.md 1.2-1.3 (verl ``compute_self_distillation_loss``):
``F.kl_div(input, target, log_target=True)`` is torch's KL, ``torch.topk`` picks the student
indices, the mixture is a ``torch.logsumexp`` over the stacked weighted log-probs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pmd_jax.distill import losses as L
from tests.distill import reference_losses as R

ATOL = 1e-5
B, T, V = 3, 5, 13


# --------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------


def np_log_softmax(x: np.ndarray, temp: float = 1.0) -> np.ndarray:
    x = x.astype(np.float64) / temp
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_kl(p_logp: np.ndarray, q_logp: np.ndarray) -> np.ndarray:
    return (np.exp(p_logp) * (p_logp - q_logp)).sum(-1)


def np_divergence(s: np.ndarray, t: np.ndarray, alpha: float) -> np.ndarray:
    if alpha == 0.0:
        return np_kl(t, s)
    if alpha == 1.0:
        return np_kl(s, t)
    m = np.log((1 - alpha) * np.exp(s) + alpha * np.exp(t))
    return (1 - alpha) * np_kl(s, m) + alpha * np_kl(t, m)


def torch_buckets(s_lp, t_lp, topk, tail):
    if topk is None:
        return s_lp, t_lp
    _, idx = torch.topk(s_lp, topk, dim=-1)
    s, t = s_lp.gather(-1, idx), t_lp.gather(-1, idx)

    def add_tail(lp):
        ls = torch.logsumexp(lp, -1, keepdim=True).clamp(max=-1e-7)
        return torch.cat([lp, torch.log(-torch.expm1(ls))], -1)

    if tail:
        return add_tail(s), add_tail(t)
    return s - torch.logsumexp(s, -1, keepdim=True), t - torch.logsumexp(t, -1, keepdim=True)


def torch_div(s, t, alpha):
    if alpha == 0.0:
        return F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    if alpha == 1.0:
        return F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
    a = torch.tensor(alpha, dtype=s.dtype)
    m = torch.logsumexp(torch.stack([s + torch.log(1 - a), t + torch.log(a)]), 0)
    kl_t = F.kl_div(m, t, reduction="none", log_target=True)
    kl_s = F.kl_div(m, s, reduction="none", log_target=True)
    return torch.lerp(kl_s, kl_t, a).sum(-1)


def torch_sdpo_loss(
    s_logits,
    t_logits,
    tokens,
    resp_mask,
    sd_mask,
    *,
    alpha,
    topk=None,
    tail=True,
    temp=1.0,
    full=True,
    is_clip=None,
    old_logp=None,
    rollout_w=None,
):
    s_lp = torch.log_softmax(s_logits / temp, -1)
    t_lp = torch.log_softmax(t_logits / temp, -1).detach()
    s_tok = s_lp.gather(-1, tokens[..., None])[..., 0]
    t_tok = t_lp.gather(-1, tokens[..., None])[..., 0]
    if full:
        sb, tb = torch_buckets(s_lp, t_lp, topk, tail)
        per_tok = torch_div(sb, tb, alpha)
    else:
        per_tok = (s_tok - t_tok).detach() * s_tok
    if is_clip is not None:
        old = s_tok.detach() if old_logp is None else old_logp
        ratio = torch.exp((s_tok - old).detach().clamp(-20, 20)).clamp(max=is_clip)
        per_tok = per_tok * ratio
    if rollout_w is not None:
        per_tok = per_tok * rollout_w
    mask = resp_mask * sd_mask[:, None]
    return (per_tok * mask).sum() / mask.sum().clamp(min=1.0)


def rand_inputs(seed: int, scale: float = 2.0, b: int = B, t: int = T, v: int = V):
    rng = np.random.default_rng(seed)
    s = rng.normal(size=(b, t, v)) * scale
    te = rng.normal(size=(b, t, v)) * scale
    tok = rng.integers(0, v, size=(b, t)).astype(np.int32)
    resp = (rng.random((b, t)) < 0.8).astype(np.float64)
    resp[0, 0] = 1.0
    sd = np.ones(b)
    sd[-1] = 0.0
    return s, te, tok, resp, sd


def jax_loss_and_grad(s, te, tok, resp, sd, cfg, **kw):
    def f(x):
        return R.self_distillation_loss(
            x, jnp.asarray(te), jnp.asarray(tok), jnp.asarray(resp), jnp.asarray(sd), cfg, **kw
        )[0]

    return jax.jit(jax.value_and_grad(f))(jnp.asarray(s))


def torch_loss_and_grad(s, te, tok, resp, sd, **kw):
    x = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    loss = torch_sdpo_loss(
        x,
        torch.tensor(te),
        torch.tensor(tok, dtype=torch.long),
        torch.tensor(resp),
        torch.tensor(sd),
        **kw,
    )
    loss.backward()
    return loss.item(), x.grad.numpy()


# --------------------------------------------------------------------------------------------
# values vs numpy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temp", [1.0, 0.6, 1.7])
def test_log_probs_temperature_matches_numpy(temp):
    s, *_ = rand_inputs(0)
    got = np.asarray(L.log_probs(jnp.asarray(s, jnp.float32), temp))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, np_log_softmax(s, temp), atol=ATOL)


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.73, 1.0])
def test_full_vocab_divergence_values_float32(alpha):
    s, te, *_ = rand_inputs(1)
    sl, tl = np_log_softmax(s), np_log_softmax(te)
    got = L.divergence(jnp.asarray(sl, jnp.float32), jnp.asarray(tl, jnp.float32), alpha)
    np.testing.assert_allclose(np.asarray(got), np_divergence(sl, tl, alpha), atol=ATOL)


def test_named_divergences_are_the_right_directions():
    s, te, *_ = rand_inputs(2)
    sl, tl = (jnp.asarray(np_log_softmax(x), jnp.float32) for x in (s, te))
    np.testing.assert_allclose(
        L.reverse_kl(sl, tl), np_kl(np.asarray(sl), np.asarray(tl)), atol=ATOL
    )
    np.testing.assert_allclose(
        L.forward_kl(sl, tl), np_kl(np.asarray(tl), np.asarray(sl)), atol=ATOL
    )
    # JSD(0.5) is symmetric and bounded by log 2
    j1 = np.asarray(L.generalized_jsd(sl, tl, 0.5))
    j2 = np.asarray(L.generalized_jsd(tl, sl, 0.5))
    np.testing.assert_allclose(j1, j2, atol=ATOL)
    assert (j1 >= -ATOL).all() and (j1 <= np.log(2) + ATOL).all()


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("k", [1, 4, V])
def test_topk_buckets_match_numpy(k, tail):
    s, te, *_ = rand_inputs(3)
    sl, tl = np_log_softmax(s), np_log_softmax(te)
    # float64: with k = V the tail is log(1 - (1 - eps)), a cancellation fp32 cannot resolve
    with jax.enable_x64(True):
        sb, tb = L.distill_buckets(jnp.asarray(sl), jnp.asarray(tl), k, tail)
    idx = np.argsort(-sl, axis=-1, kind="stable")[..., :k]
    s_k = np.take_along_axis(sl, idx, -1)
    t_k = np.take_along_axis(tl, idx, -1)
    if tail:

        def with_tail(x):
            lse = np.log(np.exp(x).sum(-1, keepdims=True))
            return np.concatenate([x, np.log(-np.expm1(np.minimum(lse, -1e-7)))], -1)

        ref_s, ref_t = with_tail(s_k), with_tail(t_k)
        assert sb.shape[-1] == k + 1
    else:
        ref_s = s_k - np.log(np.exp(s_k).sum(-1, keepdims=True))
        ref_t = t_k - np.log(np.exp(t_k).sum(-1, keepdims=True))
        assert sb.shape[-1] == k
    np.testing.assert_allclose(np.asarray(sb), ref_s, atol=ATOL)
    np.testing.assert_allclose(np.asarray(tb), ref_t, atol=ATOL)
    # the tail bucket makes the K+1 buckets a distribution
    if tail:
        np.testing.assert_allclose(np.exp(np.asarray(tb)).sum(-1), 1.0, atol=1e-6)


def test_tail_clamp_when_topk_holds_all_mass():
    lp = jnp.log(jnp.asarray([[0.5, 0.5], [1.0, 1e-30]]))
    out = np.asarray(L.add_tail(lp))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:, -1], np.log(-np.expm1(-1e-7)), rtol=1e-4)


def test_is_ratio_and_truncated_is_weights_match_numpy():
    rng = np.random.default_rng(4)
    lp = rng.normal(size=(B, T)) * 3
    old = rng.normal(size=(B, T)) * 3
    old[0, 0] = lp[0, 0] + 50.0  # exercises the -20 clamp
    got = np.asarray(L.is_ratio(jnp.asarray(lp), jnp.asarray(old), 2.0))
    ref = np.minimum(np.exp(np.clip(lp - old, -20, 20)), 2.0)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    assert got[0, 0] == pytest.approx(np.exp(-20.0), rel=1e-5)
    mask = (rng.random((B, T)) < 0.5).astype(np.float32)
    w = np.asarray(
        L.truncated_is_weights(jnp.asarray(lp), jnp.asarray(old), 1.5, jnp.asarray(mask))
    )
    np.testing.assert_allclose(
        w, np.minimum(np.exp(np.clip(lp - old, -20, 20)), 1.5) * mask, rtol=1e-6
    )


def test_token_stats_metrics_match_numpy():
    s, te, tok, *_ = rand_inputs(5)
    cfg = L.DistillLossConfig(alpha=1.0, topk=None, temperature=0.8)
    st = L.token_distill_stats(
        jnp.asarray(s, jnp.float32), jnp.asarray(te, jnp.float32), jnp.asarray(tok), cfg
    )
    sl, tl = np_log_softmax(s, 0.8), np_log_softmax(te, 0.8)
    np.testing.assert_allclose(st["loss"], np_kl(sl, tl), atol=ATOL)
    np.testing.assert_allclose(st["kl"], np_kl(sl, tl), atol=ATOL)
    np.testing.assert_allclose(st["entropy"], -(np.exp(sl) * sl).sum(-1), atol=ATOL)
    np.testing.assert_allclose(
        st["student_logp"], np.take_along_axis(sl, tok[..., None], -1)[..., 0], atol=ATOL
    )
    np.testing.assert_allclose(
        st["teacher_logp"], np.take_along_axis(tl, tok[..., None], -1)[..., 0], atol=ATOL
    )
    np.testing.assert_array_equal(st["top1_agree"], (sl.argmax(-1) == tl.argmax(-1)))


# --------------------------------------------------------------------------------------------
# full loss: values and gradients vs torch autograd
# --------------------------------------------------------------------------------------------

LOSS_CASES = [
    dict(alpha=1.0, topk=None),
    dict(alpha=0.0, topk=None),
    dict(alpha=0.5, topk=None),
    dict(alpha=0.25, topk=None, temp=0.7),
    dict(alpha=0.5, topk=4, tail=True),
    dict(alpha=0.5, topk=4, tail=False),
    dict(alpha=1.0, topk=5, tail=True, temp=1.3),
    dict(alpha=0.0, topk=3, tail=False),
    dict(alpha=0.9, topk=V, tail=True),
    dict(alpha=1.0, full=False),
]


@pytest.mark.parametrize(
    "case", LOSS_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items())
)
@pytest.mark.parametrize("with_is", [False, True])
def test_sdpo_loss_value_and_grad_match_torch(case, with_is):
    s, te, tok, resp, sd = rand_inputs(6)
    rng = np.random.default_rng(7)
    kw = {}
    tkw = {}
    if with_is:
        old = np_log_softmax(s + rng.normal(size=s.shape) * 0.5)
        old_tok = np.take_along_axis(old, tok[..., None], -1)[..., 0]
        rw = rng.uniform(0.2, 2.0, size=(B, T))
        kw = dict(old_token_logp=jnp.asarray(old_tok), rollout_is_weights=jnp.asarray(rw))
        tkw = dict(is_clip=2.0, old_logp=torch.tensor(old_tok), rollout_w=torch.tensor(rw))
    cfg = L.DistillLossConfig(
        alpha=case["alpha"],
        topk=case.get("topk"),
        add_tail=case.get("tail", True),
        temperature=case.get("temp", 1.0),
        full_logit_distillation=case.get("full", True),
        is_clip=2.0 if with_is else None,
    )
    with jax.enable_x64(True):
        val, grad = jax_loss_and_grad(s, te, tok, resp, sd, cfg, **kw)
    ref_val, ref_grad = torch_loss_and_grad(
        s,
        te,
        tok,
        resp,
        sd,
        alpha=case["alpha"],
        topk=case.get("topk"),
        tail=case.get("tail", True),
        temp=case.get("temp", 1.0),
        full=case.get("full", True),
        **tkw,
    )
    assert float(val) == pytest.approx(ref_val, abs=ATOL)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, atol=ATOL)
    assert np.abs(ref_grad).max() > 1e-4  # the comparison is not vacuous
    if with_is:
        return
    # float32 path within the same tolerance
    val32, grad32 = jax_loss_and_grad(
        s.astype(np.float32),
        te.astype(np.float32),
        tok,
        resp.astype(np.float32),
        sd.astype(np.float32),
        cfg,
        **{k: v.astype(jnp.float32) for k, v in kw.items()},
    )
    assert float(val32) == pytest.approx(ref_val, abs=ATOL)
    np.testing.assert_allclose(np.asarray(grad32), ref_grad, atol=ATOL)


def test_teacher_gets_no_gradient_and_masked_sample_gets_none():
    s, te, tok, resp, sd = rand_inputs(8)
    cfg = L.DistillLossConfig(alpha=0.5, topk=None)

    def f(x, y):
        return R.self_distillation_loss(
            x, y, jnp.asarray(tok), jnp.asarray(resp), jnp.asarray(sd), cfg
        )[0]

    gs, gt = jax.grad(f, argnums=(0, 1))(jnp.asarray(s, jnp.float32), jnp.asarray(te, jnp.float32))
    assert not np.any(np.asarray(gt))
    assert not np.any(np.asarray(gs)[-1])  # sd_mask[-1] = 0
    assert np.any(np.asarray(gs)[0])


def test_all_masked_batch_gives_exact_zero_and_zero_grads():
    s, te, tok, resp, sd = rand_inputs(9)
    for cfg in (L.DistillLossConfig(alpha=0.5, topk=4), L.DistillLossConfig(alpha=1.0, topk=None)):
        for r, m in ((np.zeros_like(resp), sd), (resp, np.zeros_like(sd))):

            def f(x, r=r, m=m, cfg=cfg):
                return R.self_distillation_loss(
                    x,
                    jnp.asarray(te, jnp.float32),
                    jnp.asarray(tok),
                    jnp.asarray(r),
                    jnp.asarray(m),
                    cfg,
                )

            (loss, metrics), g = jax.jit(jax.value_and_grad(f, has_aux=True))(
                jnp.asarray(s, jnp.float32)
            )
            assert float(loss) == 0.0
            assert np.all(np.asarray(g) == 0.0)
            assert all(np.isfinite(np.asarray(v)).all() for v in metrics.values())


def test_on_policy_default_equals_explicit_detached_old_logp():
    s, te, tok, resp, sd = rand_inputs(10)
    cfg = L.DistillLossConfig(alpha=0.5, topk=4, is_clip=2.0)
    v1, g1 = jax_loss_and_grad(s.astype(np.float32), te.astype(np.float32), tok, resp, sd, cfg)
    old = np.take_along_axis(np_log_softmax(s), tok[..., None], -1)[..., 0]
    v2, g2 = jax_loss_and_grad(
        s.astype(np.float32),
        te.astype(np.float32),
        tok,
        resp,
        sd,
        cfg,
        old_token_logp=jnp.asarray(old, jnp.float32),
    )
    np.testing.assert_allclose(v1, v2, atol=ATOL)
    np.testing.assert_allclose(g1, g2, atol=ATOL)


def test_jit_compiles_each_mode():
    s, te, tok, resp, sd = rand_inputs(11)
    for case in LOSS_CASES:
        cfg = L.DistillLossConfig(
            alpha=case["alpha"],
            topk=case.get("topk"),
            add_tail=case.get("tail", True),
            full_logit_distillation=case.get("full", True),
        )
        f = jax.jit(
            lambda a, b, cfg=cfg: R.self_distillation_loss(
                a, b, jnp.asarray(tok), jnp.asarray(resp), jnp.asarray(sd), cfg
            )[0]
        )
        assert np.isfinite(float(f(jnp.asarray(s, jnp.float32), jnp.asarray(te, jnp.float32))))


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan")])
def test_alpha_outside_unit_interval_is_rejected(alpha):
    with pytest.raises(ValueError, match="alpha"):
        L.DistillLossConfig(alpha=alpha).validate()
    x = jnp.zeros((2, 4))
    with pytest.raises(ValueError, match="alpha"):
        L.divergence(x, x, alpha)


def test_traced_alpha_is_rejected_clearly():
    x = jnp.zeros((2, 4))
    with pytest.raises(TypeError, match="alpha must be a static Python number"):
        jax.jit(lambda a: L.divergence(x, x, a))(0.5)


def test_topk_larger_than_vocab_is_rejected():
    s, te, tok, resp, sd = rand_inputs(16)
    cfg = L.DistillLossConfig(alpha=0.5, topk=V + 1)
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        R.self_distillation_loss(
            jnp.asarray(s),
            jnp.asarray(te),
            jnp.asarray(tok),
            jnp.asarray(resp),
            jnp.asarray(sd),
            cfg,
        )
    with pytest.raises(ValueError, match="topk"):
        L.topk_log_probs(jnp.asarray(s), jnp.asarray(te), 0)


def test_mismatched_shapes_are_rejected():
    s, te, tok, resp, sd = rand_inputs(17)
    cfg = L.DistillLossConfig(topk=4)
    with pytest.raises(ValueError, match="student/teacher logits"):
        R.self_distillation_loss(
            jnp.asarray(s),
            jnp.asarray(te[:, :-1]),
            jnp.asarray(tok),
            jnp.asarray(resp),
            jnp.asarray(sd),
            cfg,
        )
    with pytest.raises(ValueError, match="tokens shape"):
        R.self_distillation_loss(
            jnp.asarray(s),
            jnp.asarray(te),
            jnp.asarray(tok[:, :-1]),
            jnp.asarray(resp),
            jnp.asarray(sd),
            cfg,
        )
    with pytest.raises(ValueError, match="response mask"):
        R.self_distillation_loss(
            jnp.asarray(s),
            jnp.asarray(te),
            jnp.asarray(tok),
            jnp.asarray(resp[:, :-1]),
            jnp.asarray(sd),
            cfg,
        )
    with pytest.raises(ValueError, match="self-distillation mask"):
        R.self_distillation_loss(
            jnp.asarray(s),
            jnp.asarray(te),
            jnp.asarray(tok),
            jnp.asarray(resp),
            jnp.asarray(sd[:-1]),
            cfg,
        )
    with pytest.raises(TypeError, match="integer"):
        R.self_distillation_loss(
            jnp.asarray(s),
            jnp.asarray(te),
            jnp.asarray(tok, jnp.float32),
            jnp.asarray(resp),
            jnp.asarray(sd),
            cfg,
        )


def test_sampled_token_mode_requires_reverse_kl():
    with pytest.raises(ValueError, match="alpha=1"):
        L.DistillLossConfig(alpha=0.5, full_logit_distillation=False).validate()
    with pytest.raises(ValueError, match="temperature"):
        L.DistillLossConfig(temperature=0.0).validate()
