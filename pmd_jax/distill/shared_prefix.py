"""Shared-prefix rows (ours: ``train.shared_prefix``): the rollouts of one prompt in one row of
the train step's forward, the prompt once.

The per-rollout batch (:func:`pmd_jax.distill.batch.make_batch`, right padded) has one row
per rollout, so a step of P prompts x n rollouts runs each prompt through the student's
forward and backward n times: with SciQ's support passages, prompts of ~200 tokens and answers
of ~10, nearly all of the student's work. Here the rollouts of one prompt become one row: the
longest common prefix of their prompts once (segment 0), then each rollout's rest of the
prompt and its response (segment k >= 1, positions going on from the prefix's). Every token
attends to exactly the tokens it attended to in its own row (``decoder.forward``'s
``shared_prefix``), so hidden states, log-probs, loss and gradient are the same functions of
the params as before; only the float rounding of the differently shaped products differs. The
student's prompts of one problem are identical, so its prefix is the whole prompt; the
teacher's prompts of one problem differ per rollout (its demonstration, its feedback), so only
their common beginning is shared.

A packed side ``s`` (student | teacher) of a batch holds ``{s}_tokens``, ``{s}_positions``,
``{s}_attn_mask`` and ``{s}_segments`` [G, S] (G rows, a multiple of the mesh's batch axes;
filler rows hold one attended pad token), ``{s}_row`` [B] (the row of rollout b) and
``{s}_index`` [B, R] (slots within that row).

Which layout a side gets (mode ``auto``): the one with fewer estimated FLOPs, tokens x the
per-token weight products + rows x S^2 x the attention's per (query, key) pair; a row of many
long responses costs attention quadratic in its length, so a long-response batch stays per
rollout. ``always`` packs wherever it is allowed; never for rows longer than a sliding window
(windows count slots, and a continuation sits further from its prefix in slots than in
positions).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pmd_jax.models.config import ModelConfig

MODES = ("auto", "always", "off")
SIDES = ("student", "teacher")


def flops_per_token_and_pair(cfg: ModelConfig) -> tuple[float, float]:
    """Forward FLOPs of ``cfg`` (a ModelConfig) per token in the weight products, and per
    (query, key) pair in the attention (scores and values, every layer and head)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    per_layer = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * d * cfg.intermediate_size
    return 2.0 * cfg.num_layers * per_layer, 4.0 * cfg.num_layers * cfg.num_heads * hd


def layout_cost(rows: int, seq: int, per_token: float, per_pair: float) -> float:
    """Estimated forward FLOPs of ``rows`` padded rows of ``seq`` slots (the dense attention
    computes every pair of a row)."""
    return float(rows) * (seq * per_token + float(seq) * seq * per_pair)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _sequences(batch: Mapping[str, Any], side: str) -> list[tuple[np.ndarray, int]]:
    """Each rollout's real tokens on ``side`` (prompt + response) and its prompt length, from
    the right-padded per-rollout layout."""
    tokens = np.asarray(batch[f"{side}_tokens"])
    attn = np.asarray(batch[f"{side}_attn_mask"])
    index = np.asarray(batch[f"{side}_index"])
    rlen = np.asarray(batch["response_mask"]).sum(axis=1).astype(np.int64)
    out = []
    for b in range(tokens.shape[0]):
        p = int(index[b, 0]) + 1
        n = int(attn[b].sum())
        if n != p + int(rlen[b]) or not attn[b, :n].all():
            raise ValueError(
                f"{side} row {b}: shared prefixes need the right-padded per-rollout layout "
                f"(prompt {p} + response {int(rlen[b])} tokens, {n} attended)")
        out.append((tokens[b, :n], p))
    return out


def prompt_groups(batch: Mapping[str, Any]) -> list[list[int]]:
    """The rollouts (row indices) whose student prompts are identical, in first-seen order."""
    seen: dict[bytes, list[int]] = {}
    for b, (seq, p) in enumerate(_sequences(batch, "student")):
        seen.setdefault(seq[:p].tobytes(), []).append(b)
    return list(seen.values())


