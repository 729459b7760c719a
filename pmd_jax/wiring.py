"""Builds the parts of a run from its config and moves data between them.

The trainer calls these functions; each one is small glue between two packages (tasks ->
memory records, memory -> teacher prompts -> aligned batch -> train step, train state ->
sampler). Nothing numeric happens here beyond host-side bookkeeping.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pmd_jax import update_rows
from pmd_jax.config import MEMORY_MODES
from pmd_jax.data import select_demonstrations
from pmd_jax.sampling.base import Messages, SamplingParams, TextGenerator

log = logging.getLogger("pmd_jax")

PMD_MODES = MEMORY_MODES  # the modes with a procedural memory (config.MEMORY_MODES)


def is_main_process() -> bool:
    import jax

    return jax.process_index() == 0


# ----------------------------------------------------------------------------- task / model
class _TaskNamed:
    """cfg.task seen as the section of task ``name`` (for registry.config_kwargs)."""

    def __init__(self, task_cfg: Any, name: str) -> None:
        self.name, self.get = name, task_cfg.get


def task_kwargs(cfg: Any, name: str) -> dict[str, Any]:
    """get_task arguments of task ``name`` from the run config (task.path excluded)."""
    from pmd_jax.tasks.registry import config_kwargs

    t, kw = cfg.task, {}
    if name in ("sciq", "mmlu_science", "sciknoweval"):
        kw["seed"] = int(cfg.seed)
        kw["prompt_style"] = t.prompt_style
    if name == "sciq":
        kw["valid_fraction"] = float(t.valid_fraction)
        kw["include_support"] = bool(t.include_support)
    # Held-out splits (pmd_jax.heldout): SciQ / SciKnowEval / MBPP / GSM8K problem permutation.
    split_seed = int(t.get("split_seed", 42))
    if name in ("sciq", "sciknoweval", "gsm8k"):
        kw["split_seed"] = split_seed
    if name == "mbpp":
        kw.update(train_size=int(t.get("mbpp_train_size", 400)),
                  eval_size=int(t.get("mbpp_eval_size", 100)), problem_seed=split_seed)
    if name == "gsm8k":
        kw.update(train_size=int(t.get("gsm8k_train_size", 1000)),
                  eval_size=int(t.get("gsm8k_eval_size", 319)), prompt_style=t.prompt_style)
    kw.update(config_kwargs(_TaskNamed(t, name), int(cfg.seed)))  # jsonl_*, SciKnowEval, shuffle
    return kw


def build_task(cfg: Any, check_heldout: bool = True):
    """The run's task. With task.eval_task set (another task) a TransferTask: "train" from
    task.name, the evaluation split from task.eval_task (e.g. MBPP -> HumanEval).

    ``check_heldout``: evaluation problems that are also training problems (pmd_jax.heldout)
    raise TaskError unless eval.allow_in_sample=True; then ``task.eval_in_sample`` is True and
    the evaluation labels its numbers "in-sample"."""
    from pmd_jax.tasks.registry import get_task
    from pmd_jax.tasks.splits import TransferTask

    kw = task_kwargs(cfg, cfg.task.name)
    if cfg.task.path:
        kw["path"] = cfg.task.path
    task = get_task(cfg.task.name, **kw)
    eval_name = str(cfg.task.get("eval_task", "") or "")
    if eval_name and eval_name != cfg.task.name:
        task = TransferTask(task, get_task(eval_name, **task_kwargs(cfg, eval_name)))
    if check_heldout:
        from pmd_jax.heldout import eval_overlap, in_sample_message
        from pmd_jax.tasks.base import TaskError

        overlap, n_eval = eval_overlap(cfg, task)
        if overlap and not cfg.eval.get("allow_in_sample", False):
            raise TaskError(in_sample_message(cfg, overlap, n_eval))
        task.eval_in_sample = bool(overlap)
        if overlap:
            log.warning("evaluation is IN-SAMPLE: %d of %d evaluation problems are training "
                        "problems (eval.allow_in_sample=True)", len(overlap), n_eval)
    return task


@dataclasses.dataclass
class ModelBundle:
    cfg: Any  # ModelConfig
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


def build_mesh(cfg: Any):
    from pmd_jax.sharding import ShardingRules, make_mesh

    mesh = make_mesh({"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor})
    rules = ShardingRules.from_mapping(cfg.mesh.rules.to_dict() if cfg.mesh.rules else None)
    return mesh, rules


def attention_options(cfg: Any) -> dict[str, Any]:
    """The ModelConfig attention fields from the run config (model.attention_impl/_chunk)."""
    return {"attention_impl": str(cfg.model.get("attention_impl", "auto")),
            "attention_chunk": int(cfg.model.get("attention_chunk", 512))}


def load_model(cfg: Any) -> ModelBundle:
    from pmd_jax.models import hf_io
    from pmd_jax.models.config import from_hf_config
    from pmd_jax.models.gguf_io import smollm2_hf_dir
    from pmd_jax.models.tokenizer import Tokenizer

    mesh, rules = build_mesh(cfg)
    t0 = time.perf_counter()
    src = smollm2_hf_dir() if cfg.model.source == "smollm2" else Path(cfg.model.source)
    model_cfg = from_hf_config(hf_io.read_hf_config(src)).replace(
        dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype, **attention_options(cfg)
    )
    if cfg.model.random_init:
        model_cfg, params = _random_model(cfg, mesh, rules)
    else:
        model_cfg, params = hf_io.load_hf_checkpoint(src, cfg=model_cfg, mesh=mesh, rules=rules)
    fmt = None if cfg.model.chat_template == "auto" else cfg.model.chat_template
    if cfg.model.source == "smollm2":
        fmt = fmt or "chatml"
    tok = Tokenizer.from_pretrained(src, chat_format=fmt)
    log.info(
        "model %s (%s, %.1fM params) loaded from %s in %.1fs; mesh %s",
        model_cfg.family, cfg.model.source, model_cfg.num_params() / 1e6, src,
        time.perf_counter() - t0, dict(mesh.shape),
    )
    return ModelBundle(model_cfg, params, tok, mesh, rules)


def _random_model(cfg: Any, mesh: Any, rules: Any):
    import jax

    from pmd_jax.models import decoder
    from pmd_jax.models.config import preset
    from pmd_jax.sharding import shard_tree

    mc = preset(cfg.model.random_init).replace(dtype=cfg.model.dtype,
                                               param_dtype=cfg.model.param_dtype,
                                               **attention_options(cfg))
    params = decoder.init_params(mc, jax.random.PRNGKey(int(cfg.seed)))
    return mc, shard_tree(params, mesh, rules, decoder.param_axes(mc))


def build_sampler(cfg: Any, model: ModelBundle):
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
    if r.sampler == "jax":
        from pmd_jax.sampling.jax_sampler import JaxSampler

        # The tokenizer serves constrained requests (SamplingParams.json_schema).
        return JaxSampler(model.cfg, model.params, mesh=model.mesh, rules=model.rules,
                          max_len=max_len, pad_id=model.pad_id, max_batch=r.max_batch,
                          tokenizer=model.tokenizer)
    from pmd_jax.sampling.vllm_client import VLLMSampler

    return VLLMSampler(r.vllm_url, r.vllm_model or None, store_url=r.weight_store,
                       vocab_size=model.cfg.vocab_size, max_model_len=max_len)


# ----------------------------------------------------------------------------- memory
def build_memory(cfg: Any, model: ModelBundle):
    if cfg.mode not in PMD_MODES:
        return None
    from pmd_jax.memory.memory import ProceduralMemory

    mc = cfg.memory
    with mc.unlocked():
        mc.context.extra_control_tokens = list(model.tokenizer.special_tokens)
        # The memory's replies end at the model's stop tokens, as rollouts do (without them
        # the JAX sampler runs every unconstrained reply to max_tokens: all "truncated").
        mc.stop_token_ids = [int(t) for t in model.tokenizer.stop_ids]
        mc.success_threshold = float(cfg.teacher_prompt.success_threshold)
        if cfg.mode == "pmd_frozen_memory" and mc.frozen_after_step < 0:
            # "memory built once, then fixed": the first fifth of the run builds it (ours).
            mc.frozen_after_step = max(0, cfg.train.steps // 5 - 1)
    return ProceduralMemory(mc)


def update_memory(cfg: Any, memory: Any, step: int, sb: Any, task: Any,
                  textgen: TextGenerator) -> dict[str, Any]:
    from pmd_jax.memory.types import RolloutRecord

    records = []
    for r, text, res in zip(sb.rollouts, sb.texts, sb.results, strict=True):
        p = sb.problems[r.prompt_index]
        records.append(RolloutRecord(
            problem_id=str(p.id), problem_text=_user_text(task.prompt(p)), step=int(step),
            rollout_index=int(r.sample_index), response_text=text, reward=float(res.reward),
            feedback=res.feedback or "", leak_strings=list(task.gold_leak_strings(p)),
        ))
    st = memory.update(step, records, textgen)
    out: dict[str, Any] = {"reflect_seconds": st.seconds.get("generation", 0.0),
                           "memory_frozen": float(st.frozen)}
    for k, v in st.counts.items():
        out[f"memory_{k}"] = float(v)
    s = memory.stats()
    out["memory_experiences"] = float(s.get("experience_records", 0))
    out["memory_insights"] = float(s.get("strategies", 0) + s.get("lessons", 0))
    out["memory_behaviors"] = float(s.get("behaviors", 0))
    for k in ("strategies", "lessons", "clusters"):  # the levels' parts, for the size plot
        out[f"memory_{k}"] = float(s.get(k, 0))
    return out


def response_prefix(task: Any, problem: Any) -> str:
    fn = getattr(task, "response_prefix", None)
    return fn(problem) if fn is not None else ""


def _user_text(messages: Messages) -> str:
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise ValueError("task prompt has no user message")
    return users[-1]


def teacher_messages(student_messages: Messages, user_text: str) -> Messages:
    """The teacher conversation: system messages kept, the user turn replaced (SDPO 1.5)."""
    out = [dict(m) for m in student_messages if m["role"] == "system"]
    out.append({"role": "user", "content": user_text})
    return out


def build_teacher_contexts(cfg: Any, model: ModelBundle, task: Any, memory: Any,
                           sb: Any) -> list[Any]:
    """One TeacherContext per rollout (prompt-major), following the mode's rules."""
    from pmd_jax.memory.context import TeacherContext
    from pmd_jax.memory.sanitize import sanitize_text

    tp = cfg.teacher_prompt
    g = cfg.rollout.n
    demos = select_demonstrations(sb.rewards, tp.success_threshold,
                                  tp.dont_reprompt_on_self_success)
    extra = tuple(model.tokenizer.special_tokens)
    out = []
    for idx, r in enumerate(sb.rollouts):
        i, j = r.prompt_index, r.sample_index
        p = sb.problems[i]
        user = _user_text(task.prompt(p))
        d = demos[i, j]
        sibling = sb.texts[i * g + d] if d >= 0 else None
        fb = sb.results[idx].feedback if tp.include_feedback else None
        if fb and tp.feedback_only_without_solution and sibling:
            fb = None
        if memory is not None:
            ctx = memory.teacher_context(str(p.id), user, sibling, fb,
                                         student_response=sb.texts[idx])
        else:  # sdpo: the reprompt template with only the demonstration and feedback
            succ = sanitize_text(sibling, 6000, extra, drop_thinking=True) if sibling else None
            ctx = TeacherContext(
                problem_text=user, successful_attempt=succ or None,
                successful_attempt_source="sibling" if succ else None,
                feedback=sanitize_text(fb, 2000, extra) if fb else None, signal_rule="sdpo",
                max_tokens=int(tp.max_tokens),
            )
        out.append(ctx)
    return out


