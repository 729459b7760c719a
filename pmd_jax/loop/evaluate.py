"""Evaluation during a run: the policy answers the task's evaluation problems memory-free
(``tasks.evaluation`` scores them); in ``pmd_frozen_policy`` mode also with the memory's
context; in ``fast_slow`` mode also with the pool's best context in the prompt (``context``:
``accuracy_deployed``); with ``eval.retention`` also an off-task retention set
(``pmd_jax.loop.retention``).
``Trainer.evaluate`` calls :func:`evaluate` on process 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pmd_jax import episode
from pmd_jax.distill import kl
from pmd_jax.episode import response_prefix, user_text
from pmd_jax.loop.retention import retention_set
from pmd_jax.loop.teaching import build_train_batch, teacher_messages
from pmd_jax.modes import get_mode
from pmd_jax.modes.fast_slow.contexts import with_context
from pmd_jax.run import multihost
from pmd_jax.run.metrics import Progress
from pmd_jax.sampling.base import Messages, TextGenerator
from pmd_jax.tasks import evaluation

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig
    from pmd_jax.loop.build import ModelBundle


def make_generate_fn(
    cfg: RunConfig, model: ModelBundle, textgen: TextGenerator, memory: Any = None,
    pid_by_text: dict[str, str] | None = None, prefix_by_text: dict[str, str] | None = None,
    context: str | None = None,
) -> Callable[[list[Messages], int, int], list[list[str]]]:
    """``generate(conversations, n, seed) -> n texts each`` for tasks.evaluation (memory-free
    unless ``memory`` is given; with ``context``, a fast_slow context in the system message as
    in the rollouts). A task's response prefix is appended to the prompt and prepended to each
    text, as in training."""

    e = cfg.eval
    prefixes = dict(prefix_by_text or {})  # by user text

    def generate(convs: list[Messages], n: int, seed: int) -> list[list[str]]:
        pre = [prefixes.get(user_text(c), "") for c in convs]  # (before a rewrite of the turn)
        if memory is not None:  # memory-conditioned evaluation (frozen-policy mode only)
            pids = pid_by_text or {}
            ctxs = [memory.teacher_context(pids.get(user_text(c), ""), user_text(c))
                    for c in convs]
            if memory.config.verify.enabled:  # only what the check admitted (memory/verify)
                for ctx in ctxs:
                    ctx.keep_items(memory.evidence.visible)
            convs = [teacher_messages(c, ctx.render(model.count_tokens))
                     for c, ctx in zip(convs, ctxs, strict=True)]
        if context is not None:  # fast_slow's deployed form: the pool's best context

            convs = [with_context(c, context) for c in convs]
        sp = episode.sampling_params(e, n=n, stop_token_ids=model.stop_token_ids,
                                     purpose="eval", seed_parts=(int(seed),))
        # One request: the sampler sorts the rows by prompt length and cuts them into batches
        # (for the JAX sampler, the plan of sampling/batching.py: little padding, programs
        # it has already compiled); it reports rows as batches finish.
        prog = Progress(len(convs), f"eval (seed {seed}, {n} samples each)", unit="prompt")
        done = [0]

        def progress(rows: int) -> None:
            done[0] += rows
            if done[0] // n > prog.count:
                prog.update(done[0] // n - prog.count)

        out: list[list[str]] = [[] for _ in convs]
        if convs:
            prompts = [model.encode_prompt(c, p) for c, p in zip(convs, pre, strict=True)]
            rollouts = episode.generate(textgen.sampler, prompts, sp, progress)
            for r, text in zip(rollouts, episode.decode(textgen, rollouts, pre), strict=True):
                out[r.prompt_index].append(text)
        prog.close()
        return out

    return generate


def final_kl(cfg: RunConfig, model: ModelBundle, task: Any, state: Any, rollouts: Any,
             leader_sampler: Any, step: int) -> float:
    """KL(policy || initial) of the final weights (eval.kl_final): the rollouts of a step
    ``step`` (the next problems of the data stream, the rollout settings of training, sampled
    by every process; ``rollouts``: the run's ``loop.rollout.RolloutPhase``), verified, as
    GRPO's batch, through the same estimator as the steps' (distill.kl). The memory is not
    touched."""
    sb = rollouts.sample(step)

    def host() -> dict[str, Any]:
        return build_train_batch(cfg, model, task, None, sb.verified(rollouts.verify(sb)),
                                 student_only=True)[0]

    batch = multihost.lead(host, leader_sampler, f"final KL at step {step}")
    return kl.kl_to_initial(cfg, model, state, batch)


def evaluate(cfg: RunConfig, model: ModelBundle, task: Any, textgen: TextGenerator,
             problems: Sequence[Any], out_dir: Path, memory: Any = None,
             context: str | None = None) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix_by_text = {user_text(task.prompt(p)): response_prefix(task, p) for p in problems}
    res = evaluation.evaluate(
        task, make_generate_fn(cfg, model, textgen, prefix_by_text=prefix_by_text),
        split=cfg.task.eval_split, k=cfg.eval.n,
        seeds=tuple(cfg.eval.seeds), problems=problems, out_path=out_dir / "results.jsonl",
        name=out_dir.name, n_boot=2000,
    )
    s = res.summarize()
    out: dict[str, Any] = {"accuracy": float(s["mean"]), "accuracy_ci_low": float(s["ci_low"]),
                           "accuracy_ci_high": float(s["ci_high"]),
                           "num_problems": len(problems)}
    if s.get("in_sample"):  # eval.allow_in_sample: the problems are training problems
        out["in_sample"] = "in-sample"
    if cfg.eval.retention:
        out.update(_retention(cfg, model, task, textgen, problems, out_dir))
    if memory is not None and get_mode(cfg.mode).eval_with_memory:
        rm = evaluation.evaluate(
            task,
            make_generate_fn(cfg, model, textgen, memory,
                             {user_text(task.prompt(p)): str(p.id) for p in problems},
                             prefix_by_text),
            split=cfg.task.eval_split,
            k=cfg.eval.n, seeds=tuple(cfg.eval.seeds), problems=problems,
            out_path=out_dir / "results_with_memory.jsonl", name=out_dir.name + "_mem",
            n_boot=2000,
        )
        sm = rm.summarize()
        out.update({"accuracy_with_memory": float(sm["mean"])})
    if context is not None:
        rd = evaluation.evaluate(
            task, make_generate_fn(cfg, model, textgen, prefix_by_text=prefix_by_text,
                                   context=context),
            split=cfg.task.eval_split, k=cfg.eval.n, seeds=tuple(cfg.eval.seeds),
            problems=problems, out_path=out_dir / "results_deployed.jsonl",
            name=out_dir.name + "_deployed", n_boot=2000)
        sd = rd.summarize()
        out.update({"accuracy_deployed": float(sd["mean"]),
                    "accuracy_deployed_ci_low": float(sd["ci_low"]),
                    "accuracy_deployed_ci_high": float(sd["ci_high"]),
                    "deployed_context_tokens": model.count_tokens(context)})
        (out_dir / "deployed_context.txt").write_text(context)
    return out


def _retention(cfg: RunConfig, model: ModelBundle, task: Any, textgen: TextGenerator,
               problems: Sequence[Any], out_dir: Path) -> dict[str, Any]:
    """The memory-free accuracy on the retention set, its CI and size (eval.retention)."""

    rtask, rprobs = retention_set(cfg, [*task.problems("train"), *problems])
    prefix = {user_text(rtask.prompt(p)): response_prefix(rtask, p) for p in rprobs}
    res = evaluation.evaluate(
        rtask, make_generate_fn(cfg, model, textgen, prefix_by_text=prefix),
        split="retention", k=cfg.eval.n, seeds=tuple(cfg.eval.seeds), problems=rprobs,
        out_path=out_dir / "retention.jsonl", name=out_dir.name + "_retention", n_boot=2000,
        in_sample=False)
    s = res.summarize()
    return {"retention_accuracy": float(s["mean"]),
            "retention_accuracy_ci_low": float(s["ci_low"]),
            "retention_accuracy_ci_high": float(s["ci_high"]),
            "retention_num_problems": len(rprobs), "retention_task": str(rtask.name),
            "retention_prompt_style": str(getattr(rtask, "prompt_style", ""))}
