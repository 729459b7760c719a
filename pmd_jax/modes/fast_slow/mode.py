"""``mode=fast_slow`` in the mode registry (:mod:`pmd_jax.modes`): GRPO on rollout prompts that
carry a context of the pool (:class:`pmd_jax.modes.fast_slow.pool.ContextPool`), the memory updated
as in pmd, the pool updated after the memory (the mode's host work), checkpointed with the
run and deployed in evaluation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pmd_jax.modes import ModeRuntime, ModeSpec, register_mode
from pmd_jax.modes.fast_slow import pool

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig


class FastSlowRuntime(ModeRuntime):
    """The run's context pool and its hooks into the loop."""

    work_name = "fast_slow"

    def __init__(self, pool: Any) -> None:
        self.pool = pool  # pool.ContextPool

    def train_items(self, problems: Sequence[Any]) -> Sequence[Any]:
        """Without the validation problems unless fast_slow.val_in_train."""
        if self.pool.fs.val_in_train:
            return problems
        val = {id(p) for p in self.pool.val_problems}
        return [p for p in problems if id(p) not in val]

    def student_messages(self, step: int, position: int, messages: Any) -> Any:
        """The task's messages with the context drawn for this problem."""
        return self.pool.messages(step, position, messages)

    def host_work(self, step: int, sb: Any, memory: Any, textgen: Any) -> dict[str, float]:
        return self.pool.update(step, sb, memory, textgen)

    def eval_context(self) -> str | None:
        return self.pool.deployed().text

    def state_dict(self) -> Any:
        return self.pool.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.pool.load_state_dict(state)


def _runtime(cfg: RunConfig, model: Any, task: Any, train_problems: Sequence[Any],
             eval_problems: Sequence[Any]) -> FastSlowRuntime:
    return FastSlowRuntime(pool.build_pool(cfg, model, task, train_problems, eval_problems))


def _errors(c: RunConfig) -> list[str]:
    """The context is part of the student prompt, and is scored within the sampler's
    generation budget."""
    errs = []
    mct, vmt = c.fast_slow.max_context_tokens, c.fast_slow.val_max_tokens
    if isinstance(mct, int) and mct >= c.rollout.max_prompt_tokens:
        errs.append(f"fast_slow.max_context_tokens={mct} must be "
                    f"below rollout.max_prompt_tokens={c.rollout.max_prompt_tokens} (the "
                    "context is part of the student prompt)")
    if isinstance(vmt, int) and vmt > max(c.rollout.max_tokens, c.eval.max_tokens):
        errs.append(f"fast_slow.val_max_tokens={vmt} exceeds max(rollout.max_tokens, "
                    "eval.max_tokens), the generation budget the sampler's context is "
                    "checked for")
    return errs


FAST_SLOW = register_mode(ModeSpec(
    name="fast_slow", teacher="none", uses_memory=True, default_loss="grpo",
    needs_groups=True, single_process=True, check=_errors, runtime=_runtime,
    doc="Fast-Slow Training: GRPO (slow weights) on prompts carrying a Pareto pool of "
        "optimised contexts (fast weights) rewritten from the rollouts and the memory."))