def build_train_batch(cfg: Any, model: ModelBundle, task: Any, memory: Any,
                      sb: Any) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    from pmd_jax.distill import align
    from pmd_jax.distill.step import make_batch

    responses = [r.tokens.tolist() for r in sb.rollouts]
    students = [sb.student_prompts[r.prompt_index] for r in sb.rollouts]
    sampler_logp = [r.logprobs for r in sb.rollouts]
    stats: dict[str, float] = {}
    if cfg.mode == "grpo":
        teachers = students
        sd = np.ones(len(responses), np.float32)
    else:
        ctxs = build_teacher_contexts(cfg, model, task, memory, sb)
        budget = int(min(cfg.teacher_prompt.max_tokens, cfg.memory.context.max_tokens)
                     if memory is not None else cfg.teacher_prompt.max_tokens)
        teachers, sd = [], np.zeros(len(responses), np.float32)
        src = {"sibling": 0, "memory": 0}
        for k, (ctx, r) in enumerate(zip(ctxs, sb.rollouts, strict=True)):
            text = ctx.render(model.count_tokens, budget)
            prob = sb.problems[r.prompt_index]
            msgs = teacher_messages(task.prompt(prob), text)
            teachers.append(model.encode_prompt(msgs, response_prefix(task, prob)))
            sd[k] = float(ctx.has_signal)
            if ctx.successful_attempt_source in src:
                src[ctx.successful_attempt_source] += 1
        n = max(1, len(ctxs))
        stats = {
            "reprompt_sample_fraction": float(sd.mean()),
            "demo_from_sibling_fraction": src["sibling"] / n,
            "demo_from_memory_fraction": src["memory"] / n,
            "teacher_prompt_tokens_mean": float(np.mean([len(t) for t in teachers])),
        }
    r_max = max(1, max(len(x) for x in responses))
    db = align.build_distill_batch(
        students, teachers, responses, pad_id=model.pad_id, pad_side="right",
        pad_to_multiple=16, max_response_len=_round_up(r_max, 16),
    )
    rl = db.responses.shape[1]
    logp = np.zeros((len(responses), rl), np.float32)
    for k, lp in enumerate(sampler_logp):
        logp[k, : len(lp)] = lp
    # One update per rollout batch (METHOD 1.3): the old policy is the current one, so no
    # old_logp (the step takes logp.detach(), ratio 1); the sampler/trainer gap is corrected
    # by the truncated rollout IS weights from sampler_logp alone (passing the sampler's
    # log-probs as old_logp too would apply that ratio twice).
    batch = make_batch(db, sd_mask=sd, sampler_logp=logp,
                       rewards=sb.rewards.reshape(-1).astype(np.float32))
    stats["student_tokens_mean"] = float(np.mean([len(s) + len(x)
                                                  for s, x in zip(students, responses,
                                                                  strict=True)]))
    return batch, stats


