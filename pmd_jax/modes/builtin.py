"""The built-in modes: GRPO, SDPO, PMD and its variants and controls (METHOD.md).

MEL registers in :mod:`pmd_jax.modes.mel.mode`, Fast-Slow in :mod:`pmd_jax.modes.fast_slow.mode`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pmd_jax.modes import ModeSpec, register_mode

if TYPE_CHECKING:
    import ml_collections

register_mode(ModeSpec(
    name="grpo", teacher="none", default_loss="grpo", needs_groups=True,
    doc="GRPO: group-normalised advantages of the verifier's rewards, no teacher."))
register_mode(ModeSpec(
    name="sdpo", teacher="feedback",
    doc="SDPO: the policy conditioned on a successful sibling or the verifier's feedback "
        "is the teacher of its own rollouts."))


def _matched_sampling(c: ml_collections.ConfigDict) -> None:
    """SDPO with as many extra samples per problem as pmd_verified's check may spend on one
    problem in a step (a baseline arm and up to max_items_per_problem item arms, ``replays``
    samples each; the per-step cap shared over the step's problems), spent on SDPO's own
    signal: a demonstration for groups without a success. An explicit value is kept."""
    if c.teacher_prompt.extra_demo_samples == 0:
        v = c.memory.verify
        per_problem = min(v.max_items_per_problem,
                          -(-v.max_items_per_step // max(1, c.rollout.problems_per_step)))
        c.teacher_prompt.extra_demo_samples = int(v.replays * (1 + per_problem))


register_mode(ModeSpec(
    name="sdpo_matched_sampling", teacher="feedback", derive=_matched_sampling,
    doc="SDPO with pmd_verified's extra sampling budget spent on demonstrations (the "
        "control that tells memory text from more samples)."))
register_mode(ModeSpec(
    name="pmd", teacher="memory", uses_memory=True,
    doc="PMD: the memory's experiences, insights and behaviors join SDPO's context; every "
        "reflected item supervises."))


def _frozen_memory(c: ml_collections.ConfigDict) -> None:
    """"memory built once, then fixed": the first fifth of the run builds it (ours); an
    explicit memory.frozen_after_step is kept."""
    if c.memory.frozen_after_step < 0:
        c.memory.frozen_after_step = max(0, c.train.steps // 5 - 1)


register_mode(ModeSpec(
    name="pmd_frozen_memory", teacher="memory", uses_memory=True, derive=_frozen_memory,
    doc="PMD with the memory built in the first fifth of the run, then fixed."))
# memory_only (training-free, as Training-Free GRPO / ReasoningBank: the memory evolves from
# the rollouts, the weights never change, evaluation with the memory in the prompt).
register_mode(ModeSpec(
    name="pmd_frozen_policy", teacher="memory", uses_memory=True, trains_policy=False,
    eval_with_memory=True, aliases=("memory_only",),
    doc="The memory evolves, the weights never change; evaluation also with the memory."))

# PMD with one change each, for the comparison grid: a critic control (the teacher sees the
# memory of a random other problem: same form and size, wrong content), level ablations, and
# PMD under SDPO's signal rule (only a shown success or feedback gives a rollout a teacher
# signal; the memory still fills the teacher's context: METHOD.md 2.2's "ablate").
# pmd_verified (issue 35; memory/verify.py): only insights and behaviors whose paired replays
# show that they help reach a teacher context, and a row gets a memory signal only from them
# (all-fail groups with no admitted item are SDPO's: no signal). It is a variant, not the new
# meaning of "pmd": "pmd" stays the method as the paper describes it (every reflected item
# supervises), so that the comparison can show what the check changes.
_VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "pmd_random_memory": ({"control_mode": "random_other_problem"},
                          "PMD whose teacher sees a random other problem's memory."),
    "pmd_no_insight": ({"levels.insight": False}, "PMD without the insight level."),
    "pmd_no_behaviors": ({"levels.behavior": False}, "PMD without the behavior level."),
    "pmd_sdpo_signal": ({"signal_rule": "sdpo"},
                        "PMD where only a success or feedback gives a row a signal."),
    "pmd_verified": ({"verify.enabled": True},
                     "PMD whose insights and behaviors supervise only once paired replays "
                     "show they help."),
    "pmd_verified_random_memory": ({"verify.enabled": True,
                                    "control_mode": "random_other_problem"},
                                   "pmd_verified with a random other problem's memory."),
}
for _name, (_settings, _doc) in _VARIANTS.items():
    register_mode(ModeSpec(name=_name, teacher="memory", uses_memory=True,
                           memory_settings=_settings, doc=_doc))
