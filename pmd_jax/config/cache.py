"""jax's persistent compilation cache, configured from ``train.compilation_cache_*``."""

from __future__ import annotations

import os
from typing import Any

import jax

# Environment variables jax reads at import; when set they win over the train.* options.
_CACHE_ENV = {
    "jax_compilation_cache_dir": "JAX_COMPILATION_CACHE_DIR",
    "jax_persistent_cache_min_compile_time_secs": "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "jax_compilation_cache_max_size": "JAX_COMPILATION_CACHE_MAX_SIZE",
}


def compilation_cache_dir(train: Any) -> str | None:
    """``train.compilation_cache_dir`` expanded, or None when it is "" / "none" (disabled)."""
    d = train.compilation_cache_dir
    if d is None or (isinstance(d, str) and d.strip().lower() in ("", "none")):
        return None
    return os.path.abspath(os.path.expanduser(str(d)))


def compilation_cache_errors(train: Any) -> list[str]:
    """Problems of the train.compilation_cache_* options."""
    errs: list[str] = []
    d = train.compilation_cache_dir
    if not (d is None or isinstance(d, str)):
        errs.append(f"train.compilation_cache_dir must be a path, '' or 'none', got {d!r}")
    elif (path := compilation_cache_dir(train)) is not None and (
            os.path.exists(path) and not os.path.isdir(path)):
        errs.append(f"train.compilation_cache_dir={d!r} exists and is not a directory")
    secs = train.compilation_cache_min_compile_secs
    if isinstance(secs, bool) or not isinstance(secs, int | float) or not secs >= 0:
        errs.append(f"train.compilation_cache_min_compile_secs must be a number >= 0, "
                    f"got {secs!r}")
    gib = train.compilation_cache_max_gib
    if (isinstance(gib, bool) or not isinstance(gib, int | float)
            or not (gib == -1 or gib > 0)):
        errs.append(f"train.compilation_cache_max_gib must be > 0 or -1 (unbounded), "
                    f"got {gib!r}")
    return errs


def setup_compilation_cache(train: Any) -> str | None:
    """Points jax's persistent compilation cache at ``train.compilation_cache_dir``.

    Call after ``validate_config`` and before the first compile. Settings given through
    jax's own environment variables are left as they are. Returns the cache directory in
    use (None: disabled).
    """

    wanted: dict[str, Any] = {
        "jax_persistent_cache_min_compile_time_secs":
            float(train.compilation_cache_min_compile_secs),
        "jax_compilation_cache_max_size":
            int(float(train.compilation_cache_max_gib) * 2**30)
            if train.compilation_cache_max_gib != -1 else -1,
    }
    if os.environ.get(_CACHE_ENV["jax_compilation_cache_dir"]) is None:
        wanted["jax_compilation_cache_dir"] = compilation_cache_dir(train)
    for name, value in wanted.items():
        if os.environ.get(_CACHE_ENV[name]) is None:
            jax.config.update(name, value)
    # read through .values: jax.config sets its options as attributes at run time, which
    # its class does not declare to a type checker
    return jax.config.values["jax_compilation_cache_dir"] or None
