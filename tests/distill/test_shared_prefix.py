"""Shared-prefix rows (train.shared_prefix, pmd_jax/distill/shared_prefix.py): the rollouts of
one prompt in one row give the same train step as one row per rollout (loss, metrics, grad
norm, params, optimizer moments, EMA teacher), unsharded and on an 8-fake-device mesh, with
dense and chunked attention; the layout choice, the sliding-window limit and the errors.

Reference: the per-rollout batch of :func:`pmd_jax.distill.align.build_distill_batch`, which
the other step tests check against direct loss formulas. The batch has groups of rollouts of
one student prompt whose teacher prompts share only a beginning, responses of different
lengths (one empty), a repeated rollout (the masked copies rows_for_update pads with) and
rows without signal.
"""

from __future__ import annotations

# isort: off
from tests.distill.distill_common import (  # first: sets 8 fake devices
    TINY, assert_same_steps, ema_step_config, make_mesh8, start_state, tiny_params)
# isort: on

import jax
import numpy as np
import pytest

from pmd_jax.distill import align
from pmd_jax.distill import batch as dbatch
from pmd_jax.distill import shared_prefix as spx
from pmd_jax.distill import step as st
from pmd_jax.models import decoder
from pmd_jax.models.config import ModelConfig
from pmd_jax.run import sharding as shd

N = 4  # rollouts per prompt
TOL = dict(rtol=2e-5, atol=2e-5)


def _cfg(mode: str):
    return ema_step_config(mode, N)


def _batch(seed: int = 0, problems: int = 4) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    v = TINY.vocab_size
    sp, tp, rs = [], [], []
    for _ in range(problems):
        prompt = r.integers(1, v, r.integers(3, 12))
        common = r.integers(1, v, r.integers(2, 9))  # the teacher prompts' shared beginning
        for _ in range(N):
            sp.append(prompt)
            tp.append(np.concatenate([common, r.integers(1, v, r.integers(0, 6))]))
            rs.append(r.integers(1, v, r.integers(0, 9)))
    rs[1] = rs[1][:0]  # an empty response
    sp[-1], tp[-1], rs[-1] = sp[-2], tp[-2], rs[-2]  # a repeated rollout
    db = align.build_distill_batch(sp, tp, rs, pad_id=0, pad_to_multiple=4)
    b = len(rs)
    sd = (r.random(b) < 0.7).astype(np.float32)
    sd[0] = 1.0
    return dbatch.make_batch(
        db, sd_mask=sd,
        sampler_logp=r.normal(-3.5, 1.0, db.responses.shape).astype(np.float32),
        rewards=r.integers(0, 2, b).astype(np.float32),
    )


_params = tiny_params
_start = start_state


def _run(ts: st.TrainStep, problems: int = 4, steps: int = 2):
    state, out, layouts = _start(ts), [], []
    for i in range(steps):
        batch, layout = ts.pack(_batch(i, problems))
        state, m = ts.step(state, batch)
        out.append(jax.tree.map(np.asarray, m))
        layouts.append(layout)
    return jax.tree.map(np.asarray, state), out, layouts


def _assert_same(got, want):
    assert_same_steps(got[:2], want[:2], TOL)


# grpo and hybrid are slow tests here: the default suite runs sdpo here and hybrid on the mesh
# (test_shared_rows_give_the_per_rollout_step_on_mesh)
@pytest.mark.parametrize("mode", ["sdpo", pytest.param("grpo", marks=pytest.mark.slow),
                                  pytest.param("hybrid", marks=pytest.mark.slow)])
def test_shared_rows_give_the_per_rollout_step(mode):
    ref = st.TrainStep(TINY, _cfg(mode))
    packed = st.TrainStep(TINY, _cfg(mode), shared_prefix="always")
    want, got = _run(ref), _run(packed)
    _assert_same(got, want)
    lay = got[2][0]
    assert lay["student_forward_rows"] == 4 and want[2][0]["student_forward_rows"] == 16
    if mode != "grpo":  # the teacher side too (its prompts share only their beginning)
        assert lay["teacher_forward_rows"] == 4
    else:
        assert "teacher_forward_rows" not in lay
    assert want[1][0]["num_loss_tokens"] > 0 and want[1][0]["grad_norm"] > 0