def _common_prefix(seqs: Sequence[tuple[np.ndarray, int]]) -> int:
    """The longest common prefix of the prompts (never past the shortest prompt)."""
    c = min(p for _, p in seqs)
    first = seqs[0][0]
    for seq, _ in seqs[1:]:
        diff = np.flatnonzero(seq[:c] != first[:c])
        if diff.size:
            c = int(diff[0])
    return c


def pack_side(seqs: Sequence[tuple[np.ndarray, int]], groups: Sequence[Sequence[int]],
              r_len: int, *, multiple: int = 16, row_multiple: int = 1,
              pad_id: int = 0) -> dict[str, np.ndarray]:
    """The packed arrays of one side (suffix-less keys: tokens, positions, attn_mask,
    segments, row, index) for rollouts ``seqs`` ((tokens, prompt length) each) in ``groups``.
    """
    plan = []
    for g in groups:
        c = _common_prefix([seqs[b] for b in g])
        plan.append((c, c + sum(len(seqs[b][0]) - c for b in g)))
    seq_len = max(_round_up(max(n for _, n in plan), multiple), 2)
    rows = _round_up(len(groups), max(1, row_multiple))
    tokens = np.full((rows, seq_len), pad_id, np.int32)
    positions = np.zeros((rows, seq_len), np.int32)
    attn = np.zeros((rows, seq_len), np.int32)
    segments = np.zeros((rows, seq_len), np.int32)
    attn[:, 0] = 1  # filler rows: one attended token (never NaN)
    row = np.zeros(len(seqs), np.int32)
    index = np.zeros((len(seqs), r_len), np.int32)
    t = np.arange(r_len)
    for gi, (g, (c, n)) in enumerate(zip(groups, plan, strict=True)):
        first = seqs[g[0]][0]
        tokens[gi, :c] = first[:c]
        positions[gi, :c] = np.arange(c)
        start = c
        for k, b in enumerate(g, start=1):
            seq, p = seqs[b]
            rest = len(seq) - c
            tokens[gi, start:start + rest] = seq[c:]
            positions[gi, start:start + rest] = np.arange(c, len(seq))
            segments[gi, start:start + rest] = k
            # the logits predicting response token t sit at sequence position p - 1 + t
            pos = np.minimum(p - 1 + t, len(seq) - 1)
            index[b] = np.where(pos < c, pos, start + pos - c)
            row[b] = gi
            start += rest
        attn[gi, :n] = 1
        segments[gi, n:] = len(g)  # padding queries: the last segment's (never read)
    return {"tokens": tokens, "positions": positions, "attn_mask": attn,
            "segments": segments, "row": row, "index": index}


def share_prefixes(batch: Mapping[str, Any], model_cfg: Any, *, mode: str = "auto",
                   sides: Sequence[str] = SIDES, row_multiple: int = 1,
                   multiple: int = 16) -> tuple[dict[str, Any], dict[str, float]]:
    """``batch`` (per-rollout, right padded) with each side of ``sides`` in shared-prefix rows
    where ``mode`` says so (module docstring), and what was chosen: ``{side}_forward_rows``
    and ``{side}_forward_slots`` (rows x padded length) per side."""
    if mode not in MODES:
        raise ValueError(f"shared prefix mode {mode!r} is not one of {MODES}")
    out = dict(batch)
    stats: dict[str, float] = {}
    present = [s for s in sides if f"{s}_tokens" in batch and f"{s}_row" not in batch]
    groups = prompt_groups(batch) if mode != "off" and present else []
    per_token, per_pair = flops_per_token_and_pair(model_cfg)
    r_len = int(np.shape(batch["responses"])[1])
    for side in present:
        rows, seq_len = np.shape(batch[f"{side}_tokens"])
        if mode != "off" and len(groups) < rows:
            packed = pack_side(_sequences(batch, side), groups, r_len, multiple=multiple,
                               row_multiple=row_multiple)
            g, s = packed["tokens"].shape
            window_ok = not model_cfg.windows_shorter_than(s)
            cheaper = (layout_cost(g, s, per_token, per_pair)
                       < layout_cost(rows, seq_len, per_token, per_pair))
            if window_ok and (mode == "always" or cheaper):
                for k, v in packed.items():
                    out[f"{side}_{k}"] = v
                rows, seq_len = g, s
        stats[f"{side}_forward_rows"] = float(rows)
        stats[f"{side}_forward_slots"] = float(rows * seq_len)
    return out, stats
