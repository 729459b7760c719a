"""Student/teacher alignment on hand-built batches whose answers are written out by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pmd_jax.distill import align

PAD = 0
# two samples; prompts differ in length per sample and between the sides
STUDENT = [[1, 2, 3], [4]]
TEACHER = [[10, 11], [12, 13, 14, 15]]
RESP = [[7, 8], [9, 5, 6]]


def test_right_padding_hand_built():
    db = align.build_distill_batch(STUDENT, TEACHER, RESP, pad_id=PAD, pad_side="right")
    s, t = db.student, db.teacher
    np.testing.assert_array_equal(s.tokens, [[1, 2, 3, 7, 8], [4, 9, 5, 6, 0]])
    np.testing.assert_array_equal(s.attention_mask, [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(s.response_mask, [[0, 0, 0, 1, 1], [0, 1, 1, 1, 0]])
    np.testing.assert_array_equal(s.positions, [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0]])
    # logits at prompt_len - 1 + t predict response token t (R = 3; t=2 of row 0 is padding)
    np.testing.assert_array_equal(s.logit_index[:, :2], [[2, 3], [0, 1]])
    np.testing.assert_array_equal(s.logit_index[1], [0, 1, 2])
    np.testing.assert_array_equal(t.tokens, [[10, 11, 7, 8, 0, 0, 0], [12, 13, 14, 15, 9, 5, 6]])
    np.testing.assert_array_equal(t.positions, [[0, 1, 2, 3, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(t.logit_index[0, :2], [1, 2])
    np.testing.assert_array_equal(t.logit_index[1], [3, 4, 5])
    np.testing.assert_array_equal(db.responses, [[7, 8, 0], [9, 5, 6]])
    np.testing.assert_array_equal(db.response_mask, [[1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(db.response_lengths, [2, 3])
    np.testing.assert_array_equal(s.prompt_lengths, [3, 1])
    np.testing.assert_array_equal(t.prompt_lengths, [2, 4])
    for a in (s.tokens, s.positions, s.attention_mask, t.logit_index, db.responses):
        assert a.dtype == np.int32


def test_left_padding_hand_built():
    db = align.build_distill_batch(STUDENT, TEACHER, RESP, pad_id=PAD, pad_side="left")
    s, t = db.student, db.teacher
    np.testing.assert_array_equal(s.tokens, [[1, 2, 3, 7, 8], [0, 4, 9, 5, 6]])
    np.testing.assert_array_equal(s.attention_mask, [[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    np.testing.assert_array_equal(s.positions, [[0, 1, 2, 3, 4], [0, 0, 1, 2, 3]])
    np.testing.assert_array_equal(s.logit_index[0, :2], [2, 3])
    np.testing.assert_array_equal(s.logit_index[1], [1, 2, 3])
    np.testing.assert_array_equal(t.tokens, [[0, 0, 0, 10, 11, 7, 8], [12, 13, 14, 15, 9, 5, 6]])
    np.testing.assert_array_equal(t.positions, [[0, 0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(t.logit_index[0, :2], [4, 5])
    np.testing.assert_array_equal(t.logit_index[1], [3, 4, 5])
    np.testing.assert_array_equal(db.responses, [[7, 8, 0], [9, 5, 6]])


@pytest.mark.parametrize("side", ["left", "right"])
def test_pure_functions_agree_with_builder(side):
    rng = np.random.default_rng(0)
    b = 6
    sp = [rng.integers(1, 50, size=rng.integers(1, 9)).tolist() for _ in range(b)]
    tp = [rng.integers(1, 50, size=rng.integers(1, 15)).tolist() for _ in range(b)]
    rs = [rng.integers(1, 50, size=rng.integers(0, 7)).tolist() for _ in range(b)]
    db = align.build_distill_batch(sp, tp, rs, pad_id=PAD, pad_side=side, pad_to_multiple=4)
    r = db.responses.shape[1]
    assert r % 4 == 0 and db.student.tokens.shape[1] % 4 == 0
    valid = db.response_mask.astype(bool)
    for sb in (db.student, db.teacher):
        idx, ok = jax.jit(align.response_logit_index, static_argnums=1)(
            jnp.asarray(sb.response_mask), r
        )
        np.testing.assert_array_equal(np.asarray(ok), db.response_mask)
        np.testing.assert_array_equal(np.asarray(idx)[valid], sb.logit_index[valid])
        np.testing.assert_array_equal(
            np.asarray(align.positions_from_mask(jnp.asarray(sb.attention_mask))), sb.positions
        )
        # the logits gathered at logit_index predict exactly the response tokens
        tgt = np.asarray(
            align.response_targets(jnp.asarray(sb.tokens), jnp.asarray(sb.logit_index))
        )
        np.testing.assert_array_equal(tgt[valid], db.responses[valid])


@pytest.mark.parametrize("side", ["left", "right"])
def test_gathered_positions_compare_the_same_response_prefix(side):
    """A toy causal LM whose logits depend only on the current token (a bigram table).

    For t >= 1 the logits predicting response token t come from response token t-1 on both
    sides, so student and teacher gathers must be identical there; for t = 0 they come from
    the last prompt token of each side.
    """
    db = align.build_distill_batch(STUDENT, TEACHER, RESP, pad_id=PAD, pad_side=side)
    table = jnp.asarray(np.random.default_rng(1).normal(size=(20, 6)), jnp.float32)
    s_logits = table[jnp.asarray(db.student.tokens)]  # [B, S, V]
    t_logits = table[jnp.asarray(db.teacher.tokens)]
    s_g = np.asarray(align.gather_response(s_logits, jnp.asarray(db.student.logit_index)))
    t_g = np.asarray(align.gather_response(t_logits, jnp.asarray(db.teacher.logit_index)))
    assert s_g.shape == t_g.shape == (2, 3, 6)
    tab = np.asarray(table)
    for i in range(2):
        n = len(RESP[i])
        np.testing.assert_array_equal(s_g[i, 1:n], t_g[i, 1:n])
        np.testing.assert_array_equal(s_g[i, 1:n], tab[RESP[i][: n - 1]])
        np.testing.assert_array_equal(s_g[i, 0], tab[STUDENT[i][-1]])
        np.testing.assert_array_equal(t_g[i, 0], tab[TEACHER[i][-1]])


def test_fixed_lengths_and_empty_response():
    db = align.build_distill_batch(
        [[1, 2]], [[3, 4, 5]], [[]], pad_id=9, max_len=6, teacher_max_len=8, max_response_len=4
    )
    assert db.student.tokens.shape == (1, 6) and db.teacher.tokens.shape == (1, 8)
    assert db.responses.shape == (1, 4)
    np.testing.assert_array_equal(db.response_mask, [[0, 0, 0, 0]])
    np.testing.assert_array_equal(db.responses, [[9, 9, 9, 9]])
    np.testing.assert_array_equal(db.student.tokens, [[1, 2, 9, 9, 9, 9]])
    idx, ok = align.response_logit_index(jnp.asarray(db.student.response_mask), 4)
    assert not np.asarray(ok).any()
    assert (np.asarray(idx) >= 0).all()


def test_overflow_and_bad_input_errors():
    with pytest.raises(ValueError, match=r"sample 0: student prompt \(3 tokens\).*max_len=4"):
        align.build_distill_batch(STUDENT, TEACHER, RESP, pad_id=0, max_len=4)
    with pytest.raises(ValueError, match=r"sample 1: teacher .*overflows teacher max_len=6"):
        align.build_distill_batch(STUDENT, TEACHER, RESP, pad_id=0, teacher_max_len=6)
    with pytest.raises(ValueError, match=r"sample 1: response \(3 tokens\).*max_response_len=2"):
        align.build_distill_batch(STUDENT, TEACHER, RESP, pad_id=0, max_response_len=2)
    with pytest.raises(ValueError, match="same length"):
        align.build_distill_batch(STUDENT, TEACHER[:1], RESP, pad_id=0)
    with pytest.raises(ValueError, match="sample 1: empty teacher prompt"):
        align.build_distill_batch(STUDENT, [[1], []], RESP, pad_id=0)
    with pytest.raises(ValueError, match="pad_side"):
        align.build_distill_batch(STUDENT, TEACHER, RESP, pad_id=0, pad_side="middle")
    with pytest.raises(ValueError, match="outside"):
        align.build_distill_batch([[1, -2]], [[1]], [[3]], pad_id=0)
    with pytest.raises(TypeError, match="integer token ids"):
        align.build_distill_batch([[1.5]], [[1]], [[3]], pad_id=0)
    with pytest.raises(ValueError, match="empty batch"):
        align.build_distill_batch([], [], [], pad_id=0)
    with pytest.raises(ValueError, match="same B"):
        align.gather_response(jnp.zeros((2, 5, 3)), jnp.zeros((3, 2), jnp.int32))
