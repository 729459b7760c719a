"""LoRA in the train step (issue 51): the state trains the adapters over a frozen base.

References: the full-fine-tuning step (step 0's loss: zero B is the base model), the SDPO loss
written directly from full decoder logits with ``decoder.forward(adapters=...)`` and
differentiated with ``jax.grad`` (the adapters' gradient), the EMA formula
(``reference_losses.ema_update``), and the KL written as the mean log-ratio of the forward
with and without the adapters.
"""

from __future__ import annotations

# isort: off
from tests.distill.distill_common import (  # first: sets 8 fake devices
    TINY, ema_step_config, make_mesh8, small_distill_config, tiny_params)
# isort: on

import functools
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.config.sections import RunConfig
from pmd_jax.distill import kl, train
from pmd_jax.distill import step as st
from pmd_jax.models import decoder, lora
from pmd_jax.models.lora import LoraConfig
from pmd_jax.run import sharding as shd
from pmd_jax.run.checkpoint import Checkpointer
from tests.distill import reference_losses
from tests.distill.test_microbatch import _batch as _batch16
from tests.distill.test_step import _batch as _batch4

LC = LoraConfig(rank=4, alpha=8.0)


def _np(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


def _shapes(tree):
    return jax.tree.map(lambda x: tuple(x.shape), tree)


def _random_adapters(seed: int) -> dict:
    """PEFT's init with B random too (B = 0 would give A no gradient)."""
    ad = lora.init_adapters(TINY, LC, jax.random.PRNGKey(seed))
    r = np.random.default_rng(seed)
    return {"layers": {k: (jnp.asarray(r.normal(0, 0.2, v.shape), jnp.float32)
                           if k.endswith("_b") else v) for k, v in ad["layers"].items()}}


@functools.partial(jax.jit, static_argnums=(3,))
def _resp_logits(base, adapters, batch, side):
    """The logits predicting each response token, from the full forward (no chunking)."""
    kw = {} if adapters is None else {"adapters": adapters, "lora": LC}
    logits, _ = decoder.forward(base, batch[f"{side}_tokens"], batch[f"{side}_positions"],
                                TINY, attn_mask=batch[f"{side}_attn_mask"], **kw)
    return jnp.take_along_axis(logits, batch[f"{side}_index"][..., None], axis=1)


def _token_logp(base, adapters, batch) -> np.ndarray:
    """log p(response token) under the student prompt, full logits, temperature 1."""
    lg = _resp_logits(base, adapters, {k: jnp.asarray(v) for k, v in batch.items()}, "student")
    lp = jax.nn.log_softmax(lg, axis=-1)
    return np.asarray(jnp.take_along_axis(lp, jnp.asarray(batch["responses"])[..., None],
                                          -1)[..., 0])


def test_one_step_trains_only_the_adapters():
    """One SDPO step with an EMA teacher: step 0's loss and metrics are the full-fine-tuning
    step's to the bit (zero B: the same model), the base is untouched, the optimizer state and
    the teacher are adapter-shaped, and the EMA teacher moved toward the new adapters at the
    configured rate (0.1)."""
    cfg = ema_step_config("sdpo", 2)
    batch = _batch16(0)
    full = st.TrainStep(TINY, cfg)
    _, m_full = full.step(full.init(tiny_params(0), 0), batch)

    ts = st.TrainStep(TINY, cfg, lora=LC)
    params = tiny_params(0)
    base = ts.place_base(params)
    assert base is params  # as given: no copy
    before = _np(base)
    s0 = ts.init(None, 0)
    adapter_shapes = lora.adapter_shapes(TINY, LC)
    assert _shapes(s0.params) == adapter_shapes
    assert _shapes(s0.teacher) == adapter_shapes
    adam = s0.opt_state[1][0]
    assert _shapes(adam.mu) == _shapes(adam.nu) == adapter_shapes
    big = [x for x in jax.tree.leaves(s0) if x.ndim and x.shape[-1] == TINY.vocab_size]
    assert not big  # nothing of the base (the embedding is not a target)
    assert not any(np.asarray(v).any() for k, v in s0.params["layers"].items()
                   if k.endswith("_b"))  # B = 0
    # the state's RNG is the full-fine-tuning state's (the adapters' key is folded out of it)
    np.testing.assert_array_equal(np.asarray(s0.rng),
                                  np.asarray(jax.random.key_data(jax.random.PRNGKey(0))))
    t0, p0 = _np(s0.teacher), _np(s0.params)

    s1, m = ts.step(s0, batch, base)
    for k in m_full:
        assert float(m[k]) == float(m_full[k]) or k in ("grad_norm", "skipped", "finite"), k
    assert float(m["loss"]) > 0 and float(m["grad_norm"]) > 0 and float(m["skipped"]) == 0
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)  # the base is bitwise unchanged
    p1 = _np(s1.params)
    assert all(np.abs(p1["layers"][k]).max() > 0 for k in p1["layers"] if k.endswith("_b"))
    assert not np.array_equal(p1["layers"]["q_lora_b"], p0["layers"]["q_lora_b"])
    assert int(s1.step) == 1
    want = _np(reference_losses.ema_update(t0, p1, 0.1))
    for k in want["layers"]:
        np.testing.assert_allclose(np.asarray(s1.teacher["layers"][k]), want["layers"][k],
                                   rtol=1e-6, atol=1e-9, err_msg=k)
    # the teacher's B moved a tenth of the way from 0 to the student's
    np.testing.assert_allclose(np.asarray(s1.teacher["layers"]["up_lora_b"]),
                               0.1 * p1["layers"]["up_lora_b"], rtol=1e-5, atol=1e-12)