def test_shared_rows_give_the_per_rollout_step_on_mesh():
    """3 problems on a mesh whose batch axes hold 4: a filler row pads the packed rows."""
    mesh = make_mesh8()
    rules = shd.ShardingRules.from_mapping()
    ref = st.TrainStep(TINY, _cfg("hybrid"), mesh=mesh, rules=rules)
    packed = st.TrainStep(TINY, _cfg("hybrid"), mesh=mesh, rules=rules, shared_prefix="always")
    got = _run(packed, problems=3)
    assert got[2][0]["student_forward_rows"] == 4  # 3 rows + 1 filler
    _assert_same(got, _run(ref, problems=3))


# chunked is slow (~12 s): the default suite runs it on packed segments in
# tests/models/test_attention_chunked.py (test_chunked_packed_segments_equal_separate_sequences)
@pytest.mark.parametrize("impl", ["dense", pytest.param("chunked", marks=pytest.mark.slow)])
def test_forward_on_shared_rows_matches_own_rows(impl):
    """Hidden states at every response position, and their gradient w.r.t. the params, with
    the attention tiled in chunks of 4 slots (so a continuation's tiles meet the prefix's)."""
    cfg = TINY.replace(attention_impl=impl, attention_chunk=4)
    params = _params(3)
    plain = _batch(5)
    packed, _ = spx.share_prefixes(plain, cfg, mode="always", multiple=4)
    mask = plain["response_mask"][..., None].astype(np.float32)

    def hidden(p, b, side):
        seg = b.get(f"{side}_segments")
        h, _ = decoder.forward(p, b[f"{side}_tokens"], b[f"{side}_positions"], cfg,
                               attn_mask=b[f"{side}_attn_mask"], segment_ids=seg,
                               shared_prefix=seg is not None, return_hidden=True)
        return align.side_hidden(h, b, side) * mask

    for side in ("student", "teacher"):
        assert packed[f"{side}_tokens"].shape[0] == 4
        np.testing.assert_allclose(hidden(params, packed, side), hidden(params, plain, side),
                                   rtol=1e-5, atol=1e-5)
        ga = jax.grad(lambda p, s=side: (hidden(p, packed, s) ** 2).sum())(params)
        gb = jax.grad(lambda p, s=side: (hidden(p, plain, s) ** 2).sum())(params)
        # Against each array's scale: the same packed rows padded to 4 or to 32 slots already
        # differ by up to 4e-5 of it in the embedding's gradient (float32 rounding of the
        # differently shaped products, summed over many positions).
        for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * float(np.abs(b).max()))


def test_kl_to_initial_on_shared_rows():
    """distill.kl's forward of the initial policy: the same KL from shared-prefix rows."""
    import types

    from pmd_jax.distill import kl

    plain = _batch(2)
    plain["sampler_logp"] = plain["sampler_logp"] * 0.2 - 3.0
    got = {}
    for mode in ("off", "always"):
        run_cfg = types.SimpleNamespace(
            distill=types.SimpleNamespace(loss=types.SimpleNamespace(temperature=0.7)),
            train=types.SimpleNamespace(shared_prefix=mode, offload_optimizer_during_kl=False,
                                        microbatch_rows=0))
        got[mode] = kl.kl_to_initial(run_cfg, types.SimpleNamespace(cfg=TINY),
                                     types.SimpleNamespace(initial_params=_params(4)), plain)
    assert abs(got["off"]) > 0.1
    assert got["always"] == pytest.approx(got["off"], rel=1e-5)


def test_packed_layout_by_hand():
    """Two rollouts of prompt [5, 6, 7]: responses [8, 9] and [10]."""
    db = align.build_distill_batch([[5, 6, 7]] * 2, [[5, 6, 7]] * 2, [[8, 9], [10]], pad_id=0)
    b, _ = spx.share_prefixes(dbatch.make_batch(db), TINY, mode="always", multiple=1)
    np.testing.assert_array_equal(b["student_tokens"], [[5, 6, 7, 8, 9, 10]])
    np.testing.assert_array_equal(b["student_positions"], [[0, 1, 2, 3, 4, 3]])
    np.testing.assert_array_equal(b["student_segments"], [[0, 0, 0, 1, 1, 2]])
    np.testing.assert_array_equal(b["student_row"], [0, 0])
    # response 0: logits at slots 2 (prompt end) and 3; response 1: slot 2 (the padding
    # entry past its length repeats its last token's slot)
    np.testing.assert_array_equal(b["student_index"], [[2, 3], [2, 5]])


