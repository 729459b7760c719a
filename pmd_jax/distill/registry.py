"""The losses the train step knows, by name (``distill.loss.name``).

A loss is a :class:`LossSpec`: its name, its function and what it needs. The train step
(:mod:`pmd_jax.distill.step`), gradient accumulation (:mod:`pmd_jax.distill.accumulate`) and
config validation ask the registry; nothing else branches on loss names.

* ``needs_teacher``: the step runs the teacher forward(s) on the teacher prompt and keeps a
  teacher tree (rule ``distill.teacher.rule``); ``fn`` gets the chunked distillation statistics.
  Without it the step drops the ``teacher_*`` arrays and computes only the student's token
  log-probs.
* ``needs_rewards``: the batch carries ``rewards`` in prompt-major groups of
  ``distill.loss.group_size`` (= ``rollout.n``) rows (the batch and each microbatch are whole
  groups).
* ``needs_old_logprobs``: ``old_logp`` must be in the batch (else it is optional: absent
  means on-policy).
* ``batch_keys``: the arrays the loss reads beyond those every loss reads (the student
  sequence, the response maps and ``sd_mask``, :data:`pmd_jax.distill.batch.BASE_KEYS`);
  ``check_batch`` requires them.
* ``metric_kinds``: how each metric ``fn`` returns combines over microbatches (see
  :mod:`pmd_jax.distill.accumulate`); ``"loss"`` names the mask that normalises the loss.
* ``drops_unsignaled_rows``: the loss and its gradient do not depend on the rows whose
  teacher got no signal (``sd_mask == 0``: out of the loss mask, a token mean over it), so
  ``train.drop_unsignaled_rows`` may leave them out of the update batch
  (:func:`pmd_jax.distill.update_rows.rows_for_update`); a loss with advantages uses every row.
* ``config_warning``: ``(distill.loss section) -> str | None``, a warning validation logs
  for knobs that do not act on this loss the way their names suggest (``hybrid``: alpha and
  top-K define its kl metric, not its gradient).
* ``lesson_nll``: the batch also carries lesson rows (:data:`LESSON_KEYS`, ``mode=mel``,
  :mod:`pmd_jax.modes.mel`); the step adds ``nll_weight`` x their token-mean NLL to the loss, from
  a second forward in the same jitted step (:func:`pmd_jax.distill.loss_fn.make_lesson_nll_fn`).

The built-in losses (``sdpo``, ``grpo``, ``hybrid``) are registered in
:mod:`pmd_jax.distill.objectives`; adding a loss is one function and one
:func:`register_loss` call there.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

# the combination rules a metric may declare (pmd_jax.distill.accumulate)
METRIC_KINDS = ("loss_mask", "response", "rows", "sum", "max")
TEACHER_KEYS = ("teacher_tokens", "teacher_positions", "teacher_attn_mask")
# mode=mel: the kept lessons as rows of their own ([L, Tl] sequence, [L, Rl] lesson tokens)
LESSON_KEYS = ("lesson_tokens", "lesson_positions", "lesson_attn_mask", "lesson_index",
               "lesson_targets", "lesson_mask")

_BUILTIN_MODULE = "pmd_jax.distill.objectives"


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """One loss of the train step (see the module docstring for each field)."""

    name: str
    fn: Callable
    needs_teacher: bool
    needs_rewards: bool
    needs_old_logprobs: bool
    batch_keys: tuple[str, ...]
    doc: str
    metric_kinds: Mapping[str, str] = dataclasses.field(default_factory=dict, hash=False)
    lesson_nll: bool = False
    drops_unsignaled_rows: bool = False
    config_warning: Callable[[Any], str | None] | None = dataclasses.field(default=None,
                                                                            hash=False)

    def required_keys(self) -> tuple[str, ...]:
        """The arrays this loss reads beyond the base keys, including ``old_logp`` if needed."""
        extra = ("old_logp",) if self.needs_old_logprobs and "old_logp" not in self.batch_keys \
            else ()
        return (*self.batch_keys, *extra)


_LOSSES: dict[str, LossSpec] = {}


def _check(spec: LossSpec) -> None:
    if not spec.name or not isinstance(spec.name, str):
        raise ValueError(f"a loss needs a non-empty name, got {spec.name!r}")
    if not callable(spec.fn):
        raise TypeError(f"loss {spec.name!r}: fn must be callable")
    has_teacher = all(k in spec.batch_keys for k in TEACHER_KEYS)
    if spec.needs_teacher != has_teacher:
        raise ValueError(f"loss {spec.name!r}: needs_teacher={spec.needs_teacher} but batch_keys "
                         f"{spec.batch_keys} {'lack' if spec.needs_teacher else 'hold'} "
                         f"{TEACHER_KEYS}")
    if spec.needs_rewards != ("rewards" in spec.batch_keys):
        raise ValueError(f"loss {spec.name!r}: needs_rewards={spec.needs_rewards} but "
                         f"'rewards' is{'' if 'rewards' in spec.batch_keys else ' not'} in "
                         f"batch_keys {spec.batch_keys}")
    if spec.lesson_nll != all(k in spec.batch_keys for k in LESSON_KEYS):
        raise ValueError(f"loss {spec.name!r}: lesson_nll={spec.lesson_nll} but batch_keys "
                         f"{spec.batch_keys} {'lack' if spec.lesson_nll else 'hold'} "
                         f"{LESSON_KEYS}")
    bad = {k: v for k, v in spec.metric_kinds.items() if v not in METRIC_KINDS}
    if bad:
        raise ValueError(f"loss {spec.name!r}: unknown metric kinds {bad}; known: {METRIC_KINDS}")
    if spec.metric_kinds.get("loss") not in ("loss_mask", "response"):
        raise ValueError(f"loss {spec.name!r}: metric_kinds['loss'] must be 'loss_mask' or "
                         "'response' (the mask whose token count normalises the loss)")


def register_loss(spec: LossSpec) -> LossSpec:
    """Add ``spec`` to the registry (a second spec under a taken name is an error)."""
    _check(spec)
    old = _LOSSES.get(spec.name)
    if old is not None and old is not spec:
        raise ValueError(f"loss {spec.name!r} is already registered (by "
                         f"{getattr(old.fn, '__module__', '?')})")
    _LOSSES[spec.name] = spec
    return spec


def _load_builtin() -> None:
    importlib.import_module(_BUILTIN_MODULE)


def get_loss(name: str) -> LossSpec:
    """The spec registered under ``name``; an unknown name is a ValueError listing the known."""
    _load_builtin()
    spec = _LOSSES.get(name)
    if spec is None and not name:
        raise ValueError("no loss named: an empty distill.loss.name means the run mode's "
                         "default, which pmd_jax.config.apply_mode fills in (as the command "
                         f"line does); known losses: {loss_names()}")
    if spec is None:
        raise ValueError(f"unknown loss {name!r}; known losses: {loss_names()}")
    return spec


def loss_names() -> tuple[str, ...]:
    """The registered loss names, in registration order."""
    _load_builtin()
    return tuple(_LOSSES)
