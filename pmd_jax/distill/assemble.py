"""The one road from a step's rows to the arrays the train step takes.

``teaching.train_rows`` decides what each rollout's update sees (:class:`TrainRows`: the
student's prompt, the teacher's prompt, the response, the sampler's log-probs, the teacher
signal, the reward); :func:`assemble` aligns them into the right-padded host batch
(``align.build_distill_batch`` + ``batch.make_batch``) with the mode's extra arrays (mel's
lesson rows); :func:`update_batch` is what the trainer calls once per step: the batch, then
the rows the update keeps (``update_rows.rows_for_update``: the rows without a teacher signal
left out where the loss allows, padded to the mesh's batch axes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from pmd_jax.distill import align
from pmd_jax.distill.batch import make_batch
from pmd_jax.distill.update_rows import round_up, rows_for_update

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig


@dataclasses.dataclass(frozen=True)
class TrainRows:
    """One step's rollouts as update rows, in rollout order (prompt-major): token ids of each
    side's prompt and of the response, the sampler's log-probs of the response tokens, the
    teacher signal (``sd_mask``, 0/1) and the rewards."""

    students: Sequence[Sequence[int]]
    teachers: Sequence[Sequence[int]]
    responses: Sequence[Sequence[int]]
    sampler_logp: Sequence[np.ndarray]
    sd_mask: np.ndarray  # [N] float32
    rewards: np.ndarray  # [N] float32


PAD_MULTIPLE = 16  # the sequence and response axes are right padded to multiples of this


def fixed_lengths(cfg: RunConfig) -> tuple[int, int, int] | None:
    """(student, teacher, response) lengths of every step's rows under
    ``train.pad_lengths='max'`` (the configured maxima rounded up to 16: the dry run's worst
    case), or None under 'multiple' (each step's own longest rows)."""
    if str(cfg.train.pad_lengths) != "max":
        return None
    r = round_up(int(cfg.rollout.max_tokens), PAD_MULTIPLE)
    return (round_up(int(cfg.rollout.max_prompt_tokens), PAD_MULTIPLE) + r,
            round_up(int(cfg.teacher_prompt.max_tokens), PAD_MULTIPLE) + r, r)


def assemble(rows: TrainRows, pad_id: int, extra: Mapping[str, np.ndarray] | None = None,
             lengths: tuple[int, int, int] | None = None) -> dict[str, np.ndarray]:
    """The host-side train batch (``batch.make_batch``'s keys, right padded to multiples of
    16, or to ``lengths`` = (student, teacher, response): :func:`fixed_lengths`) plus
    ``extra`` arrays (rows of their own, e.g. mel's lessons)."""
    r_max = max(1, max(len(x) for x in rows.responses))
    s_len, t_len, r_len = lengths or (None, None, round_up(r_max, PAD_MULTIPLE))
    try:
        db = align.build_distill_batch(
            rows.students, rows.teachers, rows.responses, pad_id=pad_id, pad_side="right",
            pad_to_multiple=PAD_MULTIPLE, max_response_len=r_len, max_len=s_len,
            teacher_max_len=t_len)
    except ValueError as e:
        if lengths is None:
            raise
        raise ValueError(f"train.pad_lengths='max': a row is longer than the configured "
                         f"maxima (student, teacher, response) = {lengths}: {e}") from e
    rl = db.responses.shape[1]
    logp = np.zeros((len(rows.responses), rl), np.float32)
    for k, lp in enumerate(rows.sampler_logp):
        logp[k, : len(lp)] = lp
    # One update per rollout batch (METHOD 1.3): the old policy is the current one, so no
    # old_logp (the step takes logp.detach(), ratio 1); the sampler/trainer gap is corrected
    # by the truncated rollout IS weights from sampler_logp alone (passing the sampler's
    # log-probs as old_logp too would apply that ratio twice).
    batch = make_batch(db, sd_mask=rows.sd_mask, sampler_logp=logp, rewards=rows.rewards)
    batch.update(extra or {})
    return batch


@dataclasses.dataclass(frozen=True)
class StepArrays:
    """A step's arrays: ``full`` every rollout's row (what the KL to the initial policy
    reads), ``update`` the rows the update trains on (``full`` itself when it keeps them all),
    ``stats`` the row metrics."""

    full: dict[str, np.ndarray]
    update: dict[str, np.ndarray]
    stats: dict[str, float]


def update_batch(cfg: RunConfig, rows: TrainRows, pad_id: int,
                 extra: Mapping[str, np.ndarray] | None = None,
                 row_multiple: int = 1) -> StepArrays:
    """The step's arrays: :func:`assemble`, then the rows the update keeps
    (``rows_for_update``: ``train.drop_unsignaled_rows``; ``row_multiple``: the mesh's batch
    axes, which every row count must divide)."""
    lengths = fixed_lengths(cfg)
    batch = assemble(rows, pad_id, extra, lengths)
    update, stats = rows_for_update(cfg, batch, row_multiple, trim=lengths is None)
    if update is not batch:  # the update sees the signal rows only
        stats["masked_sample_fraction"] = float(1.0 - batch["sd_mask"].mean())
    return StepArrays(batch, update, stats)