_round_up = update_rows.round_up


# ----------------------------------------------------------------------------- training
@dataclasses.dataclass
class TrainBundle:
    step_fn: Any  # distill.step.TrainStep
    state: Any  # distill.step.TrainState
    initial_params: Any  # for KL(policy || initial) at eval (None to skip)


def init_train_state(cfg: Any, model: ModelBundle) -> TrainBundle:
    from pmd_jax.distill.step import TrainStep

    ts = TrainStep(model.cfg, cfg.distill, mesh=model.mesh, rules=model.rules,
                   microbatch_rows=int(cfg.train.get("microbatch_rows", 0)))
    state = ts.init(model.params, rng=int(cfg.seed))
    return TrainBundle(ts, state, model.params)


def train_step(bundle: TrainBundle, batch: dict[str, np.ndarray]) -> dict[str, float]:
    import jax

    sh = bundle.step_fn.batch_shardings(batch)
    if sh is not None and jax.process_count() > 1:
        # Every process holds the same global host batch; jit refuses numpy inputs with
        # shardings that span processes, so place them first (each process its own shards).
        batch = {k: jax.device_put(v, sh[k]) for k, v in batch.items()}
    bundle.state, metrics = bundle.step_fn.step(bundle.state, batch)
    return {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}


_KL_FNS: dict[Any, Any] = {}


