"""The jitted train step: sharded == unsharded on 8 fake CPU devices, learning, bad input.

References: the unsharded step (for the sharded one), and for the GRPO / hybrid wiring the
loss recomputed from full decoder logits with numpy gathering and the unchunked formulas.
"""

from __future__ import annotations

# isort: off
from tests.distill.distill_common import (  # first: sets 8 fake devices
    TINY,
    make_mesh8,
    small_distill_config,
)
# isort: on

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.distill import align, losses
from pmd_jax.distill import batch as dbatch
from pmd_jax.distill import policy_gradient as pg
from pmd_jax.distill import step as st
from pmd_jax.distill.config import DistillConfigError
from pmd_jax.models import decoder
from pmd_jax.run import sharding as shd
from tests.distill import reference_losses
from tests.fakes import tiny_model_config

B = 4
GROUP = 2


def _cfg(**kw):
    return small_distill_config(**{"teacher__rule": "frozen", "loss__chunk_size": 3,
                                   "loss__group_size": GROUP, **kw})


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    sp = [r.integers(1, TINY.vocab_size, r.integers(2, 6)) for _ in range(B)]
    tp = [r.integers(1, TINY.vocab_size, r.integers(3, 10)) for _ in range(B)]
    rs = [r.integers(1, TINY.vocab_size, r.integers(2, 7)) for _ in range(B)]
    db = align.build_distill_batch(sp, tp, rs, pad_id=0)
    return dbatch.make_batch(
        db, sd_mask=np.ones(B, np.float32),
        sampler_logp=np.full(db.responses.shape, -3.5, np.float32),
        rewards=np.array([1.0, 0.0, 0.0, 1.0], np.float32),
    )


def _params(seed: int):
    return decoder.init_params(TINY, jax.random.PRNGKey(seed))


def _with_teacher(state: st.TrainState, seed: int = 7) -> st.TrainState:
    """A frozen teacher that is a different model, so there is something to distil."""
    if not state.teacher:  # grpo: no teacher tree in the state
        return state
    return state.replace(teacher=jax.tree.map(
        lambda t, p: jax.device_put(p, t.sharding), state.teacher, _params(seed)))


def _np(tree):
    return jax.tree.map(lambda x: np.asarray(x), tree)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh8()


@pytest.fixture(scope="module")
def plain_step():
    return st.TrainStep(TINY, _cfg())


def test_sharded_step_equals_unsharded_and_loss_decreases(mesh, plain_step):
    batch = _batch()
    rules = shd.ShardingRules.from_mapping()
    sharded = st.TrainStep(TINY, _cfg(), mesh=mesh, rules=rules)

    s_u = _with_teacher(plain_step.init(_params(0), 0))
    s_s = _with_teacher(sharded.init(_params(0), 0))
    m_u_all, m_s_all = [], []
    for _ in range(2):
        s_u, m_u = plain_step.step(s_u, batch)
        s_s, m_s = sharded.step(s_s, batch)
        m_u_all.append(_np(m_u))
        m_s_all.append(_np(m_s))
    for mu, ms in zip(m_u_all, m_s_all):
        for k in ("loss", "kl", "top1_agree", "grad_norm", "logp_mismatch_mean"):
            np.testing.assert_allclose(ms[k], mu[k], rtol=2e-4, atol=1e-6, err_msg=k)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(s_s.params),
                            jax.tree.leaves(s_u.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-6,
                                   err_msg=jax.tree_util.keystr(path))
    # params and optimizer moments really are sharded per the logical rules
    want = rules.spec(("embed", "mlp"))
    assert s_s.params["layers"]["gate"].sharding.spec == rules.spec(("layers", "embed", "mlp"))
    assert want == jax.sharding.PartitionSpec("fsdp", "tensor")
    mu = s_s.opt_state[1][0].mu["layers"]["gate"]
    assert mu.sharding.spec == s_s.params["layers"]["gate"].sharding.spec
    assert mu.dtype == jnp.float32

    # repeated batch: the loss goes down (fixed teacher, Adam)
    losses_seen = [float(m["loss"]) for m in m_u_all]
    for _ in range(8):
        s_u, m = plain_step.step(s_u, batch)
        losses_seen.append(float(m["loss"]))
    assert all(np.isfinite(losses_seen))
    assert losses_seen[-1] < 0.7 * losses_seen[0], losses_seen
    assert int(s_u.step) == 10


def test_all_masked_batch_gives_zero_loss_no_nan(plain_step):
    batch = _batch()
    batch["sd_mask"] = np.zeros(B, np.float32)
    state = _with_teacher(plain_step.init(_params(0), 0))
    state, m = plain_step.step(state, batch)
    m = _np(m)
    assert m["loss"] == 0.0
    assert m["grad_norm"] == 0.0
    assert m["masked_sample_fraction"] == 1.0
    assert m["num_loss_tokens"] == 0.0
    for k, v in m.items():
        assert np.isfinite(v), k
    assert m["skipped"] == 0.0
    for leaf in jax.tree.leaves(state.params):
        assert np.all(np.isfinite(np.asarray(leaf)))


