"""The one road from update rows to the step's arrays (``distill/assemble.py``): the batch is
``align.build_distill_batch`` + ``make_batch`` of the rows (each side's tokens, the response,
the sampler's log-probs in place, the rewards), the mode's extra arrays ride along, and the
update keeps what ``rows_for_update`` keeps, with its row metrics."""

from __future__ import annotations

import numpy as np

from pmd_jax.config import base_config
from pmd_jax.distill import align, assemble
from pmd_jax.distill.batch import make_batch
from pmd_jax.distill.update_rows import rows_for_update


def _rows(sd):
    r = np.random.default_rng(3)
    n = len(sd)
    students = [r.integers(1, 50, int(r.integers(3, 9))).tolist() for _ in range(n)]
    teachers = [r.integers(1, 50, int(r.integers(5, 20))).tolist() for _ in range(n)]
    responses = [r.integers(1, 50, int(r.integers(1, 7))).tolist() for _ in range(n)]
    logp = [r.normal(-2, 0.5, len(x)).astype(np.float32) for x in responses]
    return assemble.TrainRows(students, teachers, responses, logp,
                              np.asarray(sd, np.float32), r.random(n).astype(np.float32))


def _cfg(mode: str, loss: str = ""):
    c = base_config()
    c.mode, c.distill.loss.name = mode, loss or ("grpo" if mode == "grpo" else "sdpo")
    return c


def test_assemble_is_the_aligned_batch_of_the_rows():
    rows = _rows([1, 0, 1, 0])
    got = assemble.assemble(rows, pad_id=0, extra={"lesson_tokens": np.ones((2, 3), np.int32)})
    db = align.build_distill_batch(rows.students, rows.teachers, rows.responses, pad_id=0,
                                   pad_side="right", pad_to_multiple=16, max_response_len=16)
    logp = np.zeros(db.responses.shape, np.float32)
    for k, lp in enumerate(rows.sampler_logp):
        logp[k, : len(lp)] = lp
    want = make_batch(db, sd_mask=rows.sd_mask, sampler_logp=logp, rewards=rows.rewards)
    assert set(got) == set(want) | {"lesson_tokens"}
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    np.testing.assert_array_equal(got["sampler_logp"][0, : len(rows.sampler_logp[0])],
                                  rows.sampler_logp[0])


def test_update_keeps_what_rows_for_update_keeps():
    rows = _rows([1, 0, 0, 0, 1, 0, 0, 0])
    sdpo = assemble.update_batch(_cfg("sdpo"), rows, pad_id=0, row_multiple=2)
    want, stats = rows_for_update(_cfg("sdpo"), assemble.assemble(rows, 0), 2)
    assert sdpo.update["sd_mask"].shape[0] == 2 < sdpo.full["sd_mask"].shape[0] == 8
    for k, v in want.items():
        np.testing.assert_array_equal(sdpo.update[k], v, err_msg=k)
    assert sdpo.stats == {**stats, "masked_sample_fraction": 0.75}
    grpo = assemble.update_batch(_cfg("grpo"), rows, pad_id=0, row_multiple=2)
    assert grpo.update is grpo.full and grpo.stats == {"train_rows": 8.0}
