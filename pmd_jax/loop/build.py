"""The parts of a run, built from its config: the task, the model (weights, tokenizer, mesh),
the rollout sampler and the procedural memory.

The trainer calls these once at start-up (``Trainer.__init__``); nothing here runs per step.
None of them writes into the run config: run-time values (the tokenizer's control and stop
tokens) go into the memory's own copy of its section (:func:`memory_config`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from pmd_jax.loop.phases import TrainingError
from pmd_jax.memory.memory import ProceduralMemory
from pmd_jax.models import attend, decoder, hf_io
from pmd_jax.models.assets import EMBEDDED_MODELS
from pmd_jax.models.config import from_hf_config, preset
from pmd_jax.models.gguf_io import embedded_hf_dir
from pmd_jax.models.tokenizer import Tokenizer
from pmd_jax.modes import get_mode
from pmd_jax.run import multihost
from pmd_jax.run.sharding import ShardingError, ShardingRules, make_mesh, shard_tree
from pmd_jax.sampling import backends
from pmd_jax.sampling.base import Messages, TextGenerator
from pmd_jax.tasks import sandbox
from pmd_jax.tasks.base import TaskError
from pmd_jax.tasks.code import CodeTask
from pmd_jax.tasks.heldout import eval_overlap, in_sample_message
from pmd_jax.tasks.loader import load_task
from pmd_jax.tasks.registry import task_kwargs as spec_kwargs

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig
    from pmd_jax.memory.config import MemoryConfig
    from pmd_jax.models.config import ModelConfig

log = logging.getLogger("pmd_jax")


def is_main_process() -> bool:
    return jax.process_index() == 0


# ----------------------------------------------------------------------------- task
def task_kwargs(cfg: RunConfig, name: str) -> dict[str, Any]:
    """get_task arguments of task ``name`` from the run config (task.path excluded): the
    task's registered spec builds them (tasks/registry.py)."""

    return spec_kwargs(cfg.task, name, int(cfg.seed))


def build_task(cfg: RunConfig, check_heldout: bool = True, check_sandbox: bool = False):
    """The run's task. With task.eval_task set (another task) a TransferTask: "train" from
    task.name, the evaluation split from task.eval_task (e.g. MBPP -> HumanEval).

    ``check_heldout``: evaluation problems that are also training problems (pmd_jax.tasks.heldout)
    raise TaskError unless eval.allow_in_sample=True; then ``task.eval_in_sample`` is True and
    the evaluation labels its numbers "in-sample".

    ``check_sandbox`` (the trainer's process 0, which grades): a task that runs programs needs
    a working sandbox backend; without one this raises SandboxError naming each backend's
    reason, before any compute. Config validation calls this without it (it runs before
    ``jax.distributed`` is initialised, so nothing here may touch a jax backend)."""

    task = load_task(cfg.task, cfg.seed)
    if check_sandbox and runs_code(task):
        # a machine where no sandbox works fails here, not with every program graded as
        # failed (detect_backend raises and says why)
        log.info("sandbox for model-written code: %s", sandbox.detect_backend())
    if check_heldout:
        overlap, n_eval = eval_overlap(cfg.task, task)
        if overlap and not cfg.eval.allow_in_sample:
            raise TaskError(in_sample_message(cfg, overlap, n_eval))
        task.eval_in_sample = bool(overlap)
        if overlap:
            log.warning("evaluation is IN-SAMPLE: %d of %d evaluation problems are training "
                        "problems (eval.allow_in_sample=True)", len(overlap), n_eval)
    return task


def select_problems(cfg: RunConfig, task: Any) -> tuple[list[Any], list[Any]]:
    """The run's training problems (the first ``task.max_train_problems``; 0: all) and its
    evaluation problems (the first ``task.max_eval_problems`` of ``task.eval_split``)."""
    train = list(task.problems("train"))
    if cfg.task.max_train_problems:
        train = train[: cfg.task.max_train_problems]
    held = list(task.problems(cfg.task.eval_split))[: cfg.task.max_eval_problems]
    log.info("task %s: %d train / %d %s problems", cfg.task.name, len(train), len(held),
             cfg.task.eval_split)
    return train, held


def runs_code(task: Any) -> bool:
    """Whether grading ``task`` (or either side of a TransferTask) runs programs."""

    parts = [task, *(getattr(task, a, None) for a in ("train_task", "eval_task"))]
    return any(isinstance(t, CodeTask) for t in parts)


