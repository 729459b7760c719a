"""The model's context length, read from its config alone (no weights): for the prompt-budget
checks of config validation."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pmd_jax.models.config import ConfigError

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig


def model_context_length(c: RunConfig) -> int:
    """The model's context (max_position_embeddings) from its config alone, no weights:
    the preset for ``model.random_init``, the embedded GGUF's header for an embedded model, else
    the checkpoint folder's config.json. Raises ConfigError when it cannot be read."""
    from pmd_jax.models.config import PRESETS

    if c.model.random_init:
        return int(PRESETS[c.model.random_init]().max_position_embeddings)
    from pmd_jax.models.assets import EMBEDDED_MODELS, AssetError, embedded_gguf_path

    if c.model.source in EMBEDDED_MODELS:
        try:
            path = embedded_gguf_path(c.model.source)
        except AssetError as e:
            raise ConfigError(f"model.source={c.model.source!r}: {e}") from None
        n = gguf_context_length(path)
        if n is None:
            raise ConfigError(f"model.source={c.model.source!r}: no context_length in {path}")
        return n
    import json

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


_GGUF_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                11: "q", 12: "d"}


def gguf_context_length(path: str | os.PathLike) -> int | None:
    """``<arch>.context_length`` from a GGUF file's key/value header, read as a stream up to
    that key (the gguf package's reader parses the whole vocabulary first: ~10 s).
    None when the file has no such key or is not a little-endian GGUF v2/v3 file."""

    def read(f: Any, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        b = f.read(size)
        if len(b) != size:
            raise EOFError
        return struct.unpack("<" + fmt, b)[0]

    def read_str(f: Any) -> str:
        n = read(f, "Q")
        return f.read(n).decode("utf-8", "replace")

    def skip(f: Any, vtype: int) -> Any:
        if vtype in _GGUF_SCALAR:
            return read(f, _GGUF_SCALAR[vtype])
        if vtype == 8:
            return read_str(f)
        if vtype == 9:
            etype, count = read(f, "I"), read(f, "Q")
            if etype in _GGUF_SCALAR:
                f.seek(count * struct.calcsize("<" + _GGUF_SCALAR[etype]), os.SEEK_CUR)
            else:
                for _ in range(count):
                    skip(f, etype)
            return None
        raise ValueError(f"unknown GGUF value type {vtype}")

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or read(f, "I") not in (2, 3):
                return None
            read(f, "Q")  # tensor count
            arch = None
            for _ in range(read(f, "Q")):
                key, vtype = read_str(f), read(f, "I")
                value = skip(f, vtype)
                if key == "general.architecture":
                    arch = value
                elif arch is not None and key == f"{arch}.context_length":
                    return int(value)
    except (OSError, EOFError, ValueError, struct.error):
        return None
    return None