def test_adapter_gradients_equal_jax_grad_of_the_direct_loss():
    """The step's loss and gradient (random A and B, a teacher with other adapters) against
    jax.grad of the SDPO loss written from full logits of decoder.forward(adapters=...)."""
    cfg = small_distill_config(teacher__rule="ema", loss__chunk_size=3,
                               loss__rollout_is_threshold=None)
    ts = st.TrainStep(TINY, cfg, lora=LC)
    base = ts.place_base(tiny_params(0))
    student, teacher = _random_adapters(1), _random_adapters(2)
    batch = _batch4(3)
    loss, _, grads = ts.gradients(student, teacher, batch, base=base)
    b = {k: jnp.asarray(v) for k, v in batch.items()}
    t_logits = _resp_logits(base, teacher, b, "teacher")

    def direct(ad):
        ref, _ = reference_losses.self_distillation_loss(
            _resp_logits(base, ad, b, "student"), t_logits, b["responses"],
            b["response_mask"].astype(jnp.float32), b["sd_mask"], ts.opts.loss)
        return ref

    ref_loss, ref_grads = jax.value_and_grad(direct)(student)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert _shapes(grads) == lora.adapter_shapes(TINY, LC)
    for k, g in ref_grads["layers"].items():
        g = np.asarray(g)
        scale = np.abs(g).max()
        assert scale > 1e-6, (k, scale)
        err = np.abs(np.asarray(grads["layers"][k]) - g).max()
        assert err <= 1e-4 * scale, (k, err, scale)


# (one rule in the default suite: the EMA rule's adapters run in the other tests)
@pytest.mark.parametrize("loss, rule", [
    ("sdpo", "trust_region"),
    *[pytest.param(a, b, marks=pytest.mark.slow)
      for a, b in (("sdpo", "live"), ("sdpo", "frozen"), ("grpo", "ema"))]])