def test_auto_packs_only_where_it_is_cheaper():
    smol = ModelConfig(family="llama", vocab_size=49152, hidden_size=576,
                       intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                       head_dim=64, tie_embeddings=True)

    def batch(prompt_len, resp_len):
        r = np.random.default_rng(0)
        sp = [r.integers(1, 100, prompt_len)] * N
        rs = [r.integers(1, 100, resp_len) for _ in range(N)]
        return dbatch.make_batch(align.build_distill_batch(sp, sp, rs, pad_id=0,
                                                           pad_to_multiple=16))

    _, lay = spx.share_prefixes(batch(200, 12), smol, mode="auto")  # SciQ-like
    assert lay["student_forward_rows"] == 1 and lay["student_forward_slots"] == 256
    _, lay = spx.share_prefixes(batch(20, 4000), smol, mode="auto")  # long responses
    assert lay["student_forward_rows"] == N
    _, lay = spx.share_prefixes(batch(20, 4000), smol, mode="always")
    assert lay["student_forward_rows"] == 1
    _, lay = spx.share_prefixes(batch(200, 12), smol, mode="off")
    assert lay["student_forward_rows"] == N


def test_rows_longer_than_a_sliding_window_stay_per_rollout():
    slide = TINY.replace(sliding_window=8, layer_types=("sliding_attention", "full_attention"))
    plain = _batch(1)
    b, lay = spx.share_prefixes(plain, slide, mode="always", multiple=4)
    assert lay["student_forward_rows"] == 16 and "student_row" not in b
    seg = np.zeros((1, 12), np.int32)
    with pytest.raises(ValueError, match=r"12 slots; layers \[0\] have window 8"):
        decoder.forward(_params(0), np.ones((1, 12), np.int32),
                        np.arange(12, dtype=np.int32)[None], slide, segment_ids=seg,
                        shared_prefix=True)
    wide = TINY.replace(sliding_window=64, layer_types=("sliding_attention", "full_attention"))
    assert spx.share_prefixes(plain, wide, mode="always")[1]["student_forward_rows"] == 4


def test_malformed_packed_batches_are_named():
    b, _ = spx.share_prefixes(_batch(0), TINY, mode="always")
    bad = dict(b, student_row=b["student_row"][:3])
    with pytest.raises(dbatch.BatchError, match=r"student_row must be \[B\]=\(16,\)"):
        dbatch.check_batch(bad, "sdpo")
    bad = {k: v for k, v in b.items() if k != "teacher_segments"}
    with pytest.raises(dbatch.BatchError, match="teacher_segments has shape missing"):
        dbatch.check_batch(bad, "sdpo")
    left = align.build_distill_batch([[1, 2]], [[1, 2]], [[3]], pad_id=0, pad_side="left",
                                     max_len=5, teacher_max_len=5)
    with pytest.raises(ValueError, match="right-padded per-rollout layout"):
        spx.share_prefixes(dbatch.make_batch(left), TINY, mode="always")


def test_config_names_a_bad_mode():
    from pmd_jax.config import base_config, batch_plan_errors

    c = base_config()
    assert c.train.shared_prefix == "auto" and batch_plan_errors(c) == []
    c.train.shared_prefix = "on"
    assert batch_plan_errors(c) == [
        "train.shared_prefix must be 'auto', 'always' or 'off', got 'on'"]
    c.train.shared_prefix, c.train.microbatch_rows = "always", 32
    assert "cannot be combined with train.microbatch_rows=32" in batch_plan_errors(c)[0]
    with pytest.raises(ValueError, match="cannot be combined with microbatch_rows"):
        st.TrainStep(TINY, _cfg("sdpo"), microbatch_rows=4, shared_prefix="always")
    assert st.TrainStep(TINY, _cfg("sdpo"), microbatch_rows=4).shared_prefix == "off"
