"""The model's context length, read from its config alone (no weights): for the prompt-budget
checks of config validation."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pmd_jax.models.assets import EMBEDDED_MODELS, AssetError, embedded_gguf_path
from pmd_jax.models.config import PRESETS, ConfigError
from pmd_jax.models.gguf_io import GGUFError, read_gguf_header

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig


def model_context_length(c: RunConfig) -> int:
    """The model's context (max_position_embeddings) from its config alone, no weights:
    the preset for ``model.random_init``, the embedded GGUF's header for an embedded model, else
    the checkpoint folder's config.json. Raises ConfigError when it cannot be read."""

    if c.model.random_init:
        return int(PRESETS[c.model.random_init]().max_position_embeddings)

    if c.model.source in EMBEDDED_MODELS:
        try:
            path = embedded_gguf_path(c.model.source)
        except AssetError as e:
            raise ConfigError(f"model.source={c.model.source!r}: {e}") from None
        n = gguf_context_length(path)
        if n is None:
            raise ConfigError(f"model.source={c.model.source!r}: no context_length in {path}")
        return n

    p = Path(c.model.source) / "config.json"
    try:
        hf = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"model.source={c.model.source!r} has no config.json") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.source={c.model.source!r}: cannot read {p}: {e}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"model.source={c.model.source!r}: {p} is not a JSON object")
    return int(hf.get("max_position_embeddings", 4096))  # as models.config.from_hf_config


def gguf_context_length(path: str | os.PathLike) -> int | None:
    """``<arch>.context_length`` from a GGUF file's key/value header, read as a stream up to
    that key (:func:`pmd_jax.models.gguf_io.read_gguf_header`). None when the file has no
    such key or is not a little-endian GGUF v2/v3 file."""

    try:
        meta = read_gguf_header(path, stop_at="general.architecture").meta
        arch = meta.get("general.architecture")
        if not isinstance(arch, str):
            return None
        key = f"{arch}.context_length"
        n = read_gguf_header(path, stop_at=key).meta.get(key)
    except GGUFError:
        return None
    return None if n is None else int(n)