def test_teacher_rules_and_losses(loss, rule):
    """Every teacher rule (and a loss without a teacher) over adapters: step 0's loss is the
    full-fine-tuning step's to the bit; the live teacher keeps no tree, the others adapters;
    frozen and trust-region references stay the initial adapters."""
    cfg = small_distill_config(loss__name=loss, teacher__rule=rule, loss__chunk_size=3,
                               teacher__rate=0.3)
    batch = _batch4(1)
    full = st.TrainStep(TINY, cfg)
    _, m_full = full.step(full.init(tiny_params(0), 0), batch)
    ts = st.TrainStep(TINY, cfg, lora=LC)
    base = ts.place_base(tiny_params(0))
    s0 = ts.init(None, 0)
    t0 = _np(s0.teacher)
    s1, m = ts.step(s0, batch, base)
    assert float(m["loss"]) == float(m_full["loss"]) and np.isfinite(float(m["loss"]))
    assert float(m["grad_norm"]) > 0
    if rule == "live" or loss == "grpo":
        assert s1.teacher == {}
    else:
        assert _shapes(s1.teacher) == lora.adapter_shapes(TINY, LC)
        for a, b in zip(jax.tree.leaves(s1.teacher), jax.tree.leaves(t0), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.slow  # (the mesh and microbatch paths are the full-fine-tuning ones, with base)
def test_sharded_microbatched_and_two_program_steps():
    """On the 2 x 2 x 2 mesh with microbatches of 4 rows: the same two steps as unsharded in
    one batch; the adapters, their moments and the teacher sharded by the rules (the rank
    replicated), the base placed like the params. The gradient-then-update programs
    (train.offload_optimizer_during_grads) give the one-program step's bits."""
    cfg = ema_step_config("hybrid", 2)
    mesh = make_mesh8()
    rules = shd.ShardingRules.from_mapping()

    def run(ts, two=False):
        base = ts.place_base(tiny_params(0))
        state, out = ts.init(None, 0), []
        for i in range(2):
            if two:
                loss, m, g = ts.gradients(state.params, state.teacher, _batch16(i), base)
                state, m = ts.apply_gradients(state, loss, m, g)
            else:
                state, m = ts.step(state, _batch16(i), base)
            out.append({k: float(v) for k, v in m.items()})
        return _np(state), out, state, base

    ref, ref_m, _, _ = run(st.TrainStep(TINY, cfg, lora=LC))
    two, two_m, _, _ = run(st.TrainStep(TINY, cfg, lora=LC), two=True)
    assert two_m == ref_m
    for a, b in zip(jax.tree.leaves(two), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(a, b)
    ts = st.TrainStep(TINY, cfg, lora=LC, mesh=mesh, rules=rules, microbatch_rows=4)
    got, got_m, state, base = run(ts)
    for mg, mr in zip(got_m, ref_m, strict=True):
        for k in mr:
            np.testing.assert_allclose(mg[k], mr[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    axes = lora.adapter_axes(TINY, LC)["layers"]
    for k, ax in axes.items():
        for tree in (state.params, state.teacher, state.opt_state[1][0].mu):
            assert tree["layers"][k].sharding.spec == rules.spec(ax), k
    assert base["layers"]["q"].sharding.spec == rules.spec(("layers", "embed", "heads",
                                                            "head_dim"))
    merged = ts.merged_params(state, base)
    assert merged["layers"]["gate"].sharding.spec == base["layers"]["gate"].sharding.spec


def test_kl_to_the_initial_policy_is_the_forward_without_adapters(tmp_path: Path):
    """Through the loop's bundle (distill/train.py): the initial policy is the base itself (no
    copy, no file), the KL to it at step 0 is 0 and after a step the mean log-ratio of the
    forward with and without the adapters; current_params is merge(base, adapters)."""
    cfg = RunConfig().with_values({
        "lora.enabled": True, "lora.r": 4, "lora.alpha": 8.0, "distill.loss.topk": 8,
        "distill.loss.name": "sdpo",
        "distill.optim.lr": 1e-2, "distill.optim.warmup_steps": 0,
        "distill.teacher.rule": "ema", "train.shared_prefix": "off",
        "train.offload_initial_policy": True, "run_dir": str(tmp_path)})
    params = tiny_params(0)
    model = types.SimpleNamespace(cfg=TINY, params=params, mesh=None, rules=None)
    bundle = train.init_train_state(cfg, model)
    assert bundle.lora == LC and bundle.base is params and bundle.initial_params is params
    lines = train.prepare_offloads(cfg, bundle, model, str(tmp_path / "key"))
    assert "no copy" in " ".join(lines) and not list(tmp_path.iterdir())
    assert model.params is None and bundle.initial_params is bundle.base

    batch = _batch16(0)
    m = batch["response_mask"].astype(np.float64)
    lp = _token_logp(bundle.base, bundle.state.params, batch)
    assert abs(kl.kl_to_initial(cfg, model, bundle, {**batch, "sampler_logp": lp})) < 1e-6
    train.train_step(bundle, batch)
    lp1 = _token_logp(bundle.base, bundle.state.params, batch)
    lp0 = _token_logp(bundle.base, None, batch)
    direct = float(((lp1 - lp0) * m).sum() / m.sum())
    assert abs(direct) > 1e-4, direct  # the adapters moved the policy
    got = kl.kl_to_initial(cfg, model, bundle, {**batch, "sampler_logp": lp1})
    assert got == pytest.approx(direct, rel=1e-4, abs=1e-7)

    merged = train.current_params(cfg, bundle)
    want = lora.merge(bundle.base, bundle.state.params, TINY, LC)
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(want), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert not np.array_equal(merged["layers"]["down"], bundle.base["layers"]["down"])
    np.testing.assert_array_equal(merged["embed"], bundle.base["embed"])  # not a target
    np.testing.assert_allclose(_token_logp(merged, None, batch), lp1, atol=2e-5)

    # a mode that never trains ignores lora: no adapters, no optimizer
    frozen = train.init_train_state(cfg, types.SimpleNamespace(
        cfg=TINY, params=tiny_params(0), mesh=None, rules=None), trains=False)
    assert frozen.lora is None and frozen.base is None and frozen.state.opt_state == {}


def test_state_checkpoint_round_trip_and_bf16_base(tmp_path: Path):
    """The LoRA state (adapters, moments, teacher adapters; no base) round-trips a checkpoint
    onto its own abstract state bitwise; lora.base_dtype='bfloat16' keeps a bf16 base and
    trains on it (the merged params in the compute dtype)."""
    cfg = ema_step_config("sdpo", 2)
    ts = st.TrainStep(TINY, cfg, lora=LC, base_dtype="bfloat16")
    base = ts.place_base(tiny_params(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(base))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), ts.abstract_base()) == jax.tree.map(
        lambda a: (a.shape, a.dtype), base)
    state, m = ts.step(ts.init(None, 0), _batch16(0), base)
    assert np.isfinite(float(m["loss"])) and float(m["loss"]) > 0
    merged = ts.merged_params(state, base)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(merged))
    abstract = ts.abstract_state()
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    ck = Checkpointer(tmp_path / "ck", max_to_keep=1)
    ck.save(1, state)
    ck.wait()
    r = ck.restore(abstract)
    for a, b in zip(jax.tree.leaves(r.state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _shapes(r.state.params) == lora.adapter_shapes(TINY, LC)  # (no base in it)


def test_misuse_fails_before_compute():
    cfg = ema_step_config("sdpo", 2)
    ts = st.TrainStep(TINY, cfg, lora=LC)
    with pytest.raises(ValueError, match="needs the frozen base"):
        ts.step(None, _batch16(0))
    with pytest.raises(ValueError, match="base= is for a LoRA step"):
        st.TrainStep(TINY, cfg).step(None, _batch16(0), base=tiny_params(0))
    with pytest.raises(ValueError, match="trains=True"):
        st.TrainStep(TINY, cfg, lora=LC, trains=False)
    with pytest.raises(TypeError, match="LoraConfig"):
        st.TrainStep(TINY, cfg, lora={"rank": 4})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="base_dtype"):
        st.TrainStep(TINY, cfg, lora=LC, base_dtype="int8")
    with pytest.raises(ValueError, match="no lora"):
        st.TrainStep(TINY, cfg).place_base(tiny_params(0))