def kl_to_initial(cfg: Any, model: ModelBundle, bundle: TrainBundle,
                  batch: dict[str, np.ndarray]) -> float:
    """KL(policy || initial model) on this step's rollouts, sampled-token estimator.

    The rollouts were sampled from the policy, so the mean over response tokens of
    ``log pi(y_t) - log pi_0(y_t)`` (the sampler's log-probs minus the initial model's, at the
    sampling temperature) estimates the sequence-level KL per token. One extra forward.
    """
    import jax

    from pmd_jax.distill import align
    from pmd_jax.distill.chunked import chunked_token_logprobs
    from pmd_jax.models import decoder

    mc = model.cfg
    temp = float(cfg.distill.loss.temperature)
    key = (mc, temp)
    if key not in _KL_FNS:
        def fn(params, tokens, positions, mask, index, responses):
            h, _ = decoder.forward(params, tokens, positions, mc, attn_mask=mask,
                                   return_hidden=True)
            h = align.gather_response(h, index)
            return chunked_token_logprobs(h, decoder.unembed_matrix(params, mc), responses,
                                          temp)

        _KL_FNS[key] = jax.jit(fn)
    from pmd_jax.multihost import to_host

    lp0 = to_host(_KL_FNS[key](  # (gathered when sharded over several processes)
        bundle.initial_params, batch["student_tokens"], batch["student_positions"],
        batch["student_attn_mask"], batch["student_index"], batch["responses"]))
    m = batch["response_mask"].astype(np.float64)
    diff = (batch["sampler_logp"] - lp0) * m
    return float(diff.sum() / max(m.sum(), 1.0))


