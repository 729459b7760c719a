"""Run modes and what each implies for the other sections (``apply_mode``, before freezing)."""

from __future__ import annotations

from typing import Any

import ml_collections

# PMD with one change each, for the comparison grid: a critic control (the teacher sees the
# memory of a random other problem: same form and size, wrong content), level ablations, and
# PMD under SDPO's signal rule (only a shown success or feedback gives a rollout a teacher
# signal; the memory still fills the teacher's context: METHOD.md 2.2's "ablate").
# The mode name stays in the run's config and metrics; apply_mode sets what it implies.
# pmd_verified (issue 35; memory/verify.py): only insights and behaviors whose paired replays
# show that they help reach a teacher context, and a row gets a memory signal only from them
# (all-fail groups with no admitted item are SDPO's: no signal). It is a variant, not the new
# meaning of "pmd": "pmd" stays the method as the paper describes it (every reflected item
# supervises), so that the comparison can show what the check changes.
PMD_VARIANTS: dict[str, dict[str, Any]] = {
    "pmd_random_memory": {"control_mode": "random_other_problem"},
    "pmd_no_insight": {"levels.insight": False},
    "pmd_no_behaviors": {"levels.behavior": False},
    "pmd_sdpo_signal": {"signal_rule": "sdpo"},
    "pmd_verified": {"verify.enabled": True},
    "pmd_verified_random_memory": {"verify.enabled": True,
                                   "control_mode": "random_other_problem"},
}
# Other names of a mode. memory_only (training-free, as Training-Free GRPO / ReasoningBank: the
# memory evolves from the rollouts, the weights never change, evaluation with the memory in the
# prompt) is exactly pmd_frozen_policy; apply_mode writes the canonical name into the config.
MODE_ALIASES: dict[str, str] = {"memory_only": "pmd_frozen_policy"}
MODES: tuple[str, ...] = ("grpo", "sdpo", "sdpo_matched_sampling", "pmd", "pmd_frozen_memory",
                          "pmd_frozen_policy", *PMD_VARIANTS, "mel", "fast_slow")
# fast_slow keeps a memory (updated as in pmd) to render its contexts from (pmd_jax/fast_slow).
MEMORY_MODES: tuple[str, ...] = ("pmd", "pmd_frozen_memory", "pmd_frozen_policy", *PMD_VARIANTS,
                                 "fast_slow")


def _memory_defaults() -> ml_collections.ConfigDict:
    from pmd_jax.memory.config import default_memory_config

    return default_memory_config(derived=False)


def loss_spec(name: Any) -> Any:
    """The registered loss ``name`` (pmd_jax.distill.registry), or None when unknown (config
    validation reports that)."""
    from pmd_jax.distill.registry import get_loss

    try:
        return get_loss(str(name))
    except ValueError:
        return None


def apply_mode(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Derive the settings a mode implies (one code path: a mode is a config value). Run once
    on the ConfigDict, before validation and ``freeze``: nothing changes the config after."""
    with c.unlocked():
        c.mode = MODE_ALIASES.get(c.mode, c.mode)
        loss = c.distill.loss
        spec = loss_spec(loss.name)
        if c.mode in ("grpo", "fast_slow"):  # fast_slow: GRPO on the context-carrying prompts
            loss.name = "grpo"
        elif c.mode == "mel":  # GRPO + the lessons' NLL (pmd_jax/mel): the loss that reads them
            loss.name = "mel"
        elif spec is not None and not spec.needs_teacher:  # a teacher-free loss: SDPO's
            loss.name = "sdpo"
        if c.mode == "sdpo_matched_sampling" and c.teacher_prompt.extra_demo_samples == 0:
            # SDPO with as many extra samples per problem as pmd_verified's check may spend on
            # one problem in a step (a baseline arm and up to max_items_per_problem item arms,
            # ``replays`` samples each; the per-step cap shared over the step's problems), spent
            # on SDPO's own signal: a demonstration for groups without a success.
            v = c.memory.verify
            per_problem = min(v.max_items_per_problem,
                              -(-v.max_items_per_step // max(1, c.rollout.problems_per_step)))
            c.teacher_prompt.extra_demo_samples = int(v.replays * (1 + per_problem))
        if c.mode == "pmd_frozen_memory" and c.memory.frozen_after_step < 0:
            # "memory built once, then fixed": the first fifth of the run builds it (ours).
            c.memory.frozen_after_step = max(0, c.train.steps // 5 - 1)
        defaults = _memory_defaults()
        for key, value in PMD_VARIANTS.get(c.mode, {}).items():
            # Set what the mode implies where the user left the default; a conflicting
            # explicit value is reported by mode_errors.
            if _get_dotted(c.memory, key) == _get_dotted(defaults, key):
                _set_dotted(c.memory, key, value)
    return c


def _get_dotted(c: Any, key: str) -> Any:
    for part in key.split("."):
        c = c[part]
    return c


def _set_dotted(c: Any, key: str, value: Any) -> None:
    *head, last = key.split(".")
    for part in head:
        c = c[part]
    c[last] = value


def mode_errors(c: ml_collections.ConfigDict) -> list[str]:
    """A PMD variant whose implied memory setting was overridden to something else (the
    default is fine: apply_mode replaces it)."""
    defaults = _memory_defaults()
    return [f"mode={c.mode!r} implies memory.{key}={value!r}, but memory.{key}="
            f"{_get_dotted(c.memory, key)!r} was set; drop the override or use mode='pmd'"
            for key, value in PMD_VARIANTS.get(c.mode, {}).items()
            if _get_dotted(c.memory, key) not in (value, _get_dotted(defaults, key))]
