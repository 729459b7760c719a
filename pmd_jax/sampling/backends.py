"""The sampler backends by name: ``rollout.sampler`` picks one; config validation, the start-up
checks, ``build.build_sampler`` and ``build.build_samplers`` read its :class:`BackendSpec` (the
one place a backend is registered: adding a server backend is one file with its sampler and
one :func:`register_backend` call here, no string branch elsewhere).

Each spec builds the sampler from the run config, the loaded model (``build.ModelBundle``) and
the context length the run needs, and says what the rest of the run must know about it: the
rollout knobs it needs, whether it can start here (a server that answers), whether it runs
in one JAX process only, and whether ``rollout.overlap`` gives the main thread its own
instance (an in-process sampler) or shares this one (a client of a server that batches
concurrent requests). The config reads this registry (the ``rollout.sampler`` knob's help
and checks); the registry does not import the config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pmd_jax.registry import Registry
from pmd_jax.sampling.jax_sampler import JaxSampler
from pmd_jax.sampling.vllm_client import VLLMSampler, unreachable_message


def _no_errors(rollout: Any) -> list[str]:
    return []


def _no_refusal(cfg: Any) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """One backend. ``cfg`` is the frozen run config (``pmd_jax.config.sections.RunConfig``)
    and ``rollout`` its rollout section, typed ``Any`` here: the config reads this registry
    (the rollout.sampler knob's help and checks), so this module does not import it."""

    name: str
    # (run config, model bundle, context length) -> the sampler
    build: Callable[[Any, Any, int], Any]
    # what this backend needs of the rollout section (each a one-line error)
    rollout_errors: Callable[[Any], list[str]] = _no_errors
    # what stops it from starting on this machine, found before the model loads
    start_refusal: Callable[[Any], str | None] = _no_refusal
    # why it cannot run with several JAX processes ("": it can)
    single_process_reason: str = ""
    # rollout.overlap: a second instance for the main thread (an in-process sampler: they
    # share compiled programs and, after the first publish, the weights), else this one
    twin_for_overlap: bool = False


def _jax(cfg: Any, model: Any, max_len: int) -> Any:
    # The tokenizer serves constrained requests (SamplingParams.json_schema).
    return JaxSampler(model.cfg, model.params, mesh=model.mesh, rules=model.rules,
                      max_len=max_len, pad_id=model.pad_id, max_batch=cfg.rollout.max_batch,
                      max_cache_gib=cfg.rollout.max_cache_gib or None,
                      max_prefill_tokens=cfg.rollout.max_prefill_tokens or None,
                      prefill_matmul_dtype=cfg.rollout.prefill_matmul_dtype or None,
                      tokenizer=model.tokenizer)


def _vllm(cfg: Any, model: Any, max_len: int) -> Any:
    r = cfg.rollout
    return VLLMSampler(r.vllm_url, r.vllm_model or None, store_url=r.weight_store,
                       vocab_size=model.cfg.vocab_size, max_model_len=max_len)


def _vllm_rollout_errors(r: Any) -> list[str]:
    errs = []
    if not str(r.vllm_url).startswith("http"):
        errs.append("rollout.vllm_url must be an http(s) URL")
    if not r.weight_store:
        errs.append("rollout.sampler=vllm needs rollout.weight_store")
    return errs


def _vllm_start_refusal(cfg: Any) -> str | None:
    return unreachable_message(cfg.rollout.vllm_url, cfg.model.source)


SPECS: Registry[BackendSpec] = Registry(
    "sampler backend", lambda name, known: ValueError(
        f"rollout.sampler={name!r}: no such sampler backend; known: {', '.join(known)}"))


def register_backend(spec: BackendSpec) -> BackendSpec:
    return SPECS.register(spec.name, spec)


register_backend(BackendSpec("jax", _jax, twin_for_overlap=True))
register_backend(BackendSpec(
    "vllm", _vllm, rollout_errors=_vllm_rollout_errors, start_refusal=_vllm_start_refusal,
    single_process_reason=(
        "every process would send its own rollout requests and weight reloads to the "
        "server and publish a local weight store the server's host cannot read")))

def get_backend(name: str) -> BackendSpec:
    return SPECS.get(name)


def backend_names() -> tuple[str, ...]:
    return SPECS.names()


def start_refusal(cfg: Any) -> str | None:
    """What stops a valid config from starting here, found before the model loads (the run's
    backend's check: e.g. the vLLM server it samples from does not answer); None: nothing."""
    return get_backend(cfg.rollout.sampler).start_refusal(cfg)


def build(name: str, cfg: Any, model: Any, max_len: int) -> Any:
    return get_backend(name).build(cfg, model, max_len)