def current_params(cfg: Any, bundle: TrainBundle) -> Any:
    from pmd_jax.distill.step import compute_params

    return compute_params(bundle.state, cfg.distill)


def publish(cfg: Any, sampler: Any, bundle: TrainBundle, step: int, copy: bool = False) -> None:
    """Hand the current weights to the sampler (in-process, or a tensorstore version).

    In process the sampler may get the train state's own arrays, which the next (donating)
    train step deletes; ``copy=True`` gives it a copy it keeps while training runs
    (rollout.overlap samples during the train step)."""
    params = current_params(cfg, bundle)
    if hasattr(sampler, "set_params"):
        if copy:
            import jax
            import jax.numpy as jnp

            # A sampler that splits the layers (JaxSampler.unstack_layers) already makes new
            # per-layer arrays; only the other leaves need their own copy.
            skip = "layers" if getattr(sampler, "unstack_layers", False) else None
            params = {k: v if k == skip else jax.tree.map(jnp.copy, v)
                      for k, v in params.items()}
        sampler.set_params(params, version=int(step))
        return
    from pmd_jax.models.hf_io import iter_hf_tensors
    from pmd_jax.sampling.weight_store import WeightStore

    url = cfg.rollout.weight_store
    store = _STORES.get(url) or _STORES.setdefault(url, WeightStore(url))
    store.publish(dict(iter_hf_tensors(params, bundle.step_fn.model_cfg)), version=int(step),
                  step=int(step))
    sampler.set_weights(int(step))


_STORES: dict[str, Any] = {}


# ----------------------------------------------------------------------------- checkpoints
class RunCheckpointer:
    """Train state + the memory and data-cursor slots, through pmd_jax.checkpoint."""

    def __init__(self, run_dir: Path, keep: int) -> None:
        from pmd_jax.checkpoint import Checkpointer

        self.ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=keep,
                                 slots=("memory", "data_cursor", "trainer", "prefetch"))

    def save(self, step: int, bundle: TrainBundle, extras: dict[str, Any]) -> None:
        mem = extras.get("memory")
        slots = {
            "data_cursor": extras["data_cursor"],
            "trainer": {"step": int(step),
                        "nonfinite_in_a_row": int(extras.get("nonfinite_in_a_row", 0)),
                        "skipped_long_prompts": int(extras.get("skipped_long_prompts", 0))},
            "memory": pickle.dumps(mem, protocol=5) if mem is not None else None,
            # rollout.overlap: the next step's rollouts, already sampled (pickled bytes)
            "prefetch": extras.get("prefetch"),
        }
        self.ckpt.wait()  # surface a failed background write before starting the next one
        self.ckpt.save(int(step), bundle.state, slots=slots)

    def restore_latest(self, bundle: TrainBundle):
        from pmd_jax.checkpoint import CheckpointError

        if not self.ckpt.all_steps():
            return None
        try:
            r = self.ckpt.restore(bundle.step_fn.abstract_state())
        except CheckpointError as e:
            log.error("%s; starting from scratch", e)
            return None
        for s, why in r.skipped:
            log.warning("skipped corrupt checkpoint %d: %s", s, why)
        bundle.state = r.state
        tr = r.slots.get("trainer") or {"step": r.step}
        mem = r.slots.get("memory")
        extras = {
            "step": int(tr["step"]),
            "data_cursor": r.slots["data_cursor"],
            "nonfinite_in_a_row": int(tr.get("nonfinite_in_a_row", 0)),
            "skipped_long_prompts": int(tr.get("skipped_long_prompts", 0)),
            "memory": pickle.loads(mem) if mem else None,
            "prefetch": r.slots.get("prefetch"),
        }
        return bundle, extras

    def latest_committed(self) -> int | None:
        try:
            return self.ckpt.latest_step()
        except Exception:  # noqa: BLE001 - only used in an error message
            return None

    def wait(self) -> None:
        self.ckpt.wait()


def build_checkpointer(cfg: Any, run_dir: Path) -> RunCheckpointer:
    return RunCheckpointer(run_dir, int(cfg.train.keep_checkpoints))