# ----------------------------------------------------------------------------- model
@dataclasses.dataclass
class ModelBundle:
    cfg: ModelConfig
    params: Any  # initial params (compute dtype), placed on the mesh
    tokenizer: Any
    mesh: Any
    rules: Any

    def encode_chat(self, messages: Messages, enable_thinking: bool = False) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True,
                                          enable_thinking=enable_thinking)

    def encode_prompt(self, messages: Messages, prefix: str = "",
                      enable_thinking: bool = False) -> list[int]:
        """Chat prompt with the generation prompt, then the task's response prefix (if any)."""
        ids = self.encode_chat(messages, enable_thinking=enable_thinking)
        return ids + self.tokenizer.encode(prefix) if prefix else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special=True)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.tokenizer.stop_ids)

    @property
    def pad_id(self) -> int:
        p = self.tokenizer.pad_id
        return int(p if p is not None else self.tokenizer.eos_id or 0)


def build_mesh(cfg: RunConfig):
    mesh = make_mesh({"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor})
    rules = ShardingRules.from_mapping(cfg.mesh.rules.to_dict() if cfg.mesh.rules else None)
    # Every step's rows are split over the batch axes: a batch that does not divide would
    # fail at the first train step, after a step's sampling (before the model is loaded now).
    rows = int(cfg.rollout.problems_per_step) * int(cfg.rollout.n)
    split = int(mesh.shape["data"]) * int(mesh.shape["fsdp"])
    if rows % split:
        raise ShardingError(
            f"rollout.problems_per_step x rollout.n = {rows} rows do not split over the "
            f"mesh's batch axes (data x fsdp = {mesh.shape['data']} x {mesh.shape['fsdp']} = "
            f"{split} devices): make the rows a multiple of {split}, or set mesh.data / "
            "mesh.fsdp (and mesh.tensor) so that data x fsdp divides them")
    return mesh, rules


def attention_options(cfg: RunConfig) -> dict[str, Any]:
    """The ModelConfig attention fields from the run config (model.attention_impl/_chunk)."""
    return {"attention_impl": str(cfg.model.attention_impl),
            "attention_chunk": int(cfg.model.attention_chunk)}


def log_attention_plan(cfg: RunConfig, model_cfg: Any) -> None:
    """Log once, at start-up, which attention implementation model.attention_impl means on
    this backend for the train step's rows and for the sampler (models/attention_select.py)."""

    train_len = int(cfg.rollout.max_prompt_tokens) + int(cfg.rollout.max_tokens)
    packed = str(cfg.train.shared_prefix) != "off"
    for line in attend.plan_lines(model_cfg, train_len=train_len, shared_prefix=packed):
        log.info(line)


def load_model(cfg: RunConfig) -> ModelBundle:
    mesh, rules = build_mesh(cfg)
    t0 = time.perf_counter()
    embedded = EMBEDDED_MODELS.get(cfg.model.source)
    src, model_cfg = source_model_config(cfg)
    if cfg.model.random_init:
        model_cfg, params = _random_model(cfg, mesh, rules)
    else:
        model_cfg, params = hf_io.load_hf_checkpoint(src, cfg=model_cfg, mesh=mesh, rules=rules)
    fmt = None if cfg.model.chat_template == "auto" else cfg.model.chat_template
    if embedded:
        fmt = fmt or embedded.chat_format
    tok = Tokenizer.from_pretrained(src, chat_format=fmt)
    log.info(
        "model %s (%s, %.1fM params) loaded from %s in %.1fs; mesh %s",
        model_cfg.family, cfg.model.source, model_cfg.num_params() / 1e6, src,
        time.perf_counter() - t0, dict(mesh.shape),
    )
    log_attention_plan(cfg, model_cfg)
    return ModelBundle(model_cfg, params, tok, mesh, rules)


def source_model_config(cfg: RunConfig) -> tuple[Path, ModelConfig]:
    """The folder model.source reads from (an embedded model's HF export, made once from
    its GGUF, or the given checkpoint folder) and its ModelConfig with the run's dtypes and
    attention options; no weights are read."""

    embedded = EMBEDDED_MODELS.get(cfg.model.source)
    src = embedded_hf_dir(embedded.name) if embedded else Path(cfg.model.source)
    return src, from_hf_config(hf_io.read_hf_config(src)).replace(
        dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype, **attention_options(cfg))


def _random_model(cfg: RunConfig, mesh: Any, rules: Any):
    mc = preset(cfg.model.random_init).replace(dtype=cfg.model.dtype,
                                               param_dtype=cfg.model.param_dtype,
                                               **attention_options(cfg))
    params = decoder.init_params(mc, jax.random.PRNGKey(int(cfg.seed)))
    return mc, shard_tree(params, mesh, rules, decoder.param_axes(mc))


# ----------------------------------------------------------------------------- sampler
def build_sampler(cfg: RunConfig, model: ModelBundle):
    r = cfg.rollout
    # The KV cache is sized per request bucket; max_len only bounds prompt + generation
    # (reflection prompts can be longer than the task prompts).
    max_len = int(r.max_context or model.cfg.max_position_embeddings)
    need = r.max_prompt_tokens + max(r.max_tokens, cfg.eval.max_tokens)
    if need > max_len:
        raise ValueError(
            f"rollout.max_prompt_tokens + max generation = {need} exceeds the context "
            f"{max_len} (rollout.max_context / the model's max_position_embeddings)"
        )
    return backends.build(r.sampler, cfg, model, max_len)


@dataclasses.dataclass
class Samplers:
    """A run's samplers. ``rollout`` draws the training rollouts; with ``rollout.overlap`` the
    background rollout thread alone uses it, and the memory's reflections and evaluation get
    ``reflect``, a sampler of their own (else the same one). ``leader`` is ``reflect`` as
    process 0 uses it with several processes (``run/multihost.py``: it forwards the generate
    calls to the others); ``textgen`` is ``leader`` at the chat level."""

    rollout: Any
    reflect: Any
    leader: Any
    textgen: Any


def build_samplers(cfg: RunConfig, model: ModelBundle) -> Samplers:
    """The rollout sampler and, with ``rollout.overlap``, the one for the main thread.

    The background thread calls the rollout sampler's ``generate`` while the main thread
    runs the memory update, whose reflections also generate. Rather than a lock (which would
    make every reflection wait for the whole rollout batch, i.e. no overlap during the memory
    update), the in-process JAX sampler gets a second instance for the main thread: it shares
    the compiled programs (cached per model config) and, from the first publish on, the very
    same weight arrays (the trainer's publish hands it the rollout sampler's), so it costs no
    compilation and no weights beyond the initial ones; the two objects share no mutable
    state. The vLLM client holds none beyond the version number (one urllib request per call)
    and the server batches concurrent requests, so it is shared as is."""

    rollout = build_sampler(cfg, model)
    reflect = rollout
    if cfg.rollout.overlap:
        if jax.process_count() > 1:
            raise TrainingError(
                "rollout.overlap=True is single-process only: with several processes the "
                "rollout thread and the train step would issue collectives in an order that "
                "can differ between processes (deadlock); set rollout.overlap=False"
            )
        if backends.get_backend(cfg.rollout.sampler).twin_for_overlap:
            reflect = build_sampler(cfg, model)
    leader = multihost.LeaderSampler(reflect)
    return Samplers(rollout, reflect, leader,
                    TextGenerator(leader, model.encode_chat, model.decode))


# ----------------------------------------------------------------------------- memory
def memory_config(cfg: RunConfig, tokenizer: Any) -> MemoryConfig:
    """The memory's config: the run's ``memory`` section plus what is known only once the
    model is loaded (the tokenizer's control and stop tokens) and the two knobs it takes from
    ``teacher_prompt`` (as ``config.freeze`` derives them). The run config is not changed."""
    tp = cfg.teacher_prompt
    return cfg.memory.with_values({
        "context.extra_control_tokens": list(tokenizer.special_tokens),
        # The memory's replies end at the model's stop tokens, as rollouts do (without them
        # the JAX sampler runs every unconstrained reply to max_tokens: all "truncated").
        "stop_token_ids": [int(t) for t in tokenizer.stop_ids],
        "success_threshold": float(tp.success_threshold),
        "context.feedback_only_without_solution": bool(tp.feedback_only_without_solution),
    })


def build_memory(cfg: RunConfig, model: Any):
    """The run's ProceduralMemory (None for the modes without one: grpo, sdpo)."""
    if not get_mode(cfg.mode).uses_memory:
        return None

    return ProceduralMemory(memory_config(cfg, model.tokenizer))
