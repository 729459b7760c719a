"""The run modes, by name (``mode``): one :class:`ModeSpec` per mode, the only place that
knows what a mode means.

A mode says what the teacher sees (nothing: GRPO's batch; SDPO's context; SDPO's context
and the procedural memory), whether the run keeps a memory and trains the policy, which
losses it allows and which it takes when the user names none, the settings it implies, its
own config checks, and the hooks of its per-run state (:class:`ModeRuntime`): extra host work
after the memory update, extra rows of the train batch, the rollout prompt's messages, the
problems it trains on, state for the checkpoint, a context for evaluation. The trainer,
``teaching``, evaluation, ``build`` and config validation ask the spec; nothing outside this
package branches on a mode's name.

The built-in modes register in :mod:`pmd_jax.modes.builtin` (GRPO, SDPO, PMD and its
variants and controls), :mod:`pmd_jax.modes.mel.mode` (MEL) and :mod:`pmd_jax.modes.fast_slow.mode`
(Fast-Slow); they are imported on the first lookup. Adding a mode is one module with one
:func:`register_mode` call, and its name in :data:`_MODULES`.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pmd_jax.distill.registry import get_loss, loss_names

if TYPE_CHECKING:
    import ml_collections

# What the teacher's context holds (ModeSpec.teacher).
TEACHERS = ("none", "feedback", "memory")

_MODULES = ("pmd_jax.modes.builtin", "pmd_jax.modes.mel.mode", "pmd_jax.modes.fast_slow.mode")


class ModeRuntime:
    """A mode's per-run state and hooks, built once by the trainer (``ModeSpec.runtime``);
    every hook's default leaves the loop as it is. ``work_name``: the name of the extra host
    work's timing (``time_<name>``), None when the mode has none."""

    work_name: str | None = None

    def train_items(self, problems: Sequence[Any]) -> Sequence[Any]:
        """The problems the training stream draws from."""
        return problems

    def student_messages(self, step: int, position: int, messages: Any) -> Any:
        """The rollout prompt of the step's ``position``-th problem."""
        return messages

    def host_work(self, step: int, sb: Any, memory: Any, textgen: Any) -> dict[str, float]:
        """Host work after the memory update (process 0); returns metrics for the step."""
        return {}

    def extra_rows(self, sb: Any, row_multiple: int) -> dict[str, Any]:
        """Arrays added to the step's train batch (after the teacher prompts)."""
        return {}

    def eval_context(self) -> str | None:
        """A context the evaluation prompts carry (None: the task's prompt alone)."""
        return None

    def state_dict(self) -> Any:
        """What a checkpoint keeps of this state (None: nothing)."""
        return None

    def load_state_dict(self, state: Any) -> None:
        """Restores :meth:`state_dict`'s value."""


