"""The loss registry (pmd_jax.distill.registry): names, what each loss needs, refusals."""

from __future__ import annotations

import pytest

from pmd_jax.distill import accumulate, batch, registry


def test_builtin_losses_and_what_they_need():
    assert registry.loss_names() == ("sdpo", "grpo", "hybrid", "mel")
    sdpo, grpo, hybrid, mel = (registry.get_loss(n) for n in registry.loss_names())
    assert (mel.needs_teacher, mel.needs_rewards, mel.lesson_nll) == (False, True, True)
    assert mel.batch_keys == ("rewards", *registry.LESSON_KEYS)
    assert (sdpo.needs_teacher, sdpo.needs_rewards) == (True, False)
    assert (grpo.needs_teacher, grpo.needs_rewards) == (False, True)
    assert (hybrid.needs_teacher, hybrid.needs_rewards) == (True, True)
    assert not any(s.needs_old_logprobs for s in (sdpo, grpo, hybrid))
    assert grpo.batch_keys == ("rewards",)
    assert set(batch.SEQ_KEYS["teacher"]) <= set(hybrid.batch_keys)
    # the mask that normalises each loss (gradient accumulation weights by it)
    assert [accumulate.loss_mask_kind(n) for n in registry.loss_names()] == [
        "loss_mask", "response", "response", "response"]


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown loss 'ppo'; known losses: \('sdpo'"):
        registry.get_loss("ppo")
    with pytest.raises(ValueError, match="unknown loss"):
        accumulate.metric_kinds("ppo")


def _spec(**kw):
    base = dict(name="test_only_loss", fn=lambda x, opts: (0.0, {}), needs_teacher=False,
                needs_rewards=False, needs_old_logprobs=False, batch_keys=(), doc="",
                metric_kinds={"loss": "response"})
    return registry.LossSpec(**{**base, **kw})


@pytest.mark.parametrize(("kw", "match"), [
    ({"needs_teacher": True}, "needs_teacher=True but batch_keys"),
    ({"batch_keys": ("rewards",)}, "needs_rewards=False"),
    ({"metric_kinds": {"loss": "tokens"}}, "unknown metric kinds"),
    ({"metric_kinds": {"kl": "sum"}}, r"metric_kinds\['loss'\]"),
    ({"name": "sdpo"}, "already registered"),
])
def test_bad_specs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        registry.register_loss(_spec(**kw))
    assert "test_only_loss" not in registry.loss_names()


def test_check_batch_requires_the_loss_keys():
    import numpy as np

    from pmd_jax.distill import align

    db = align.build_distill_batch([[1, 2]], [[1, 2, 3]], [[4, 5]], pad_id=0)
    b = batch.make_batch(db)
    assert batch.check_batch(b, "sdpo")[0] == 1
    with pytest.raises(batch.BatchError, match=r"missing \['rewards'\] \(loss 'grpo'\)"):
        batch.check_batch(b, "grpo")
    b["rewards"] = np.ones(1, np.float32)
    assert batch.check_batch(b, registry.get_loss("hybrid"))[0] == 1
