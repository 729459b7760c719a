"""What the run mode implies for the other sections (``apply_mode``, before freezing), read
from the mode registry (:mod:`pmd_jax.modes`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ml_collections

from pmd_jax.distill.registry import get_loss
from pmd_jax.memory.config import MemoryConfig, default_memory_config
from pmd_jax.modes import aliases, canonical, get_mode, memory_modes, mode_names

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig


def __getattr__(name: str) -> Any:
    """The registry's facts under their older names (for callers that list them)."""
    if name == "MODES":
        return mode_names()
    if name == "MEMORY_MODES":
        return memory_modes()
    if name == "MODE_ALIASES":
        return aliases()
    if name == "PMD_VARIANTS":
        return {n: dict(get_mode(n).memory_settings) for n in mode_names()
                if get_mode(n).memory_settings}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _memory_defaults() -> ml_collections.ConfigDict:
    return default_memory_config(derived=False)


def loss_spec(name: Any) -> Any:
    """The registered loss ``name`` (pmd_jax.distill.registry), or None when unknown (config
    validation reports that)."""

    try:
        return get_loss(str(name))
    except ValueError:
        return None


def apply_mode(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Derive the settings a mode implies (one code path: a mode is a config value). Run once
    on the ConfigDict, before validation and ``freeze``: nothing changes the config after.

    The canonical mode name replaces an alias; an empty ``distill.loss.name`` becomes the
    mode's default loss (a named loss is kept: validation refuses one the mode cannot train
    with); the mode's ``derive`` and ``memory_settings`` fill what the user left at its
    default. An unknown mode is left for validation to name."""
    with c.unlocked():
        c.mode = canonical(c.mode)
        try:
            spec = get_mode(c.mode)
        except ValueError:
            return c
        if not c.distill.loss.name:
            c.distill.loss.name = spec.default_loss
        if spec.derive is not None:
            spec.derive(c)
        defaults = _memory_defaults()
        for key, value in spec.memory_settings.items():
            # Set what the mode implies where the user left the default; a conflicting
            # explicit value is reported by mode_errors.
            if _get_dotted(c.memory, key) == _get_dotted(defaults, key):
                set_dotted(c.memory, key, value)
    return c


def _get_dotted(c: Any, key: str) -> Any:
    for part in key.split("."):
        c = c[part]
    return c


def set_dotted(c: Any, key: str, value: Any) -> None:
    """``c[a][b]...[z] = value`` for ``key = "a.b...z"`` (a ConfigDict or a nested dict)."""
    *head, last = key.split(".")
    for part in head:
        c = c[part]
    c[last] = value


def mode_errors(c: RunConfig) -> list[str]:
    """The mode's own checks: a name the registry does not know, a memory setting the mode
    implies overridden to something else (the default is fine: apply_mode replaces it), a
    loss the mode cannot train with, groups of one where the loss needs advantages, and the
    mode's ``check``."""

    try:
        spec = get_mode(c.mode)
    except ValueError as e:
        return [str(e)]
    defaults = MemoryConfig()
    errs = [f"mode={c.mode!r} implies memory.{key}={value!r}, but memory.{key}="
            f"{_get_attr(c.memory, key)!r} was set; drop the override or use mode='pmd'"
            for key, value in spec.memory_settings.items()
            if _get_attr(c.memory, key) not in (value, _get_attr(defaults, key))]
    loss = loss_spec(c.distill.loss.name)
    if loss is not None:
        why = spec.loss_error(loss)
        if why:
            errs.append(why)
    if spec.needs_groups and c.rollout.n < 2:
        errs.append(f"mode={c.mode} with rollout.n=1 has zero advantages (GRPO groups are "
                    "the rollouts of one problem): use rollout.n >= 2")
    if spec.check is not None:
        errs.extend(spec.check(c))
    return errs


def _get_attr(section: Any, key: str) -> Any:
    """A dotted knob of a frozen section."""
    for part in key.split("."):
        section = getattr(section, part)
    return section
