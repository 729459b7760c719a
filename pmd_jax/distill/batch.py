"""The train step's batch: its arrays, :func:`make_batch` and :func:`check_batch`.

Batch (a dict of arrays; ``B`` samples, ``Ts``/``Tt`` student/teacher sequence lengths, ``R``
response slots), built on the host by :func:`make_batch` from an
:class:`pmd_jax.distill.align.DistillBatch`:

=====================  ==========  ==========================================================
``student_tokens``     [B, Ts]     student prompt + response, padded
``student_positions``  [B, Ts]     position ids
``student_attn_mask``  [B, Ts]     1 on real tokens
``student_index``      [B, R]      position of the student logits predicting response token t
``teacher_tokens``     [B, Tt]     teacher prompt + the same response, padded
``teacher_positions``  [B, Tt]
``teacher_attn_mask``  [B, Tt]
``teacher_index``      [B, R]
``responses``          [B, R]      the response tokens (targets)
``response_mask``      [B, R]      1 for t < response length
``sd_mask``            [B]         self-distillation mask (1 iff the sample was reprompted)
``sampler_logp``       [B, R]      optional: the sampler's log-probs of the response tokens
``old_logp``           [B, R]      optional: old-policy log-probs (off-policy ratio); absent
                                   means on-policy (ratio 1, verl's old := stopgrad(logp))
``rewards``            [B]         grpo / hybrid: rewards, prompt-major groups of group_size
``lesson_tokens``      [L, Tl]     mel: problem prompt + kept lesson (:func:`make_lesson_rows`)
``lesson_positions``   [L, Tl]
``lesson_attn_mask``   [L, Tl]
``lesson_index``       [L, Rl]     position of the logits predicting lesson token t
``lesson_targets``     [L, Rl]     the lesson tokens
``lesson_mask``        [L, Rl]     1 on real lesson tokens (all 0 on filler rows)
=====================  ==========  ==========================================================

A side in shared-prefix rows (:mod:`pmd_jax.distill.shared_prefix`) has ``G`` rows instead of
``B``, plus ``{side}_segments`` [G, Ts] and ``{side}_row`` [B] (the row of each rollout; its
``{side}_index`` then points into that row).

Every loss reads :data:`BASE_KEYS`; a loss's own arrays (teacher sequence, ``rewards``) are
its ``batch_keys`` in :mod:`pmd_jax.distill.registry`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from pmd_jax.distill import align
from pmd_jax.distill import registry as reg

SEQ_KEYS = {
    "student": ("student_tokens", "student_positions", "student_attn_mask"),
    "teacher": reg.TEACHER_KEYS,
}
RESPONSE_KEYS = ("student_index", "teacher_index", "responses", "response_mask")
OPTIONAL_RESPONSE_KEYS = ("sampler_logp", "old_logp")
SAMPLE_KEYS = ("sd_mask", "rewards")
# what every loss reads: the student forward, the response maps, the self-distillation mask
BASE_KEYS = (*SEQ_KEYS["student"], *RESPONSE_KEYS, "sd_mask")
# a side in shared-prefix rows (pmd_jax.distill.shared_prefix)
PACKED_KEYS = tuple(f"{side}_{k}" for side in SEQ_KEYS for k in ("segments", "row"))


class BatchError(ValueError):
    """A train batch is malformed; the message names the array and the shapes."""


def make_batch(
    db: align.DistillBatch,
    *,
    sd_mask: Any | None = None,
    sampler_logp: Any | None = None,
    old_logp: Any | None = None,
    rewards: Any | None = None,
) -> dict[str, np.ndarray]:
    """The step's batch dict from an aligned :class:`~pmd_jax.distill.align.DistillBatch`.

    ``sampler_logp`` / ``old_logp``: ``[B, R]`` per response token (right-padded like
    ``db.responses``); ``sd_mask`` / ``rewards``: ``[B]``. ``sd_mask=None`` means all ones.
    """
    b, r = db.responses.shape
    out: dict[str, np.ndarray] = {
        "student_tokens": db.student.tokens,
        "student_positions": db.student.positions,
        "student_attn_mask": db.student.attention_mask,
        "student_index": db.student.logit_index,
        "teacher_tokens": db.teacher.tokens,
        "teacher_positions": db.teacher.positions,
        "teacher_attn_mask": db.teacher.attention_mask,
        "teacher_index": db.teacher.logit_index,
        "responses": db.responses,
        "response_mask": db.response_mask,
        "sd_mask": np.ones((b,), np.float32) if sd_mask is None
        else np.asarray(sd_mask, np.float32),
    }
    for name, val in (("sampler_logp", sampler_logp), ("old_logp", old_logp)):
        if val is not None:
            a = np.asarray(val, np.float32)
            if a.shape != (b, r):
                raise BatchError(f"{name} must be [B, R]={(b, r)}, got shape {a.shape}")
            out[name] = a
    if rewards is not None:
        out["rewards"] = np.asarray(rewards, np.float32)
    return out


def check_batch(batch: Mapping[str, Any], loss: str | reg.LossSpec) -> tuple[int, int, int, int]:
    """Check keys and shapes for ``loss`` (a registered name or its spec) before any compute;
    returns ``(B, Ts, Tt, R)``."""
    spec = reg.get_loss(loss) if isinstance(loss, str) else loss
    need = [*BASE_KEYS, *spec.required_keys()]
    missing = [k for k in need if k not in batch]
    if missing:
        raise BatchError(f"batch is missing {missing} (loss {spec.name!r})")
    known = (set(need) | set(SEQ_KEYS["teacher"]) | set(OPTIONAL_RESPONSE_KEYS) | {"rewards"}
             | set(PACKED_KEYS))
    unknown = sorted(set(batch) - known)
    if unknown:
        raise BatchError(f"batch has unknown arrays {unknown}")

    def shape(k: str) -> tuple[int, ...]:
        x = batch[k]
        return tuple(x.shape) if hasattr(x, "shape") else tuple(np.shape(x))

    r_shape = shape("responses")
    if len(r_shape) != 2:
        raise BatchError(f"responses must be [B, R], got shape {r_shape}")
    b = r_shape[0]

    def side_len(side: str) -> int:
        x_shape = shape(f"{side}_tokens")
        packed = f"{side}_row" in batch
        if len(x_shape) != 2:
            raise BatchError(f"{side}_tokens must be [{'G' if packed else 'B'}, T], got shape "
                             f"{x_shape}")
        if not packed and x_shape[0] != b:
            raise BatchError(f"student and teacher batches differ in batch size: {side}_tokens "
                             f"{x_shape}, responses {r_shape}")
        for k in (*SEQ_KEYS[side], *((f"{side}_segments",) if packed else ())):
            if k not in batch or shape(k) != x_shape:
                raise BatchError(f"{k} has shape {shape(k) if k in batch else 'missing'}, "
                                 f"{side}_tokens has {x_shape}")
        if packed and shape(f"{side}_row") != (b,):
            raise BatchError(f"{side}_row must be [B]={(b,)}, got shape {shape(f'{side}_row')}")
        return x_shape[1]

    ts = side_len("student")
    tt = side_len("teacher") if "teacher_tokens" in batch else 0
    r = r_shape[1]
    for k in (*RESPONSE_KEYS, *OPTIONAL_RESPONSE_KEYS):
        if k in batch and shape(k) != r_shape:
            raise BatchError(
                f"{k} has shape {shape(k)} but responses has {r_shape} (student and teacher "
                "response index maps must both be [B, R])"
            )
    for k in SAMPLE_KEYS:
        if k in batch and shape(k) != (b,):
            raise BatchError(f"{k} must be [B]={(b,)}, got shape {shape(k)}")
    if ts < 2 or (spec.needs_teacher and tt < 2):
        raise BatchError(f"sequences too short: student {ts}, teacher {tt} (need >= 2)")
    if spec.lesson_nll:
        _check_lesson_rows(shape)
    for k in ("student_tokens", "teacher_tokens", "responses", "student_index", "teacher_index",
              "lesson_tokens", "lesson_index", "lesson_targets", *PACKED_KEYS):
        if k in batch:
            dt = getattr(batch[k], "dtype", None) or np.asarray(batch[k]).dtype
            if not jnp.issubdtype(dt, jnp.integer):
                raise BatchError(f"{k} must be an integer array, got {dt}")
    return b, ts, tt, r


def _check_lesson_rows(shape: Any) -> None:
    """The lesson rows (mode=mel): ``[L, Tl]`` sequence arrays and ``[L, Rl]`` lesson maps,
    ``L`` independent of the rollout batch."""
    l_shape = shape("lesson_tokens")
    if len(l_shape) != 2 or l_shape[0] < 1 or l_shape[1] < 2:
        raise BatchError(f"lesson_tokens must be [L >= 1, Tl >= 2], got shape {l_shape}")
    for k in reg.LESSON_KEYS[1:3]:
        if shape(k) != l_shape:
            raise BatchError(f"{k} has shape {shape(k)}, lesson_tokens has {l_shape}")
    m_shape = shape("lesson_targets")
    if len(m_shape) != 2 or m_shape[0] != l_shape[0]:
        raise BatchError(f"lesson_targets must be [L={l_shape[0]}, Rl], got shape {m_shape}")
    for k in ("lesson_index", "lesson_mask"):
        if shape(k) != m_shape:
            raise BatchError(f"{k} has shape {shape(k)}, lesson_targets has {m_shape}")


def make_lesson_rows(prompts: Sequence[Sequence[int]], lessons: Sequence[Sequence[int]], *,
                     pad_id: int, rows: int, pad_to_multiple: int = 16) -> dict[str, np.ndarray]:
    """The lesson arrays (:data:`pmd_jax.distill.registry.LESSON_KEYS`) of ``mode=mel``:
    row ``i`` is ``prompts[i] + lessons[i]`` laid out exactly as a student row (right padded,
    :func:`pmd_jax.distill.align.build_distill_batch`), the lesson in the response slots.

    ``rows`` (>= ``len(lessons)``) fixes ``L``: the rows past the lessons are filler (one
    attended pad token, ``lesson_mask`` 0), so a step without kept lessons still has the
    arrays (NLL 0, no NaN: every row attends to at least one token).
    """
    n = len(lessons)
    if len(prompts) != n:
        raise BatchError(f"{len(prompts)} lesson prompts for {n} lessons")
    if rows < max(n, 1):
        raise BatchError(f"rows={rows} cannot hold {n} lessons (need >= max(n, 1))")
    if n:
        db = align.build_distill_batch(prompts, prompts, lessons, pad_id=pad_id,
                                       pad_side="right", pad_to_multiple=pad_to_multiple)
        tl, rl = db.student.tokens.shape[1], db.responses.shape[1]
    else:
        tl = rl = pad_to_multiple if pad_to_multiple >= 2 else 2
    out = {
        "lesson_tokens": np.full((rows, tl), pad_id, np.int32),
        "lesson_positions": np.tile(np.arange(tl, dtype=np.int32), (rows, 1)),
        "lesson_attn_mask": np.zeros((rows, tl), np.int32),
        "lesson_index": np.zeros((rows, rl), np.int32),
        "lesson_targets": np.full((rows, rl), pad_id, np.int32),
        "lesson_mask": np.zeros((rows, rl), np.float32),
    }
    out["lesson_attn_mask"][:, 0] = 1  # filler rows: one attended token, never NaN
    if n:
        out["lesson_tokens"][:n] = db.student.tokens
        out["lesson_positions"][:n] = db.student.positions
        out["lesson_attn_mask"][:n] = db.student.attention_mask
        out["lesson_index"][:n] = db.student.logit_index
        out["lesson_targets"][:n] = db.responses
        out["lesson_mask"][:n] = db.response_mask
    return out
