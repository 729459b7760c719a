"""Which rows of a train batch the SDPO/PMD update needs (ours: ``train.drop_unsignaled_rows``).

Works on the host-side batch dict of :func:`pmd_jax.loop.teaching.build_train_batch` (right padded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pmd_jax.distill.batch import OPTIONAL_RESPONSE_KEYS, RESPONSE_KEYS, SEQ_KEYS
from pmd_jax.distill.registry import get_loss

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig


def round_up(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``."""
    return (n + m - 1) // m * m


def _trim_cols(batch: dict[str, np.ndarray], keys: tuple[str, ...], length: int) -> None:
    for k in keys:
        if k in batch:
            batch[k] = batch[k][:, :length]


def select_rows(batch: dict[str, np.ndarray], rows: np.ndarray,
                pad_to_multiple: int = 16, trim: bool = True) -> dict[str, np.ndarray]:
    """The train batch restricted to ``rows`` (a row may repeat), right padding trimmed
    (``trim=False``: the lengths kept, as ``train.pad_lengths='max'`` fixes them).

    Needs the right-padded layout of :func:`build_train_batch`: each side's tokens are a
    prefix, so the sequence / response axes are cut to the longest kept row (rounded up to
    ``pad_to_multiple``, never below the positions the logit indices point at).
    """

    rows = np.asarray(rows, np.int64)
    out = {k: np.ascontiguousarray(v[rows]) for k, v in batch.items()}
    if not trim:
        return out
    r_len = int(out["response_mask"].sum(axis=1).max(initial=0))
    r_keep = min(out["responses"].shape[1], max(round_up(r_len, pad_to_multiple),
                                                pad_to_multiple))
    _trim_cols(out, RESPONSE_KEYS + OPTIONAL_RESPONSE_KEYS, r_keep)
    for side, keys in SEQ_KEYS.items():
        if keys[0] not in out:
            continue
        used = int(out[f"{side}_attn_mask"].sum(axis=1).max(initial=0))
        used = max(used, int(out[f"{side}_index"].max(initial=0)) + 2)
        _trim_cols(out, keys, min(out[keys[0]].shape[1], round_up(used, pad_to_multiple)))
    return out


def rows_for_update(cfg: RunConfig, batch: dict[str, np.ndarray], row_multiple: int = 1,
                    trim: bool = True) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Drop the rollouts that cannot move a pure self-distillation update (ours).

    With the SDPO loss every sample whose teacher got no signal (``sd_mask == 0``) is out of
    the loss mask, so the loss and its gradient are the same without it (the aggregation is a
    token mean over the loss mask); only metrics that average over all rows (KL, agreement,
    log-prob mismatch) then cover the signal rows alone. The kept rows are padded with
    masked copies up to a bucket size (``row_multiple`` x a power of two, or the full batch)
    so a run compiles a handful of step shapes. A batch without any signal keeps one masked
    row: the optimizer still takes its (zero-gradient) step, exactly as with the full batch.
    Losses with advantages (GRPO, hybrid) use every row, so they get the batch unchanged
    (``LossSpec.drops_unsignaled_rows``).
    """
    b = int(batch["sd_mask"].shape[0])
    if not cfg.train.drop_unsignaled_rows or not get_loss(
            cfg.distill.loss.name).drops_unsignaled_rows:
        return batch, {"train_rows": float(b)}
    sig = np.flatnonzero(batch["sd_mask"] > 0)
    m = max(1, int(row_multiple))
    size = b
    k = m
    while k < b:
        if k >= max(len(sig), 1):
            size = k
            break
        k *= 2
    if size >= b:
        return batch, {"train_rows": float(b)}
    filler = sig[:1] if len(sig) else np.zeros(1, np.int64)
    rows = np.concatenate([sig, np.repeat(filler, size - len(sig))])
    out = select_rows(batch, rows, trim=trim)
    out["sd_mask"] = out["sd_mask"].copy()
    out["sd_mask"][len(sig):] = 0.0
    return out, {"train_rows": float(size)}