def test_nonfinite_loss_skips_update_and_reports_it(plain_step):
    batch = _batch()
    bad = batch["sampler_logp"].copy()
    bad[0, 0] = np.nan  # a corrupt sampler log-prob on a real response token
    batch["sampler_logp"] = bad
    state = _with_teacher(plain_step.init(_params(0), 0))
    before_p, before_o = _np(state.params), _np(state.opt_state)
    state, m = plain_step.step(state, batch)
    assert float(m["skipped"]) == 1.0 and float(m["finite"]) == 0.0
    assert not np.isfinite(float(m["loss"]))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before_p)):
        np.testing.assert_array_equal(np.asarray(a), b)
    for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(before_o)):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert int(state.step) == 1


def _full_token_logp(params, batch, side, temperature=1.0):
    logits, _ = decoder.forward(
        params, jnp.asarray(batch[f"{side}_tokens"]), jnp.asarray(batch[f"{side}_positions"]),
        TINY, attn_mask=jnp.asarray(batch[f"{side}_attn_mask"]),
    )
    lp = np.asarray(jax.nn.log_softmax(logits / temperature, axis=-1))
    idx = batch[f"{side}_index"]
    tok = batch["responses"]
    return np.stack([lp[i, idx[i], tok[i]] for i in range(lp.shape[0])])


@pytest.mark.parametrize("mode", ["grpo", "hybrid"])
def test_grpo_and_hybrid_loss_match_full_logit_reference(mode):
    ts = st.TrainStep(TINY, _cfg(loss__name=mode, loss__hybrid_lambda=0.6))
    batch = _batch(3)
    state = _with_teacher(ts.init(_params(0), 0))
    s_lp = _full_token_logp(_params(0), batch, "student")
    mask = batch["response_mask"].astype(np.float32)
    # sampler log-probs 0.1 below the trainer's on real tokens: mismatch exactly 0.1
    batch["sampler_logp"] = np.where(mask > 0, s_lp - 0.1, 0.0).astype(np.float32)
    _, m = ts.step(state, batch)
    m = _np(m)

    adv = pg.grpo_advantages(jnp.asarray(batch["rewards"]), GROUP)
    w = losses.truncated_is_weights(jnp.asarray(s_lp), jnp.asarray(batch["sampler_logp"]),
                                    2.0, jnp.asarray(mask))
    if mode == "grpo":
        ref, _ = pg.grpo_loss(jnp.asarray(s_lp), jnp.asarray(mask), adv,
                                  rollout_is_weights=w)
    else:
        t_lp = _full_token_logp(_params(7), batch, "teacher")
        ref, _ = pg.hybrid_loss(jnp.asarray(s_lp), jnp.asarray(t_lp), jnp.asarray(mask),
                                    adv, 0.6, sd_mask=jnp.asarray(batch["sd_mask"]),
                                    rollout_is_weights=w)
    np.testing.assert_allclose(m["loss"], float(ref), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(m["logp_mismatch_mean"], 0.1, rtol=1e-3)
    np.testing.assert_allclose(m["logp_mismatch_max"], 0.1, rtol=1e-3)
    assert m["clip_frac"] == 0.0  # on-policy: ratio 1, nothing clipped
    assert m["grad_norm"] > 0


def test_bf16_params_with_fp32_master_weights():
    ts = st.TrainStep(TINY, _cfg(precision__param_dtype="bfloat16"))
    state = _with_teacher(ts.init(_params(0), 0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    state, m = ts.step(state, _batch())
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    assert all(x.dtype in (jnp.float32, jnp.int32) for x in jax.tree.leaves(state.opt_state))
    assert np.isfinite(float(m["loss"])) and float(m["loss"]) > 0
    p_bf16 = st.compute_params(state, _cfg(precision__param_dtype="bfloat16"))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p_bf16))


def test_abstract_lower_and_compile_on_mesh(mesh):
    """The dry-run path: lower + compile on ShapeDtypeStructs, nothing allocated."""
    ts = st.TrainStep(TINY, _cfg(teacher__rule="trust_region"), mesh=mesh)
    state = ts.abstract_state()
    assert state.params["embed"].sharding.spec == ts.rules.spec(("vocab", "embed"))
    batch = _batch()
    sh = ts.batch_shardings(batch)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k])
                for k, v in batch.items()}
    compiled = ts.lower(state, abstract).compile()
    mem = compiled.memory_analysis()
    assert mem is None or mem.temp_size_in_bytes >= 0


# --------------------------------------------------------------------------------------------
# bad input: clear errors before any compute
# --------------------------------------------------------------------------------------------


