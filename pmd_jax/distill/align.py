"""Student/teacher alignment on the shared response tokens.

The student sequence is ``student_prompt + response`` and the teacher sequence is
``teacher_prompt + response`` (the same response tokens, appended unchanged; METHOD.md 1.5).
Prompts differ in length per sample and between the two sides, and padding may be on either
side. A causal LM's logits at sequence position ``p`` predict the token at ``p + 1``, so the
logits that predict response token ``t`` (0-based) sit at ``start - 1 + t`` where ``start`` is
the sequence index of the first response token (``pad_left + prompt_len``). Only response
positions are compared, position by position.

Pure jnp functions (jit-able):

* :func:`positions_from_mask` - position ids recomputed from the attention mask;
* :func:`response_logit_index` - ``[B, R]`` indices of the logits that predict response token
  ``t``, from a response mask over the padded sequence;
* :func:`gather_response` - gather ``[B, S, ...]`` (hidden states or logits) at those indices,
  giving ``[B, R, ...]`` arrays aligned between student and teacher;
* :func:`response_targets` - the tokens those positions predict (equal on both sides).

Host side (numpy): :func:`build_distill_batch` pads a list of samples into fixed-shape int32
arrays for both sides.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
PadSide = Literal["left", "right"]


# --------------------------------------------------------------------------------------------
# pure functions
# --------------------------------------------------------------------------------------------


def positions_from_mask(attention_mask: Array) -> Array:
    """Position ids ``cumsum(mask) - 1`` over real tokens; padding positions get 0."""
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be [B, S], got {tuple(attention_mask.shape)}")
    m = attention_mask.astype(jnp.int32)
    return jnp.where(m > 0, jnp.cumsum(m, axis=1) - 1, 0).astype(jnp.int32)


def response_logit_index(response_mask: Array, num_response: int) -> tuple[Array, Array]:
    """Indices of the logits that predict each response token.

    ``response_mask``: ``[B, S]``, 1 on the (contiguous) response tokens of the padded
    sequence. Returns ``(index, valid)``, both ``[B, R]`` with ``R = num_response``:
    ``index[b, t] = start_b - 1 + t`` (clipped into ``[0, S - 1]``) and ``valid[b, t] = 1``
    for ``t < response_length_b``. The first response token must be preceded by at least one
    prompt token (``start_b >= 1``), which :func:`build_distill_batch` guarantees.
    """
    if response_mask.ndim != 2:
        raise ValueError(f"response_mask must be [B, S], got {tuple(response_mask.shape)}")
    if isinstance(num_response, bool) or not isinstance(num_response, numbers.Integral):
        raise TypeError(f"num_response must be an int, got {num_response!r}")
    if num_response < 0:
        raise ValueError(f"num_response must be >= 0, got {num_response}")
    seq = response_mask.shape[1]
    m = response_mask.astype(jnp.int32)
    start = jnp.argmax(m, axis=1).astype(jnp.int32)  # first response token (0 if none)
    length = jnp.sum(m, axis=1).astype(jnp.int32)
    t = jnp.arange(num_response, dtype=jnp.int32)[None, :]
    index = jnp.clip(start[:, None] - 1 + t, 0, seq - 1)
    valid = (t < length[:, None]).astype(jnp.int32)
    return index, valid


def gather_response(x: Array, index: Array) -> Array:
    """``x[b, index[b, t], ...]``: ``[B, S, ...]`` gathered to ``[B, R, ...]``."""
    if x.ndim < 2 or index.ndim != 2 or x.shape[0] != index.shape[0]:
        raise ValueError(
            f"gather_response needs x [B, S, ...] and index [B, R] with the same B; "
            f"got {tuple(x.shape)} and {tuple(index.shape)}"
        )
    idx = index.astype(jnp.int32).reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def gather_response_rows(x: Array, row: Array, index: Array) -> Array:
    """``x[row[b], index[b, t], ...]``: ``[G, S, ...]`` gathered to ``[B, R, ...]`` (a side in
    shared-prefix rows, :mod:`pmd_jax.distill.shared_prefix`)."""
    if x.ndim < 2 or index.ndim != 2 or row.shape != index.shape[:1]:
        raise ValueError(
            f"gather_response_rows needs x [G, S, ...], row [B] and index [B, R]; got "
            f"{tuple(x.shape)}, {tuple(row.shape)} and {tuple(index.shape)}")
    g, s = x.shape[:2]
    flat = row.astype(jnp.int32)[:, None] * s + index.astype(jnp.int32)
    return jnp.take(x.reshape((g * s,) + x.shape[2:]), flat, axis=0)


def side_hidden(x: Array, batch: Any, side: str) -> Array:
    """A side's hidden states (or logits) at its response index, from its own rows or from
    shared-prefix rows (``{side}_row`` in ``batch``)."""
    if f"{side}_row" in batch:
        return gather_response_rows(x, batch[f"{side}_row"], batch[f"{side}_index"])
    return gather_response(x, batch[f"{side}_index"])


def response_targets(tokens: Array, index: Array) -> Array:
    """The tokens predicted by the logits at ``index``: ``tokens[b, index[b, t] + 1]``."""
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, S], got {tuple(tokens.shape)}")
    nxt = jnp.clip(index.astype(jnp.int32) + 1, 0, tokens.shape[1] - 1)
    return jnp.take_along_axis(tokens, nxt, axis=1)


# --------------------------------------------------------------------------------------------
# host-side batch builder
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SideBatch:
    """One side (student or teacher) of a distillation batch; all int32."""

    tokens: np.ndarray  # [B, S] prompt + response, padded with pad_id
    positions: np.ndarray  # [B, S] cumsum(attention_mask) - 1, 0 on padding
    attention_mask: np.ndarray  # [B, S] 1 on real tokens
    response_mask: np.ndarray  # [B, S] 1 on response tokens
    logit_index: np.ndarray  # [B, R] position of the logits predicting response token t
    prompt_lengths: np.ndarray  # [B]


@dataclasses.dataclass(frozen=True)
class DistillBatch:
    """Padded student and teacher sequences sharing one response per sample."""

    student: SideBatch
    teacher: SideBatch
    responses: np.ndarray  # int32 [B, R], right-padded with pad_id
    response_mask: np.ndarray  # int32 [B, R], 1 for t < response length
    response_lengths: np.ndarray  # int32 [B]
    pad_side: str


def _as_ids(seq: Sequence[int] | np.ndarray, what: str, i: int) -> np.ndarray:
    a = np.asarray(seq)
    if a.ndim != 1:
        raise ValueError(f"sample {i}: {what} must be a 1-D list of token ids, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"sample {i}: {what} must hold integer token ids, got {a.dtype}")
    if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int32).max):
        raise ValueError(f"sample {i}: {what} has token ids outside [0, 2^31)")
    return a.astype(np.int32)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _build_side(
    prompts: list[np.ndarray],
    responses: list[np.ndarray],
    r_len: int,
    max_len: int | None,
    pad_id: int,
    pad_side: str,
    multiple: int,
    side: str,
) -> SideBatch:
    b = len(prompts)
    totals = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if max_len is not None and totals[i] > max_len:
            raise ValueError(
                f"sample {i}: {side} prompt ({len(p)} tokens) + response ({len(r)} tokens) = "
                f"{totals[i]} tokens overflows {side} max_len={max_len}"
            )
    seq = max_len if max_len is not None else _round_up(max(totals, default=1), multiple)
    seq = max(seq, 1)
    tokens = np.full((b, seq), pad_id, dtype=np.int32)
    attn = np.zeros((b, seq), dtype=np.int32)
    resp = np.zeros((b, seq), dtype=np.int32)
    index = np.zeros((b, r_len), dtype=np.int32)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        off = seq - totals[i] if pad_side == "left" else 0
        n_p, n_r = len(p), len(r)
        tokens[i, off : off + n_p] = p
        tokens[i, off + n_p : off + n_p + n_r] = r
        attn[i, off : off + n_p + n_r] = 1
        resp[i, off + n_p : off + n_p + n_r] = 1
        # logits at off + n_p - 1 + t predict response token t; padding rows repeat the last
        # valid index (never compared, response_mask is 0 there).
        t = np.arange(r_len)
        index[i] = np.minimum(off + n_p - 1 + t, seq - 1)
    positions = np.where(attn > 0, np.cumsum(attn, axis=1) - 1, 0).astype(np.int32)
    return SideBatch(
        tokens=tokens,
        positions=positions,
        attention_mask=attn,
        response_mask=resp,
        logit_index=index,
        prompt_lengths=np.asarray([len(p) for p in prompts], dtype=np.int32),
    )


def build_distill_batch(
    student_prompts: Sequence[Sequence[int]],
    teacher_prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    pad_id: int,
    pad_side: PadSide = "right",
    max_len: int | None = None,
    teacher_max_len: int | None = None,
    max_response_len: int | None = None,
    pad_to_multiple: int = 1,
) -> DistillBatch:
    """Pad student (prompt + response) and teacher (prompt + same response) sequences.

    ``max_len`` / ``teacher_max_len`` fix the student / teacher sequence length (``None``:
    the longest sample, rounded up to ``pad_to_multiple``); ``max_response_len`` fixes ``R``
    the same way. A sample that does not fit raises ``ValueError`` naming the sample, the side
    and the lengths. Every prompt must have at least one token (the logits predicting the
    first response token come from the last prompt position). Empty responses are allowed
    (their response mask is all zero).
    """
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
    if isinstance(pad_id, bool) or not isinstance(pad_id, numbers.Integral) or pad_id < 0:
        raise ValueError(f"pad_id must be a non-negative int, got {pad_id!r}")
    if isinstance(pad_to_multiple, bool) or not isinstance(pad_to_multiple, numbers.Integral):
        raise TypeError(f"pad_to_multiple must be an int, got {pad_to_multiple!r}")
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    for name, v in (
        ("max_len", max_len),
        ("teacher_max_len", teacher_max_len),
        ("max_response_len", max_response_len),
    ):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
            raise ValueError(f"{name} must be a positive int or None, got {v!r}")
    n = len(responses)
    if len(student_prompts) != n or len(teacher_prompts) != n:
        raise ValueError(
            "student_prompts, teacher_prompts and responses must have the same length, got "
            f"{len(student_prompts)}, {len(teacher_prompts)} and {n}"
        )
    if n == 0:
        raise ValueError("empty batch: no samples")
    sp = [_as_ids(p, "student prompt", i) for i, p in enumerate(student_prompts)]
    tp = [_as_ids(p, "teacher prompt", i) for i, p in enumerate(teacher_prompts)]
    rs = [_as_ids(r, "response", i) for i, r in enumerate(responses)]
    for i in range(n):
        if len(sp[i]) == 0:
            raise ValueError(f"sample {i}: empty student prompt (need >= 1 token)")
        if len(tp[i]) == 0:
            raise ValueError(f"sample {i}: empty teacher prompt (need >= 1 token)")
    r_lens = np.asarray([len(r) for r in rs], dtype=np.int32)
    if max_response_len is not None:
        over = np.nonzero(r_lens > max_response_len)[0]
        if over.size:
            i = int(over[0])
            raise ValueError(
                f"sample {i}: response ({r_lens[i]} tokens) overflows "
                f"max_response_len={max_response_len}"
            )
        r_len = int(max_response_len)
    else:
        r_len = max(_round_up(int(r_lens.max()), pad_to_multiple), 1)
    student = _build_side(sp, rs, r_len, max_len, pad_id, pad_side, pad_to_multiple, "student")
    teacher = _build_side(
        tp, rs, r_len, teacher_max_len, pad_id, pad_side, pad_to_multiple, "teacher"
    )
    resp = np.full((n, r_len), pad_id, dtype=np.int32)
    rmask = np.zeros((n, r_len), dtype=np.int32)
    for i, r in enumerate(rs):
        resp[i, : len(r)] = r
        rmask[i, : len(r)] = 1
    return DistillBatch(
        student=student,
        teacher=teacher,
        responses=resp,
        response_mask=rmask,
        response_lengths=r_lens,
        pad_side=pad_side,
    )
