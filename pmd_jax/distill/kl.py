"""KL(policy || initial model) on a step's rollouts: one extra jitted forward of the initial
params (``train.kl_initial_every``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from pmd_jax.distill import align
from pmd_jax.distill.chunked import chunked_token_logprobs
from pmd_jax.distill.offload import DiskParams, optimizer_set_aside
from pmd_jax.distill.shared_prefix import share_prefixes
from pmd_jax.models import decoder
from pmd_jax.run.multihost import to_host

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig

_KL_FNS: dict[Any, Any] = {}


def kl_due(step: int, every: int) -> bool:
    """Whether train step ``step`` measures KL(policy || initial) (``train.kl_initial_every``):
    steps 0, N, 2N, ..., the steps whose sampling policy an evaluation with
    ``train.eval_every=N`` sees (its accuracy-vs-KL point); 0 = never."""
    return every > 0 and step % every == 0


def kl_to_initial(cfg: RunConfig, model: Any, bundle: Any, batch: dict[str, np.ndarray]) -> float:
    """KL(policy || initial model) on this step's rollouts, sampled-token estimator.

    The rollouts were sampled from the policy, so the mean over response tokens of
    ``log pi(y_t) - log pi_0(y_t)`` (the sampler's log-probs minus the initial model's, at the
    sampling temperature) estimates the sequence-level KL per token. One extra forward.
    ``model``: a build.ModelBundle; ``bundle``: a distill.train.TrainBundle.
    """

    mc = model.cfg
    temp = float(cfg.distill.loss.temperature)
    key = (mc, temp)
    if key not in _KL_FNS:
        def fn(params, b):
            seg = b.get("student_segments")
            h, _ = decoder.forward(params, b["student_tokens"], b["student_positions"], mc,
                                   attn_mask=b["student_attn_mask"], segment_ids=seg,
                                   shared_prefix=seg is not None, return_hidden=True)
            h = align.side_hidden(h, b, "student")
            return chunked_token_logprobs(h, decoder.unembed_matrix(params, mc),
                                          b["responses"], temp)

        _KL_FNS[key] = jax.jit(fn)
    offload = bool(cfg.train.offload_optimizer_during_kl)
    with optimizer_set_aside(bundle, str(cfg.run_dir) if offload else "", offload):
        params = bundle.initial_params
        if isinstance(params, DiskParams):  # train.offload_initial_policy: read for it
            params = params.load()
        lp0 = _initial_logprobs(cfg, mc, _KL_FNS[key], params, batch)
        del params
    m = batch["response_mask"].astype(np.float64)
    diff = (batch["sampler_logp"] - lp0) * m
    return float(diff.sum() / max(m.sum(), 1.0))


def _initial_logprobs(cfg: RunConfig, mc: Any, fn: Any, params: Any,
                      batch: dict[str, np.ndarray]) -> np.ndarray:
    """The initial model's log-probs of the rollouts' response tokens, on the host."""

    # the student side in shared-prefix rows where train.shared_prefix says so
    keys = ("student_tokens", "student_positions", "student_attn_mask", "student_index",
            "student_segments", "student_row", "responses")
    packed = share_prefixes(batch, mc, mode=cfg.train.shared_prefix, sides=("student",))[0]
    b = {k: packed[k] for k in keys if k in packed}
    rows, mb = len(b["student_tokens"]), int(cfg.train.microbatch_rows)
    # In the step's microbatches (train.microbatch_rows; never with shared-prefix rows, whose
    # rows index each other): the forward's activations and logits for mb rows at a time, so
    # this forward does not set the step's peak (16 Qwen2.5-Coder-0.5B rows at once: +1.7 GiB).
    if 0 < mb < rows and rows % mb == 0 and "student_row" not in b:
        return np.concatenate([to_host(fn(params, {k: v[i:i + mb] for k, v in b.items()}))
                               for i in range(0, rows, mb)])
    return to_host(fn(params, b))  # (gathered when sharded over several processes)