def test_mismatched_student_teacher_batches_raise(plain_step):
    state = None  # never reached: the batch check runs first
    batch = _batch()
    bad = dict(batch)
    for k in ("teacher_tokens", "teacher_positions", "teacher_attn_mask"):
        bad[k] = batch[k][:-1]
    with pytest.raises(dbatch.BatchError, match="student and teacher batches differ"):
        plain_step.step(state, bad)
    bad = dict(batch)
    bad["teacher_index"] = batch["teacher_index"][:, :-1]
    with pytest.raises(dbatch.BatchError, match="teacher_index has shape"):
        plain_step.step(state, bad)
    bad = dict(batch)
    bad["teacher_positions"] = batch["teacher_positions"][:, 1:]
    with pytest.raises(dbatch.BatchError, match="teacher_positions has shape"):
        plain_step.step(state, bad)
    bad = dict(batch)
    del bad["response_mask"]
    with pytest.raises(dbatch.BatchError, match="missing"):
        plain_step.step(state, bad)


def test_batch_not_divisible_by_mesh(mesh):
    ts = st.TrainStep(TINY, _cfg(), mesh=mesh)
    batch = {k: v[:3] for k, v in _batch().items()}
    with pytest.raises(dbatch.BatchError, match="not divisible by the mesh"):
        ts.step(None, batch)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"loss__alpha": 1.5}, r"loss.alpha: must be <= 1"),
        ({"loss__alpha": -0.1}, r"loss.alpha: must be >= 0"),
        ({"loss__topk": 100}, r"top-K=100 is larger than the vocabulary \(48\)"),
        ({"loss__name": "ppo"}, "loss.name"),
        ({"teacher__rule": "polyak"}, "teacher.rule"),
        ({"loss__full_logit_distillation": False}, "needs alpha=1"),
    ],
)
def test_bad_config_raises_before_compute(kw, match):
    with pytest.raises(DistillConfigError, match=match):
        st.TrainStep(TINY, _cfg(**kw))


def test_tied_embedding_step_matches_full_logit_reference():
    """Tied embeddings take the [V, D] (vocab-major) unembedding path in the chunked loss;
    with and without loss-chunk remat the loss equals the unchunked SDPO loss on full decoder
    logits, and the two give the same update."""
    tied = tiny_model_config(tie_embeddings=True)
    cfg = _cfg(loss__rollout_is_threshold=None)
    batch = _batch(5)
    p_s = decoder.init_params(tied, jax.random.PRNGKey(0))
    p_t = decoder.init_params(tied, jax.random.PRNGKey(7))

    @functools.partial(jax.jit, static_argnums=1)  # one compile, not op-by-op dispatch
    def resp_logits(params, side):
        logits, _ = decoder.forward(
            params, jnp.asarray(batch[f"{side}_tokens"]),
            jnp.asarray(batch[f"{side}_positions"]), tied,
            attn_mask=jnp.asarray(batch[f"{side}_attn_mask"]),
        )
        idx = jnp.asarray(batch[f"{side}_index"])
        return jnp.take_along_axis(logits, idx[..., None], axis=1)

    outs = []
    for remat in (True, False):
        ts = st.TrainStep(tied, cfg, loss_chunk_remat=remat)
        ref, _ = reference_losses.self_distillation_loss(
            resp_logits(p_s, "student"), resp_logits(p_t, "teacher"),
            jnp.asarray(batch["responses"]), jnp.asarray(batch["response_mask"], jnp.float32),
            jnp.asarray(batch["sd_mask"]), ts.opts.loss,
        )
        # copies: the step donates its state, and init keeps fp32 params as they are
        state = ts.init(jax.tree.map(jnp.copy, p_s), 0).replace(
            teacher=jax.tree.map(jnp.copy, p_t))
        state, m = ts.step(state, batch)
        np.testing.assert_allclose(float(m["loss"]), float(ref), rtol=1e-5, atol=1e-7)
        assert float(m["grad_norm"]) > 0
        outs.append(_np(state.params))
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_unrolled_layer_loop_equals_scan(mesh, plain_step):
    """precision.layer_loop="unrolled" (weights split per layer inside the step, remat with
    prevent_cse): same metrics and updated params as the scan, unsharded and on the mesh."""
    remat = True
    batch = _batch()
    cfg = _cfg(precision__layer_loop="unrolled", precision__remat=remat)
    s_ref, m_ref = st.TrainStep(TINY, _cfg(precision__remat=remat)).step(
        _with_teacher(plain_step.init(_params(0), 0)), batch)
    for m in (None, mesh):
        step = st.TrainStep(TINY, cfg, mesh=m, rules=shd.ShardingRules.from_mapping())
        s, met = step.step(_with_teacher(step.init(_params(0), 0)), batch)
        for k in ("loss", "kl", "grad_norm"):
            np.testing.assert_allclose(float(met[k]), float(m_ref[k]), rtol=2e-4, err_msg=k)
        for a, b in zip(jax.tree.leaves(s.params), jax.tree.leaves(s_ref.params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-6)
    with pytest.raises(DistillConfigError, match="layer_loop"):
        st.TrainStep(TINY, _cfg(precision__layer_loop="python"))
