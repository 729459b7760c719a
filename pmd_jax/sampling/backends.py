"""The sampler backends by name: ``rollout.sampler`` picks one; config validation and
``build.build_sampler`` both read this table (the one place a backend is registered).

Each entry builds the sampler from the run config, the loaded model (``build.ModelBundle``)
and the context length the run needs. Imports are lazy: the config reads the names without
importing jax or an HTTP client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig


def _jax(cfg: RunConfig, model: Any, max_len: int) -> Any:
    from pmd_jax.sampling.jax_sampler import JaxSampler

    # The tokenizer serves constrained requests (SamplingParams.json_schema).
    return JaxSampler(model.cfg, model.params, mesh=model.mesh, rules=model.rules,
                      max_len=max_len, pad_id=model.pad_id, max_batch=cfg.rollout.max_batch,
                      max_cache_gib=cfg.rollout.max_cache_gib or None,
                      max_prefill_tokens=cfg.rollout.max_prefill_tokens or None,
                      prefill_matmul_dtype=cfg.rollout.prefill_matmul_dtype or None,
                      tokenizer=model.tokenizer)


def _vllm(cfg: RunConfig, model: Any, max_len: int) -> Any:
    from pmd_jax.sampling.vllm_client import VLLMSampler

    r = cfg.rollout
    return VLLMSampler(r.vllm_url, r.vllm_model or None, store_url=r.weight_store,
                       vocab_size=model.cfg.vocab_size, max_model_len=max_len)


BACKENDS: dict[str, Callable[[RunConfig, Any, int], Any]] = {"jax": _jax, "vllm": _vllm}


def build(name: str, cfg: RunConfig, model: Any, max_len: int) -> Any:
    if name not in BACKENDS:
        raise ValueError(f"rollout.sampler={name!r}: no such sampler backend; known: "
                         f"{', '.join(BACKENDS)}")
    return BACKENDS[name](cfg, model, max_len)