# ----------------------------------------------------------------------------- evaluation
def make_generate_fn(
    cfg: Any, model: ModelBundle, textgen: TextGenerator, memory: Any = None,
    pid_by_text: dict[str, str] | None = None, prefix_by_text: dict[str, str] | None = None,
) -> Callable[[list[Messages], int, int], list[list[str]]]:
    """``generate(conversations, n, seed) -> n texts each`` for tasks.evaluation (memory-free
    unless ``memory`` is given). A task's response prefix is appended to the prompt and
    prepended to each text, as in training."""
    from pmd_jax.metrics import Progress

    e = cfg.eval
    prefixes = prefix_by_text or {}
    gen = TextGenerator(
        textgen.sampler,
        lambda conv: model.encode_prompt(conv, prefixes.get(_user_text(conv), "")),
        textgen.decode,
    )

    def generate(convs: list[Messages], n: int, seed: int) -> list[list[str]]:
        if memory is not None:  # memory-conditioned evaluation (frozen-policy mode only)
            pids = pid_by_text or {}
            convs = [teacher_messages(c, memory.teacher_context(
                pids.get(_user_text(c), ""), _user_text(c)).render(model.count_tokens))
                for c in convs]
        sp = SamplingParams(n=n, temperature=e.temperature, top_p=e.top_p,
                            max_tokens=e.max_tokens, stop_token_ids=tuple(model.stop_token_ids),
                            seed=int(seed))
        # One request: the sampler sorts the rows by prompt length and cuts them into batches
        # (for the JAX sampler, the plan of sampling/batching.py: little padding, programs
        # it has already compiled); it reports rows as batches finish.
        prog = Progress(len(convs), f"eval (seed {seed}, {n} samples each)", unit="prompt")
        done = [0]

        def progress(rows: int) -> None:
            done[0] += rows
            if done[0] // n > prog.count:
                prog.update(done[0] // n - prog.count)

        texts = gen.generate_texts(convs, sp, progress=progress)
        prog.close()
        return [[prefixes.get(_user_text(c), "") + t for t in ts]
                for c, ts in zip(convs, texts, strict=True)]

    return generate


def evaluate(cfg: Any, model: ModelBundle, task: Any, textgen: TextGenerator,
             problems: Sequence[Any], out_dir: Path, memory: Any = None) -> dict[str, Any]:
    from pmd_jax.tasks import evaluation

    out_dir.mkdir(parents=True, exist_ok=True)
    prefix_by_text = {_user_text(task.prompt(p)): response_prefix(task, p) for p in problems}
    res = evaluation.evaluate(
        task, make_generate_fn(cfg, model, textgen, prefix_by_text=prefix_by_text),
        split=cfg.task.eval_split, k=cfg.eval.n,
        seeds=tuple(cfg.eval.seeds), problems=problems, out_path=out_dir / "results.jsonl",
        name=out_dir.name, n_boot=2000,
    )
    s = res.summarize()
    out = {"accuracy": float(s["mean"]), "accuracy_ci_low": float(s["ci_low"]),
           "accuracy_ci_high": float(s["ci_high"]), "num_problems": len(problems)}
    if s.get("in_sample"):  # eval.allow_in_sample: the problems are training problems
        out["in_sample"] = "in-sample"
    if memory is not None and cfg.mode == "pmd_frozen_policy":
        rm = evaluation.evaluate(
            task,
            make_generate_fn(cfg, model, textgen, memory,
                             {_user_text(task.prompt(p)): str(p.id) for p in problems},
                             prefix_by_text),
            split=cfg.task.eval_split,
            k=cfg.eval.n, seeds=tuple(cfg.eval.seeds), problems=problems,
            out_path=out_dir / "results_with_memory.jsonl", name=out_dir.name + "_mem",
            n_boot=2000,
        )
        sm = rm.summarize()
        out.update({"accuracy_with_memory": float(sm["mean"])})
    return out


def export_hf(cfg: Any, model: ModelBundle, bundle: TrainBundle, path: Path) -> Path | None:
    """Writes the current params as a HF checkpoint. Call it on every process: the params
    are gathered to host memory (a collective with several processes), process 0 writes."""
    from pmd_jax import paths
    from pmd_jax.models.hf_io import save_hf_checkpoint
    from pmd_jax.multihost import gather_tree

    params = gather_tree(current_params(cfg, bundle), keep=is_main_process())
    if params is None:
        return None
    # safetensors writes local files: a gs:// path is staged locally, then uploaded
    with paths.staged_dir(path) as d:
        save_hf_checkpoint(params, model.cfg, d, dtype="float32"
                           if model.cfg.param_dtype == "float32" else "bfloat16",
                           tokenizer=model.tokenizer)
    return path