def _no_runtime(cfg: Any, model: Any, task: Any, train_problems: Sequence[Any],
                eval_problems: Sequence[Any]) -> ModeRuntime:
    return ModeRuntime()


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    """One run mode.

    * ``teacher``: what the teacher's context holds: ``"none"`` (no teacher: the student's
      own prompt on both sides, GRPO's batch), ``"feedback"`` (SDPO: a successful sibling, the
      verifier's feedback, demonstrations), ``"memory"`` (SDPO's context and the memory's
      items).
    * ``uses_memory``: the run builds a procedural memory and updates it every step.
    * ``trains_policy``: False: the weights never change (no update, publish or KL).
    * ``default_loss``: the loss when ``distill.loss.name`` is left empty; a loss the user
      names is kept when :meth:`loss_error` allows it and refused otherwise, never replaced.
    * ``lesson_rows``: the train batch carries lesson rows (the losses with ``lesson_nll``
      read them, and need them).
    * ``needs_groups``: the loss's advantages need ``rollout.n >= 2``.
    * ``single_process``: the mode's state lives in one JAX process.
    * ``eval_with_memory``: evaluation also runs with the memory in the prompt.
    * ``memory_settings``: ``memory.<key>`` values the mode implies (set where the user left
      the default; a conflicting override is an error).
    * ``derive``: other settings it implies, on the ConfigDict before validation.
    * ``check``: its own config errors (the frozen, mode-applied RunConfig -> messages).
    * ``runtime``: builds its :class:`ModeRuntime` ``(cfg, model, task, train_problems,
      eval_problems)``.
    * ``aliases``: other names of the mode (the config holds the canonical one).
    """

    name: str
    doc: str
    teacher: str
    uses_memory: bool = False
    trains_policy: bool = True
    default_loss: str = "sdpo"
    lesson_rows: bool = False
    needs_groups: bool = False
    single_process: bool = False
    eval_with_memory: bool = False
    memory_settings: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    derive: Callable[[ml_collections.ConfigDict], None] | None = None
    # (the config reads this registry, so a spec names the run config's type in its own
    # module: each mode's check and runtime take the frozen RunConfig)
    check: Callable[[Any], list[str]] | None = None
    runtime: Callable[..., ModeRuntime] = _no_runtime
    aliases: tuple[str, ...] = ()

    @property
    def has_teacher(self) -> bool:
        return self.teacher != "none"

    def loss_error(self, loss: Any) -> str | None:
        """Why the registered loss ``loss`` (a LossSpec) cannot train this mode, or None."""
        if loss.lesson_nll and not self.lesson_rows:
            return (f"distill.loss.name={loss.name!r} reads the lesson rows only mode=mel "
                    f"builds; mode={self.name!r}")
        if self.lesson_rows and not loss.lesson_nll:
            return (f"mode={self.name} needs a loss that reads its lesson rows "
                    f"({_names(lambda s: s.lesson_nll)}), got {loss.name!r}")
        if not self.trains_policy:
            return None
        if self.has_teacher and not loss.needs_teacher:
            return (f"mode={self.name!r} needs a loss with a teacher as distill.loss.name "
                    f"({_names(lambda s: s.needs_teacher)}), got {loss.name!r}")
        if not self.has_teacher and loss.needs_teacher:
            return (f"mode={self.name} needs a loss without a teacher as distill.loss.name "
                    f"({_names(lambda s: not s.needs_teacher and not s.lesson_nll)}), "
                    f"got {loss.name!r}")
        return None


def _names(keep: Callable[[Any], bool]) -> str:
    return " or ".join(repr(n) for n in loss_names() if keep(get_loss(n)))


_MODES: dict[str, ModeSpec] = {}
_ALIASES: dict[str, str] = {}
_RANK: dict[str, tuple[int, int]] = {}  # name -> (its module's place in _MODULES, order)
_loaded = False


def register_mode(spec: ModeSpec) -> ModeSpec:
    """Adds ``spec`` (a name or alias taken twice is an error); returns it. The modes are
    listed by their module's place in :data:`_MODULES` (others after), then in the order each
    module registers them, whatever order the modules were imported in."""
    if spec.teacher not in TEACHERS:
        raise ValueError(f"mode {spec.name!r}: teacher={spec.teacher!r} is not one of "
                         f"{TEACHERS}")
    if spec.teacher == "memory" and not spec.uses_memory:
        raise ValueError(f"mode {spec.name!r}: a memory teacher needs uses_memory=True")
    for name in (spec.name, *spec.aliases):
        if name in _MODES or name in _ALIASES:
            raise ValueError(f"mode name {name!r} is registered twice")
    module = sys._getframe(1).f_globals.get("__name__", "")
    rank = _MODULES.index(module) if module in _MODULES else len(_MODULES)
    _RANK[spec.name] = (rank, len(_RANK))
    _MODES[spec.name] = spec
    _ALIASES.update({a: spec.name for a in spec.aliases})
    return spec


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in _MODULES:
            importlib.import_module(module)


def mode_names() -> tuple[str, ...]:
    """The registered modes, in registration order."""
    _load()
    return tuple(sorted(_MODES, key=_RANK.__getitem__))


def aliases() -> dict[str, str]:
    """Other names -> their mode."""
    _load()
    return dict(_ALIASES)


def canonical(name: str) -> str:
    """The mode ``name`` or its alias stands for (unknown names unchanged)."""
    _load()
    return _ALIASES.get(name, name)


def get_mode(name: str) -> ModeSpec:
    """The mode named ``name`` (or an alias of it); unknown names fail listing the known."""
    _load()
    spec = _MODES.get(_ALIASES.get(name, name))
    if spec is None:
        raise ValueError(f"mode={name!r} is not one of {mode_names()} or an alias "
                         f"{tuple(_ALIASES)}")
    return spec


def memory_modes() -> tuple[str, ...]:
    """The modes that keep a procedural memory."""
    return tuple(n for n in mode_names() if _MODES[n].uses_memory)
