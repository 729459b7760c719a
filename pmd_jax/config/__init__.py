"""The run configuration.

* :mod:`.sections` declares every run section as a frozen dataclass, each knob once with its
  default and help text (``distill`` and ``memory`` next to their packages);
  ``base_config()`` generates the editable ml_collections ConfigDict from them.
* Config files in ``configs/`` start from ``base_config()``; the command line overrides
  further (``--config.rollout.n=4``; checked first by :mod:`pmd_jax.config.cli`).
* :func:`apply_mode` (:mod:`.modes`) derives what the run mode implies, on the ConfigDict;
  :func:`validate_config` / :func:`config_errors` (:mod:`.validate`) name every problem at
  once; :func:`freeze` then builds the frozen :class:`RunConfig` the run reads, with the same
  attribute paths (``cfg.train.steps``). Nothing changes it afterwards.

Names resolve lazily (PEP 562), so ``pmd_jax.distill.config`` and ``pmd_jax.memory.config``
can import :mod:`.schema` while this package is being imported.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    # sections
    "RunConfig": "sections", "base_config": "sections",
    "DEFAULT_COMPILATION_CACHE_DIR": "sections",
    # modes
    "MODES": "modes", "MODE_ALIASES": "modes", "MEMORY_MODES": "modes", "PMD_VARIANTS": "modes",
    "SAMPLERS": "sections",
    "apply_mode": "modes", "mode_errors": "modes",
    # validation and freezing
    "ConfigError": "validate", "MOVED_KEYS": "validate", "batch_plan_errors": "validate",
    "config_errors": "validate", "env_process_count": "validate", "format_errors": "validate",
    "freeze": "validate", "try_freeze": "validate", "teacher_prompt_budget": "validate",
    "validate_config": "validate",
    "_run_dir_errors": "validate", "_task_errors": "validate",
    # model context, compilation cache
    "gguf_context_length": "context_length", "model_context_length": "context_length",
    "compilation_cache_dir": "cache", "setup_compilation_cache": "cache",
    # schema
    "FrozenDict": "schema", "Section": "schema",
}

__all__ = [k for k in _EXPORTS if not k.startswith("_")]


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'pmd_jax.config' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pmd_jax.config.{mod}"), name)
