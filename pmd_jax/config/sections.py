"""The run config's sections, each knob declared once with its default and help text.

``base_config()`` generates the editable ml_collections ConfigDict from these declarations;
``pmd_jax.config.freeze`` builds the frozen :class:`RunConfig` from it after validation. The
``distill`` and ``memory`` sections are declared next to their packages
(:mod:`pmd_jax.distill.config`, :mod:`pmd_jax.memory.config`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING

import ml_collections

from pmd_jax.config.cache import compilation_cache_errors
from pmd_jax.config.schema import FrozenDict, Section, knob, section, to_config_dict
from pmd_jax.distill.config import MATMUL_DTYPES, DistillConfig
from pmd_jax.memory.config import MemoryConfig
from pmd_jax.models.assets import EMBEDDED_MODELS
from pmd_jax.models.chat import chat_format_names
from pmd_jax.models.config import ATTENTION_IMPLS, PRESETS
from pmd_jax.models.lora import TARGETS, LoraConfig
from pmd_jax.modes import aliases, get_mode, mode_names
from pmd_jax.modes.fast_slow.config import FastSlowConfig
from pmd_jax.modes.mel.config import MelConfig
from pmd_jax.run.footprint import MMAP_THRESHOLD_MAX_MIB
from pmd_jax.sampling.backends import backend_names, get_backend
from pmd_jax.tasks.config import TaskConfig
from pmd_jax.tasks.registry import PROMPT_STYLES, get_spec, task_names

if TYPE_CHECKING:
    from pmd_jax.models.lora import LoraConfig

DEFAULT_COMPILATION_CACHE_DIR = "~/.cache/pmd_jax/jax_cache"
SAMPLERS: tuple[str, ...] = backend_names()  # sampling/backends.py registers them
# train.malloc_mmap_threshold_mib (measured on the embedded default: docs/benchmarks.md)
MMAP_THRESHOLD_DEFAULT_MIB = 4.0


def _need(errs: list[str], cond: bool, msg: str) -> None:
    if not cond:
        errs.append(msg)


@dataclasses.dataclass(frozen=True)
class DryRunConfig(Section):
    """--dry_run (= dry_run.enabled): compile the full-size train step and one sampler decode
    step on abstract arrays."""

    enabled: bool = knob(False, "Run the dry run instead of training.")
    target: str = knob("", "'' (simulated --dry_run_devices) or a hardware target of "
                       "pmd_jax/dry_run/hardware.py (v5p-64, v5e-256, 8xH100, 8xH200): "
                       "per-device memory vs its HBM with a FITS / DOES NOT FIT verdict, and a "
                       "roofline step time (exit 1 when it does not fit).")
    roofline: bool = knob(True, "False: skip the extra loop-free compiles for the step time.")


def _chat_help() -> str:
    return ("auto (the embedded model's, else guessed from the checkpoint's template) | "
            + " | ".join(chat_format_names()) + " (models/chat.py registers them).")


def _mode_help() -> str:
    """The ``mode`` knob's help: every registered mode (pmd_jax/modes) with its aliases and
    what it is, written from the registry."""

    also: dict[str, list[str]] = {}
    for alias, name in aliases().items():
        also.setdefault(name, []).append(alias)
    parts = [f"{n}{' (alias ' + ', '.join(also[n]) + ')' if n in also else ''}: "
             f"{get_mode(n).doc.rstrip('.')}" for n in mode_names()]
    return ("The method, one of the registered modes (pmd_jax/modes; a new one is one file "
            "and one register_mode): " + " | ".join(parts) + ".")


@dataclasses.dataclass(frozen=True)
class ModelConfigSection(Section):
    """The policy model."""

    source: str = knob("smollm2", "An embedded model ('smollm2': SmolLM2-135M-Instruct; "
                       "'qwen2.5-coder-0.5b' and 'qwen2.5-coder-1.5b': Qwen2.5-Coder-0.5B- and "
                       "-1.5B-Instruct, installed with `bash scripts/install.sh --model NAME`), "
                       "a preset name "
                       "(dry runs), or a path to a HF checkpoint folder.")
    preset: str = knob("", "For dry runs: 'olmo3-7b', 'qwen3-8b'.")
    random_init: str = knob("", "Random weights of this preset (e.g. 'tiny-llama') with the "
                            "tokenizer of model.source, for fast tests of the loop; '' = the "
                            "real weights of model.source.")
    dtype: str = knob("float32", "Compute dtype.")
    param_dtype: str = knob("float32", "Parameter dtype.")
    chat_template: str = knob("auto", lambda: _chat_help())
    system_prompt: str = knob("", "Extra system prompt ('' = the task's own).")
    attention_impl: str = knob(
        "auto", "'auto' | 'dense' | 'chunked' | 'cudnn' | 'cudnn_xla' | 'splash'. chunked "
        "(flash-style, pure JAX) never builds [T, S] scores or masks; cudnn = "
        "jax.nn.dot_product_attention on cuDNN (GPU, bf16/fp16), cudnn_xla = the same call on "
        "XLA (any backend, for tests), splash = the Pallas Splash kernel (TPU). auto: cuDNN on "
        "GPU, Splash on TPU where they can express the pass (no KV cache, >= 128 queries; "
        "rules and fallbacks in pmd_jax/models/attention_select.py), otherwise and on CPU "
        "chunked when T * S > 1024^2, else dense. The choice is logged at start-up.")
    attention_chunk: int = knob(512, "Query/key chunk size of chunked attention.")

    def errors(self) -> list[str]:
        m = self

        errs: list[str] = []
        _need(errs, m.attention_impl in ATTENTION_IMPLS,
              f"model.attention_impl={m.attention_impl!r} is not one of {ATTENTION_IMPLS}")
        _need(errs, m.attention_chunk >= 1,
              f"model.attention_chunk must be >= 1, got {m.attention_chunk}")
        _need(errs, not m.random_init or m.random_init in PRESETS,
              f"model.random_init={m.random_init!r} is not a preset {sorted(PRESETS)}")
        _need(errs, m.source in EMBEDDED_MODELS or os.path.isdir(m.source),
              f"model.source={m.source!r} is neither an embedded model "
              f"{sorted(EMBEDDED_MODELS)} nor an existing HF checkpoint folder")
        formats = chat_format_names()
        _need(errs, m.chat_template == "auto" or m.chat_template in formats,
              f"model.chat_template={m.chat_template!r} is not 'auto' or one of {formats}")
        return errs


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
    """The device mesh (-1: the remaining devices)."""

    data: int = knob(1, "Data-parallel axis.")
    fsdp: int = knob(-1, "Fully-sharded data-parallel axis.")
    tensor: int = knob(1, "Tensor-parallel axis.")
    rules: FrozenDict = knob({}, "Logical axis -> mesh axes overrides (set whole, e.g. "
                             "--config.mesh.rules=\"{'vocab': 'fsdp'}\").", mapping=True)

    def errors(self) -> list[str]:
        m = self
        errs: list[str] = []
        for ax in ("data", "fsdp", "tensor"):
            v = getattr(m, ax)
            _need(errs, v == -1 or v >= 1, f"mesh.{ax} must be -1 or >= 1, got {v}")
        return errs


@dataclasses.dataclass(frozen=True)
class RolloutConfig(Section):
    """The rollout sampler and its sampling."""

    sampler: str = knob("jax", lambda: "A sampler backend (sampling/backends.py): "
                        + " | ".join(backend_names()) + ". 'jax' samples in process, 'vllm' "
                        "asks a server.")
    vllm_url: str = knob("http://127.0.0.1:8000", "The vLLM server.")
    vllm_model: str = knob("", "Served model name; '' = the one model the server serves.")
    weight_store: str = knob("", "Tensorstore URL for publishing weights to vLLM.")
    problems_per_step: int = knob(32, "B: problems per step.")
    n: int = knob(8, "G: rollouts per problem.")
    temperature: float = knob(1.0, "Sampling temperature.")
    top_p: float = knob(1.0, "Nucleus sampling mass.")
    top_k: int = knob(0, "Top-k (0 = off).")
    max_prompt_tokens: int = knob(2048, "Student prompt budget.")
    max_tokens: int = knob(8192, "Response budget.")
    max_batch: int = knob(64, "Sampler micro-batch (rows).")
    max_cache_gib: float = knob(0.0, "In-process sampler: KV cache budget of one batch in GiB "
                                "(padded rows x cache slots; the batch plan splits larger "
                                "batches, never a single row); 0 = no budget.")
    max_prefill_tokens: int = knob(8192, "In-process sampler: most padded token positions "
                                   "(rows x length) in one prefill call of several prompts (a "
                                   "prompt alone is never split); bounds the call's memory "
                                   "(its cache, activations, attention scores). 0 = no cap.")
    prefill_matmul_dtype: str = knob("", "In-process sampler: '' = the model's dtype; "
                                     "'bfloat16' / 'float16' = the prefill's weight matmuls "
                                     "take operands of that dtype with float32 accumulation "
                                     "(ours; prefill is compute-bound, the decode steps keep "
                                     "the model's dtype). Rollouts, reflections and "
                                     "evaluations then differ from float32's in the last bits "
                                     "of their prompts' K/V.")
    max_context: int = knob(0, "Prompt + generation limit (0 = the model's context length).")
    retries: int = knob(3, "Sampler request retries.")
    overlap: bool = knob(False, "Sample step k+1's rollouts in a background thread while step "
                         "k's memory update and train step run. Step k+1 then trains on "
                         "rollouts of the weights published after step k-1 (staleness exactly "
                         "1 from the second step on), corrected by the token-level truncated "
                         "IS weights distill.loss.rollout_is_threshold (required); "
                         "rollout_staleness and logp_mismatch_mean/max are logged every step.")

    def errors(self) -> list[str]:
        r = self
        errs: list[str] = []
        names = backend_names()  # (read now: a backend registered after import counts)
        _need(errs, r.sampler in names, f"rollout.sampler={r.sampler!r} not in {names}")
        _need(errs, r.n >= 1, f"rollout.n must be >= 1, got {r.n}")
        _need(errs, r.problems_per_step >= 1, "rollout.problems_per_step must be >= 1")
        _need(errs, r.temperature >= 0, "rollout.temperature must be >= 0")
        _need(errs, 0 < r.top_p <= 1, "rollout.top_p must be in (0, 1]")
        _need(errs, r.max_tokens >= 1, "rollout.max_tokens must be >= 1")
        _need(errs, r.max_batch >= 1, f"rollout.max_batch must be >= 1, got {r.max_batch}")
        _need(errs, r.max_cache_gib >= 0,
              f"rollout.max_cache_gib must be >= 0 (0 = no budget), got {r.max_cache_gib}")
        _need(errs, r.max_prefill_tokens >= 0, "rollout.max_prefill_tokens must be >= 0 "
              f"(0 = no cap), got {r.max_prefill_tokens}")
        _need(errs, r.prefill_matmul_dtype in MATMUL_DTYPES,
              f"rollout.prefill_matmul_dtype={r.prefill_matmul_dtype!r} is not one of "
              f"{MATMUL_DTYPES}")
        _need(errs, r.max_prompt_tokens >= 1,
              f"rollout.max_prompt_tokens must be >= 1, got {r.max_prompt_tokens}")
        _need(errs, r.max_context >= 0,
              f"rollout.max_context must be >= 0 (0 = the model's), got {r.max_context}")
        _need(errs, isinstance(r.overlap, bool),
              f"rollout.overlap must be True or False, got {r.overlap!r}")
        if r.sampler in names:  # (what the backend needs of this section)
            errs.extend(get_backend(r.sampler).rollout_errors(r))
        return errs


@dataclasses.dataclass(frozen=True)
class TeacherPromptConfig(Section):
    """The teacher's prompt (SDPO reprompt); its success threshold and feedback rule also
    apply to the memory (memory.success_threshold, memory.context.feedback_only_...)."""

    max_tokens: int = knob(10240, "SDPO reprompt cap (right truncation).")
    dont_reprompt_on_self_success: bool = knob(True, "A rollout never gets its own attempt "
                                               "as the demonstration.")
    success_threshold: float = knob(1.0, "Reward >= this is a verified success (binary "
                                    "rewards): demonstrations, the memory's successes, the "
                                    "success-rate metric.")
    include_feedback: bool = knob(False, "Show the verifier's feedback to the teacher.")
    feedback_only_without_solution: bool = knob(True, "Show feedback only when no successful "
                                                "attempt is shown (a sibling's or the "
                                                "memory's).")
    extra_demo_samples: int = knob(
        0, "Extra samples per problem and step, drawn from the student prompt and verified but "
        "not trained on; a success among them is the demonstration of the group's rows that "
        "have no sibling's (mode sdpo_matched_sampling: SDPO spending the samples the memory's "
        "check before use may spend). 0: off.")

    def errors(self) -> list[str]:
        t = self
        out = [] if t.max_tokens >= 1 else [
            f"teacher_prompt.max_tokens must be >= 1, got {t.max_tokens}"]
        if t.extra_demo_samples < 0:
            out.append("teacher_prompt.extra_demo_samples must be >= 0")
        return out


PAD_LENGTHS = ("multiple", "max")  # train.pad_lengths (distill.assemble.fixed_lengths)


@dataclasses.dataclass(frozen=True)
class TrainConfig(Section):
    """The loop: steps, evaluation and checkpoint cadence, the update batch."""

    steps: int = knob(100, "Train steps.")
    eval_every: int = knob(10, "0: only at the end; -1: never.")
    eval_at_start: bool = knob(True, "Evaluate before the first step.")
    checkpoint_every: int = knob(10, "Checkpoint cadence (steps).")
    keep_checkpoints: int = knob(1, "Checkpoints kept in run_dir/checkpoints (>= 1): each "
                                 "holds the params, both AdamW moments and the teacher (1.9 GB "
                                 "on the embedded default, 6.6 GB on the 0.5B coder). Orbax "
                                 "deletes the oldest only once the next is committed, so N take "
                                 "N + 1 while one is written (the start-up log gives the bytes; "
                                 "no run starts without room for two). A failed or killed save "
                                 "leaves the last one either way; with 1, a checkpoint found "
                                 "corrupt at resume has none before it to fall back to, and the "
                                 "run starts again from step 0 (the bad one moved to "
                                 "checkpoints/corrupt/).")
    max_nonfinite_in_a_row: int = knob(3, "Stop after this many non-finite steps in a row.")
    export_hf: bool = knob(True, "Export a HF checkpoint at the end.")
    kl_initial_every: int = knob(1, "Measure KL(policy || initial) on the step's rollouts "
                                 "at steps 0, N, 2N, ... (one extra forward of the initial "
                                 "model; with N = train.eval_every, the steps whose policy the "
                                 "evaluations see); 0 = never, and the initial policy is not "
                                 "kept.")
    offload_initial_policy: bool = knob(False, "Keep the initial policy (read only by the KL "
                                        "to it) in a file in the system temp directory, loaded "
                                        "for each measurement, instead of in memory: one copy "
                                        "of the weights less resident (0.50 GiB on the embedded "
                                        "default). Each process keeps its own shards.")
    offload_optimizer_during_kl: bool = knob(False, "Host memory: for the KL forward of the "
                                             "initial policy, write the optimizer state "
                                             "(the AdamW moments, two copies of the weights) "
                                             "to a file in the system temp directory and read "
                                             "it back after, bit for bit; that forward's peak "
                                             "drops by their size (4.7 GiB on the 0.5B coder) "
                                             "for a write and a read per measurement.")
    offload_optimizer_during_grads: bool = knob(False, "Host memory: run the train step as "
                                                "two programs, the gradient then the update, "
                                                "with the optimizer state (the AdamW moments) "
                                                "in a file in the system temp directory while "
                                                "the gradient's forwards and backwards run; "
                                                "the same numbers, and the step's peak drops "
                                                "by the moments and the clipped gradient "
                                                "(15.8 -> 11.7 GiB of arrays on the 0.5B "
                                                "coder, docs/results.md) for a write and a "
                                                "read of the moments per step (ours).")
    drop_unsignaled_rows: bool = knob(True, "SDPO/PMD: leave the rollouts whose teacher got no "
                                      "signal (sd_mask 0) out of the update batch; the loss "
                                      "and gradient are unchanged, the step is cheaper (ours).")
    clear_compiled_every: int = knob(0, "Host memory: drop jax's in-memory compiled programs "
                                     "every N steps (footprint.drop_compiled), so that the "
                                     "programs of past batch shapes do not pile up; those needed "
                                     "again come from train.compilation_cache_dir. 0 = never.")
    shared_prefix: str = knob("auto", "The train step's forwards (and the KL to the initial "
                              "policy): the rollouts of one prompt in one row, their common "
                              "prompt prefix forwarded once (distill/shared_prefix.py; same "
                              "loss and gradient up to float rounding). 'auto': where that "
                              "costs fewer estimated FLOPs; 'always'; 'off': one row per "
                              "rollout. Not with train.microbatch_rows (ours).")
    pad_lengths: str = knob("multiple", "The train step's sequence lengths: 'multiple' pads "
                            "each step's rows to the longest, rounded up to 16 tokens (a step "
                            "program per new length); 'max' pads every step to the configured "
                            "maxima (student rollout.max_prompt_tokens + rollout.max_tokens, "
                            "teacher teacher_prompt.max_tokens + rollout.max_tokens, response "
                            "rollout.max_tokens, each rounded up to 16: the dry run's worst "
                            "case), "
                            "so a run compiles its step once per update-row count, as MaxText "
                            "and Tunix pad to fixed lengths. Needs train.shared_prefix='off' "
                            "(packed rows have no fixed length).")
    microbatch_rows: int = knob(0, "Gradient accumulation: split the update batch into "
                                "microbatches of this many rows inside one jitted step (grads "
                                "summed with full-batch normalisation, one optimizer update); "
                                "activation memory is that of one microbatch. 0 = off.")
    malloc_mmap_threshold_mib: float = knob(
        MMAP_THRESHOLD_DEFAULT_MIB, "Host memory (glibc): C-heap blocks of at least this many "
        "MiB get their own mmap and go back to the kernel when freed, instead of staying "
        "resident in the heap (footprint.set_mmap_threshold). Lower: a smaller peak RSS, "
        "more page faults. 0 = glibc's dynamic default (up to 32 MiB).")
    compilation_cache_dir: str = knob(
        DEFAULT_COMPILATION_CACHE_DIR, "Persistent XLA compilation cache (jax's): a restarted "
        "run loads its compiled programs instead of compiling them again. '~' is expanded; "
        "'' or 'none' disables it. An already-set JAX_COMPILATION_CACHE_DIR (or "
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS / JAX_COMPILATION_CACHE_MAX_SIZE) "
        "environment variable takes precedence.")
    compilation_cache_min_compile_secs: float = knob(1.0, "Only programs whose compile took at "
                                                     "least this long are written (jax's "
                                                     "default 1.0 s).")
    compilation_cache_max_gib: float = knob(4.0, "Disk bound: least-recently-used entries are "
                                            "evicted past this size; -1 = unbounded.")

    def errors(self) -> list[str]:
        t = self
        errs: list[str] = []
        _need(errs, t.steps >= 0, "train.steps must be >= 0")
        _need(errs, t.checkpoint_every >= 1, "train.checkpoint_every must be >= 1")
        _need(errs, t.keep_checkpoints >= 1,
              f"train.keep_checkpoints must be >= 1, got {t.keep_checkpoints}")
        _need(errs, t.eval_every >= -1, "train.eval_every must be >= -1 (-1 = no evaluation)")
        _need(errs, t.pad_lengths in PAD_LENGTHS,
              f"train.pad_lengths must be one of {PAD_LENGTHS}, got {t.pad_lengths!r}")
        _need(errs, t.pad_lengths != "max" or t.shared_prefix == "off",
              f"train.pad_lengths='max' needs train.shared_prefix='off' (got "
              f"{t.shared_prefix!r}): rows that pack a prompt's rollouts have no fixed length")
        _need(errs, t.clear_compiled_every >= 0,
              f"train.clear_compiled_every must be >= 0 (0 = never), got {t.clear_compiled_every}")
        _need(errs, isinstance(t.malloc_mmap_threshold_mib, int | float)
              and 0 <= t.malloc_mmap_threshold_mib <= MMAP_THRESHOLD_MAX_MIB,
              f"train.malloc_mmap_threshold_mib must be in [0, {MMAP_THRESHOLD_MAX_MIB}] "
              f"(glibc's bound; 0 = its dynamic default), got {t.malloc_mmap_threshold_mib!r}")
        return errs + compilation_cache_errors(t)


@dataclasses.dataclass(frozen=True)
class EvalConfig(Section):
    """Held-out evaluation."""

    n: int = knob(4, "Samples per problem.")
    temperature: float = knob(0.6, "Sampling temperature.")
    top_p: float = knob(0.95, "Nucleus sampling mass.")
    max_tokens: int = knob(1024, "Response budget.")
    seeds: tuple[int, ...] = knob((0,), "Sampling seeds (one evaluation pass each).")
    allow_in_sample: bool = knob(False, "Evaluation problems that are also training problems "
                                 "are refused, unless this is True; then every evaluation "
                                 "number of the run is labelled 'in-sample'.")
    retention: bool = knob(False, "Forgetting: at every evaluation point also evaluate the "
                           "policy (memory-free) on an off-task retention set, reported beside "
                           "the task accuracy as retention_accuracy with its CI "
                           "(pmd_jax/loop/retention.py).")
    retention_task: str = knob("", "The retention set's task; '' = the default for the run's "
                               "task: SciQ for code runs, MMLU (mmlu_science) for the others "
                               "(FST / MEL measure forgetting on an unrelated benchmark).")
    retention_prompt_style: str = knob(
        "", "How the retention set is asked: '' = the run's task.prompt_style when the "
        "retention task has that style (so a model trained to answer in one format is not "
        "scored at the floor for another), else that task's default; or a style of it "
        "(reasoning | direct | direct_text).")
    retention_size: int = knob(200, "Questions in the retention set (a seeded draw from the "
                               "retention task's evaluation split, the same in every run).")
    retention_seed: int = knob(0, "Seed of the retention draw (not the run seed: every cell of "
                               "a grid sees the same questions).")
    kl_final: bool = knob(True, "KL(policy || initial) at the evaluation after the last step, "
                          "on one extra rollout batch sampled with the final weights (the "
                          "other evaluation points take the KL of their step's rollouts; "
                          "needs train.kl_initial_every > 0; skipped when the weights never "
                          "change, mode pmd_frozen_policy).")
    reuse_from: str = knob(
        "", "A folder of other runs (a grid's scratch folder): the step-0 evaluation is "
        "taken from one whose evaluation key (a hash of the initial weights, the model, "
        "rollout, eval and task sections and the evaluated prompts) equals this run's, "
        "instead of being run again; a run with it set writes its own key for the others. "
        "Memory-free evaluation only; '' = always evaluate (pmd_jax/loop/eval_reuse.py).")

    def errors(self) -> list[str]:
        e = self
        errs: list[str] = []
        _need(errs, e.max_tokens >= 1, f"eval.max_tokens must be >= 1, got {e.max_tokens}")
        _need(errs, e.n >= 1, "eval.n must be >= 1")
        if e.retention:
            errs.extend(_retention_errors(e))
        return errs


def _retention_errors(e: EvalConfig) -> list[str]:
    """Problems of the ``eval.retention*`` knobs (``pmd_jax.loop.retention`` builds the set)."""
    errs: list[str] = []
    style = getattr(e, "retention_prompt_style", "")
    if not isinstance(style, str) or (style and style not in PROMPT_STYLES):
        errs.append(f"eval.retention_prompt_style={style!r} must be '' (the run's "
                    f"task.prompt_style where the retention task has it) or one of "
                    f"{PROMPT_STYLES}")
    elif style and e.retention_task in task_names() and style not in get_spec(
            e.retention_task).prompt_styles:
        errs.append(f"eval.retention_prompt_style={style!r} is not a style of "
                    f"eval.retention_task={e.retention_task!r} (it has "
                    f"{tuple(get_spec(e.retention_task).prompt_styles) or 'none'})")
    size, seed = e.retention_size, e.retention_seed
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        errs.append(f"eval.retention_size must be an int >= 1, got {size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        errs.append(f"eval.retention_seed must be an int, got {seed!r}")
    name = e.retention_task
    if not isinstance(name, str) or (name and name not in task_names()):
        errs.append(f"eval.retention_task={name!r} must be '' (the off-task default) or a "
                    f"known task: {', '.join(task_names())}")
    elif name and get_spec(name).needs_path:
        errs.append(f"eval.retention_task={name!r} reads a user file (task.path is the "
                    "training task's); pick a shipped task")
    return errs


# lora.base_dtype: '' = model.param_dtype (the loaded weights as they are, no copy)
LORA_BASE_DTYPES: tuple[str, ...] = ("", "float32", "bfloat16")
# PEFT's target_modules value for every linear layer but the LM head: our seven targets
LORA_ALL_LINEAR = "all-linear"


@dataclasses.dataclass(frozen=True)
class LoraSection(Section):
    """LoRA (issue 51, pmd_jax/models/lora.py): train low-rank adapters of the projections
    over a frozen base instead of every weight; PEFT's knob names. Full fine-tuning (off)
    stays the default. The optimizer, the EMA teacher and the checkpoints hold the adapters
    only; the KL to the initial policy is the base itself (the forward with the adapters off);
    the sampler and the HF export get the merged weights, and the export adds a PEFT adapter
    folder (final_peft/). A mode that never trains the policy (pmd_frozen_policy) ignores it."""

    enabled: bool = knob(False, "Train LoRA adapters instead of the full weights.")
    r: int = knob(16, "Rank of each adapter (PEFT's r).")
    alpha: float = knob(32.0, "PEFT's lora_alpha: the adapter path is scaled by alpha / r "
                        "(alpha / sqrt(r) with use_rslora).")
    target_modules: tuple[str, ...] = knob(
        ("q", "k", "v", "o", "gate", "up", "down"),
        "The projections that get adapters: our names (q, k, v, o, gate, up, down) or PEFT's "
        "(q_proj, ..., down_proj); 'all-linear' (PEFT) = all seven. The embedding, norms and "
        "LM head are never adapted.", as_list=True)
    use_rslora: bool = knob(False, "rsLoRA scaling alpha / sqrt(r) (PEFT's use_rslora).")
    base_dtype: str = knob("", "Storage dtype of the frozen base in the train step: '' = "
                           "model.param_dtype (the loaded weights, no copy); 'bfloat16' keeps "
                           "it in bf16 (half the bytes; each layer's weights are cast to the "
                           "compute dtype in the forward). The adapters, their AdamW moments "
                           "and the teacher's adapters follow distill.precision.")

    def targets(self) -> tuple[str, ...]:
        """target_modules as our target names (PEFT's ``*_proj`` and 'all-linear' read)."""

        out: list[str] = []
        for m in self.target_modules:
            names = TARGETS if m == LORA_ALL_LINEAR else (str(m).removesuffix("_proj"),)
            out += [n for n in names if n not in out]
        return tuple(out)

    def config(self) -> LoraConfig | None:
        """The :class:`pmd_jax.models.lora.LoraConfig` of these knobs (None when disabled)."""

        if not self.enabled:
            return None
        return LoraConfig(rank=self.r, alpha=self.alpha, targets=self.targets(),
                          use_rslora=self.use_rslora)

    def errors(self) -> list[str]:
        errs: list[str] = []
        _need(errs, isinstance(self.enabled, bool),
              f"lora.enabled must be True or False, got {self.enabled!r}")
        _need(errs, isinstance(self.r, int) and not isinstance(self.r, bool) and self.r >= 1,
              f"lora.r must be an integer >= 1, got {self.r!r}")
        a = self.alpha
        _need(errs, isinstance(a, int | float) and not isinstance(a, bool)
              and math.isfinite(a) and a > 0,
              f"lora.alpha must be a finite number > 0, got {a!r}")
        known = set(TARGETS) | {f"{t}_proj" for t in TARGETS} | {LORA_ALL_LINEAR}
        mods = self.target_modules
        bad = [m for m in mods if m not in known]
        _need(errs, not bad, f"lora.target_modules: unknown {bad}; use names from "
              f"{list(TARGETS)} (or PEFT's q_proj ... down_proj, or 'all-linear')")
        _need(errs, len(mods) > 0, "lora.target_modules must name at least one projection")
        _need(errs, isinstance(self.use_rslora, bool),
              f"lora.use_rslora must be True or False, got {self.use_rslora!r}")
        _need(errs, self.base_dtype in LORA_BASE_DTYPES,
              f"lora.base_dtype={self.base_dtype!r} is not one of {LORA_BASE_DTYPES}")
        return errs


@dataclasses.dataclass(frozen=True)
class RunConfig(Section):
    """The whole run: built by ``pmd_jax.config.freeze`` from the validated ConfigDict."""

    name: str = knob("run", "Run name.")
    mode: str = knob("pmd", lambda: _mode_help())
    seed: int = knob(0, "Run seed.")
    run_dir: str = knob("runs/default", "Run folder (local, or gs:// / s3:// / az://).")
    resume: bool = knob(True, "Continue from the last checkpoint in run_dir if there is one.")
    dry_run: DryRunConfig = section(DryRunConfig, "Dry run.")
    model: ModelConfigSection = section(ModelConfigSection, "The model.")
    mesh: MeshConfig = section(MeshConfig, "The mesh.")
    task: TaskConfig = section(TaskConfig, "The task.")
    rollout: RolloutConfig = section(RolloutConfig, "Rollouts.")
    teacher_prompt: TeacherPromptConfig = section(TeacherPromptConfig, "The teacher's prompt.")
    train: TrainConfig = section(TrainConfig, "The loop.")
    eval: EvalConfig = section(EvalConfig, "Evaluation.")
    distill: DistillConfig = section(DistillConfig, "The distillation step.")
    memory: MemoryConfig = section(MemoryConfig, "The procedural memory.")
    mel: MelConfig = section(MelConfig, "mode=mel: Meta-Experience Learning (pmd_jax/modes/mel).")
    fast_slow: FastSlowConfig = section(FastSlowConfig, "mode=fast_slow: Fast-Slow Training "
                                        "(pmd_jax/modes/fast_slow).")
    lora: LoraSection = section(LoraSection, "LoRA adapters instead of full fine-tuning.")


def base_config() -> ml_collections.ConfigDict:
    """The editable ConfigDict of every default (config files start from it)."""
    return to_config_dict(RunConfig(), derived=False)
