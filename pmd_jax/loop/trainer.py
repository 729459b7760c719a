"""The co-evolution loop (DESIGN.md "The loop"), one step after another:

1. rollout       sample the step's problems (``rollout.py``: the problem stream, StepBatch,
                 the phase and its background thread; ``pmd_jax/episode.py``: the road)
2. verify        reward each rollout (``tasks/``)
3. memory update reflect on the verified rollouts (``teaching.update_memory``, ``memory/``),
                 then the mode's own host work (mel: lessons from right/wrong pairs,
                 ``modes/mel/``; fast_slow: its context pool, ``modes/fast_slow/``)
4. train batch   each rollout's teacher context and prompt (``teaching.train_rows``), then
                 the step's arrays, the mode's extra rows and the rows the update keeps
                 (``distill/assemble.py``: one call)
5. train step    one jitted distillation update (``distill/train.py``; ``distill/kl.py`` for
                 the KL to the initial model)
6. publish       hand the new weights to the sampler (``sampling/publish.py``)
7. checkpoint    train state, memory, data cursor (``checkpoint.RunCheckpointer``)
8. evaluate      memory-free, on held-out problems (``evaluate.py``); a restart at an
                 evaluation's step keeps its finished record or runs it first
9. export        the final weights as a HF checkpoint (``export.py``; LoRA: merged, and the
                 adapters as a PEFT folder)

The parts are built once at start-up (``build.py``). This file reads in that order.

No math lives here: the numbers come from ``distill/``, the memory from ``memory/``, rewards
from ``tasks/``. Every mode (grpo, sdpo, pmd, frozen variants, level ablations, controls, mel,
fast_slow) runs through this one code path; the loop asks the mode's spec (``pmd_jax/modes``:
memory or not, policy trained or not) and calls its runtime's hooks, never its name.

``rollout.overlap``: once step k has its rollouts, step k+1's problems are drawn (main thread)
and their generate() call starts in a background thread, with the weights the sampler holds
(published after step k-1), while step k verifies, updates the memory and trains. Step k joins
it before publishing, so every batch is sampled with one weights version and is exactly one
version stale when trained on (``rollout_staleness``; the loss's truncated IS weights correct
it). The joined batch goes into the checkpoint, so a resume trains on the very same rollouts.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import numpy as np

from pmd_jax.config.sections import RunConfig
from pmd_jax.distill import assemble, kl, offload, train
from pmd_jax.loop import build, eval_reuse, teaching
from pmd_jax.loop import evaluate as evaluation  # (module attribute: tests patch it)
from pmd_jax.loop.export import export_hf, export_peft
from pmd_jax.loop.phases import TrainingError, timed
from pmd_jax.loop.rollout import ProblemStream, RolloutPhase, StepBatch
from pmd_jax.modes import get_mode
from pmd_jax.run import footprint, multihost, paths
from pmd_jax.run.checkpoint import build_checkpointer
from pmd_jax.run.disk import DiskSpaceError
from pmd_jax.run.metrics import MetricsWriter, NoMetrics, Progress, write_plots
from pmd_jax.sampling.publish import publish

log = logging.getLogger("pmd_jax")

__all__ = ["StepBatch", "Trainer", "TrainingError"]  # StepBatch: pickled by older checkpoints


# the training progress line: (name shown, step metric)
_PROGRESS_FIELDS = (("reward", "reward_mean"), ("loss", "loss"), ("s_per_step", "time_step"))


class Trainer:
    # ------------------------------------------------------------------ start-up
    def __init__(self, cfg: RunConfig) -> None:
        # the frozen, typed config main builds after validation (config.freeze)
        if not isinstance(cfg, RunConfig):
            raise TypeError(f"Trainer takes the frozen RunConfig, got {type(cfg).__name__}: "
                            "validate and freeze a ConfigDict first (pmd_jax.config.freeze)")
        self.cfg = cfg
        self.run_dir = paths.makedirs(cfg.run_dir)  # an epath.Path: local or gs://
        # With several processes (pmd_jax.run.multihost) process 0 writes every file of the run.
        self.is_main = build.is_main_process()
        self.multi = multihost.process_count() > 1
        if self.is_main:
            paths.write_text(self.run_dir / "config.json",
                             json.dumps(cfg.to_dict(), indent=2, default=str))
        self.metrics = (MetricsWriter(self.run_dir, use_tensorboard=True) if self.is_main
                        else NoMetrics())
        self.times: dict[str, float] = {}

        t0 = time.perf_counter()
        self.task = build.build_task(cfg, check_sandbox=self.is_main)  # process 0 grades
        self.train_problems, self.eval_problems = build.select_problems(cfg, self.task)
        self.model = build.load_model(cfg)  # ModelBundle: cfg, params, tokenizer, chat, mesh
        # the rollout sampler and the main thread's (reflections, evaluation; its own with
        # rollout.overlap), process 0's view of it and its chat-level generator
        samplers = build.build_samplers(cfg, self.model)
        self.sampler, self.reflect_sampler = samplers.rollout, samplers.reflect
        self.leader_sampler, self.textgen = samplers.leader, samplers.textgen
        self.overlap = bool(cfg.rollout.overlap)
        # What the mode means (pmd_jax.modes): the loop asks it, never the mode's name.
        self.mode = get_mode(cfg.mode)
        # The memory lives on process 0 only (one owner; the others never read it).
        self.uses_memory = self.mode.uses_memory
        self.memory = build.build_memory(cfg, self.model) if self.is_main else None
        self.state = train.init_train_state(cfg, self.model, trains=self.mode.trains_policy)
        # the mode's per-run state and hooks (mel's lessons, fast_slow's context pool)
        self.mode_rt = self.mode.runtime(cfg, self.model, self.task, self.train_problems,
                                         self.eval_problems)
        self.stream = ProblemStream(self.mode_rt.train_items(self.train_problems),
                                    seed=cfg.seed)
        # 1. the rollouts (rollout.overlap: its background thread and the prefetched batch)
        self.rollouts = RolloutPhase(cfg, self.model, self.task, self.sampler, self.stream,
                                     self.mode_rt.student_messages)
        self.ckpt = build_checkpointer(cfg, self.run_dir)
        self.nonfinite_in_a_row = self.skipped_long_prompts = 0
        self.step, self._restored_eval = 0, None  # (_restore: process 0's record, for all)
        # The policy version the sampler holds (0 = the initial weights; publish after step k
        # makes it k + 1). A rollout batch's staleness is this minus its weights_version.
        self.weights_version = 0
        log.info("set-up took %.1fs", time.perf_counter() - t0)
        if self.state.lora is not None:
            log.info("LoRA: %s; the train state holds the adapters, the frozen base is in %s",
                     self.state.lora, self.state.step_fn.base_dtype or cfg.model.param_dtype)
            if self.state.base_is_cast(self.model.params):  # (lora.base_dtype)
                # the sampler samples the policy the step trains from step 0 on (the base as
                # the step holds it), and lets go of the weights as loaded. Those, and the
                # sampler's copy of them, go first: the 1.5B config held the float32 load
                # (6.2 GB), its bf16 base, the sampler's per-layer copy and the merged
                # weights at once, and the kernel killed it at 24 GB.
                self.model.params = None  # (the base is their cast copy; LoRA's initial
                # policy is the base: place_initial_policy drops them anyway)
                if self.sampler.share_weights() == "in_process":
                    self.sampler.release_params()
                    if self.reflect_sampler is not self.sampler:
                        self.reflect_sampler.release_params()
                footprint.release_free_memory()
                self._publish(0)
        log.info(footprint.format_breakdown(footprint.breakdown({
            **self.state.parts(), "sampler_weights": getattr(self.sampler, "params", None),
            "reflect_sampler_weights": getattr(self.reflect_sampler, "params", None),
        })))
        try:
            # the disk the checkpoints need; no room for two raises DiskSpaceError (exit 2)
            log.info(self.ckpt.check_disk(self.state, {"memory": self.memory.state_dict()}
                                          if self.memory is not None else None,
                                          export_hf=cfg.train.export_hf))
            # the offload options' temp files (no room: DiskSpaceError), the initial policy
            for line in train.prepare_offloads(cfg, self.state, self.model, str(self.run_dir)):
                log.info(line)
        except DiskSpaceError:
            self.ckpt.close()  # (orbax's threads end before main's one-line refusal exits)
            raise

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self._restore()
        results: dict[str, Any] = {}
        if self.step == 0 and cfg.train.eval_at_start and cfg.train.eval_every >= 0:
            results["before"] = self.evaluate(0)
        elif self.step > 0 and self._eval_due(self.step):  # resumed at an evaluation's step
            results[f"step_{self.step}"] = self._restored_eval or self.evaluate(self.step)
        prog = Progress(cfg.train.steps, "train", start=self.step)
        try:
            self._loop(prog, results)
        finally:
            self.rollouts.stop()
        prog.close()
        # the end's evaluation, unless this step's weights were evaluated already (a run of
        # 0 steps evaluated them at the start: until 2026-11-29 it evaluated them twice)
        at_start = self.step == 0 and "before" in results
        if cfg.train.eval_every >= 0 and f"step_{self.step}" not in results and not at_start:
            results["after"] = self.evaluate(self.step)
        self.ckpt.wait()
        self.finish()
        return results

    def _loop(self, prog: Progress, results: dict[str, Any]) -> None:
        cfg = self.cfg
        while self.step < cfg.train.steps:
            metrics = self.train_one_step()
            self.step += 1
            every = cfg.train.clear_compiled_every
            drop = every > 0 and self.step % every == 0  # (no rollout thread runs here)
            if drop:  # the step's programs, before the evaluation's
                footprint.drop_compiled()
            # what the step logged (no loss in pmd_frozen_policy / memory_only: no update)
            prog.update(1, **{k: metrics[m] for k, m in _PROGRESS_FIELDS if m in metrics})
            if self.step % cfg.train.checkpoint_every == 0 or self.step == cfg.train.steps:
                self._save()
            else:  # a write that failed (disk full) stops the run now, not at the next save
                self.ckpt.wait(block=False)
            if self._eval_due(self.step):
                results[f"step_{self.step}"] = self.evaluate(self.step)
                if drop:  # and the evaluation's, before the next step's
                    footprint.drop_compiled()

    def train_one_step(self) -> dict[str, Any]:
        """One step of the loop (phases 1-6); returns and writes the step's metrics."""
        cfg, step = self.cfg, self.step
        times: dict[str, float] = {}
        t_step = time.perf_counter()
        # 1. rollout
        with timed(times, "sample"):  # 0 when the batch was prefetched during the last step
            sb = self.rollouts.take(step)
        self.skipped_long_prompts += sb.skipped
        if sb.skipped:
            log.warning("step %d: skipped %d problems whose prompts exceed "
                        "rollout.max_prompt_tokens", step, sb.skipped)
        staleness = self.weights_version - sb.weights_version
        if not 0 <= staleness <= int(sb.prefetched):
            raise TrainingError(
                f"step {step}: rollouts sampled with weights version {sb.weights_version} but "
                f"the policy is at version {self.weights_version} (staleness must be 0, or "
                "at most 1 with rollout.overlap)")
        if self.overlap and step + 1 < cfg.train.steps:
            with timed(times, "prefetch_launch"):
                self.rollouts.prefetch(step + 1)  # sampled with the current weights while we train
        # 2-4. Verification, the memory update and the teacher prompts: process 0's work with
        # several processes (its reflections' generate calls are served by all of them), the
        # others receive the results (pmd_jax.run.multihost).
        arrays, prompt_stats, mem_stats, verdicts, lead_times = multihost.lead(
            lambda: self._host_work(sb, times), self.leader_sampler, f"step {step}")
        sb = sb.verified(verdicts)  # (every process: the rewards go into the step's metrics)
        times.update(lead_times)
        if self._sampler_weights_dead():
            # The sampler's weights are those the train step is about to replace, and nothing
            # samples until the publish below hands it the new ones: drop them for the train
            # step and the KL forward (its per-layer copy, 0.40 GiB on the embedded default).
            self.sampler.release_params()
            footprint.release_free_memory()
        train_metrics = self._train(arrays, step, times)
        if self._kl_due(step):  # (on every rollout's row)
            with timed(times, "kl_initial"):
                train_metrics["kl_policy_initial"] = kl.kl_to_initial(
                    cfg, self.model, self.state, arrays.full)
        # 6. publish (after the background batch: it is sampled with one weights version)
        if self.overlap:
            with timed(times, "prefetch_wait"):  # the next batch outlasted this step's work
                self.rollouts.finish_prefetch()
        if self.mode.trains_policy:
            with timed(times, "publish"):
                self._publish(step + 1)
        times["time_step"] = time.perf_counter() - t_step
        times["time_rollout_generate"] = sb.sample_seconds
        rewards = sb.rewards
        out: dict[str, Any] = {
            "reward_mean": float(rewards.mean()),
            "success_group_fraction": float(
                (rewards >= cfg.teacher_prompt.success_threshold).any(axis=1).mean()
            ),
            "format_ok_fraction": float(np.mean([r.ok for r in sb.results])),
            "response_tokens_mean": float(np.mean([len(r.tokens) for r in sb.rollouts])),
            "skipped_long_prompts": float(self.skipped_long_prompts),
            "truncated_fraction": float(
                np.mean([r.finish_reason == "length" for r in sb.rollouts])
            ),
            "rollout_staleness": float(staleness),
            "rollout_weights_version": float(sb.weights_version),
            **prompt_stats,
            **{k: float(v) for k, v in train_metrics.items() if np.ndim(v) == 0},
            **mem_stats,
            **times,
        }
        self.metrics.write("train", step, out)
        return out

    def _host_work(self, sb: StepBatch, times: dict[str, float]) -> tuple[Any, ...]:
        """Verifies, updates the memory, builds the step's arrays; returns them
        (``distill.assemble.StepArrays``), the teacher prompts' and the memory's stats, the
        verdicts (every process's step metrics read them) and ``times`` (process 0's
        timings, with several processes)."""
        cfg, step = self.cfg, sb.step
        with timed(times, "verify"):  # 2. verify
            verdicts = self.rollouts.verify(sb)
        sb = sb.verified(verdicts)
        mem_stats: dict[str, Any] = {}
        if self.memory is not None:
            with timed(times, "memory"):  # 3. memory update
                mem_stats = teaching.update_memory(
                    cfg, self.memory, step, sb, self.task, self.textgen
                )
            times["time_reflect"] = float(mem_stats.pop("reflect_seconds", 0.0))
            times["time_memory"] -= times["time_reflect"]
        rt = self.mode_rt
        if rt.work_name:  # 3'. the mode's own (mel: lessons; fast_slow: the context pool)
            with timed(times, rt.work_name):
                mem_stats.update(rt.host_work(step, sb, self.memory, self.textgen))
        with timed(times, "teacher_prompts"):  # 4. teacher prompts, train batch
            rows, prompt_stats = teaching.train_rows(
                cfg, self.model, self.task, self.memory, sb, sampler=self.leader_sampler
            )
            divisor = self.state.step_fn.batch_divisor()
            # + the mode's rows (mel: the kept lessons, whose NLL joins the loss); the rows
            # the update keeps (drop_unsignaled_rows), padded to the mesh's batch axes
            arrays = assemble.update_batch(cfg, rows, self.model.pad_id,
                                           rt.extra_rows(sb, divisor), divisor)
        return arrays, prompt_stats, mem_stats, verdicts, dict(times)

    # ------------------------------------------------------------------ 5. train step
    def _train(self, arrays: assemble.StepArrays, step: int,
               times: dict[str, float]) -> dict[str, Any]:
        """One update on the step's update rows (none when the mode trains no policy); tracks
        non-finite updates and stops the run after train.max_nonfinite_in_a_row of them."""
        cfg = self.cfg
        train_metrics: dict[str, Any] = {}
        if self.mode.trains_policy:
            with timed(times, "train"):
                train_metrics = train.train_step(self.state, arrays.update)
                train_metrics.update(arrays.stats)
            self.nonfinite_in_a_row = train.count_nonfinite(
                train_metrics, self.nonfinite_in_a_row, cfg.train.max_nonfinite_in_a_row, step)
        return train_metrics

    def _sampler_weights_dead(self) -> bool:
        """Whether the sampler's weights go unused from the train step to the publish after
        it: not with rollout.overlap (the next batch is sampled meanwhile), nor without a
        publish (pmd_frozen_policy), nor for a sampler that keeps no weights in process."""
        return (not self.overlap and self.mode.trains_policy
                and self.sampler.share_weights() == "in_process")

    def _kl_due(self, step: int) -> bool:
        # (a mode that never trains: the KL is 0 by construction, and its initial policy is
        # not kept)
        return self.mode.trains_policy and kl.kl_due(step, self.cfg.train.kl_initial_every)

    # ------------------------------------------------------------------ 6. publish
    def _publish(self, version: int) -> None:
        """Hand the current weights to the sampler (in process, or a weight-store version)."""
        # With overlap the sampler must own its weights: the next train step donates the
        # train state's buffers while the rollout thread is still reading the published ones.
        publish(self.sampler, train.current_params(self.cfg, self.state), step=version,
                model_cfg=self.state.step_fn.model_cfg,
                weight_store_url=self.cfg.rollout.weight_store, copy=self.overlap)
        if self.reflect_sampler is not self.sampler:
            # Same class and config: share the rollout sampler's placed (possibly per-layer
            # unstacked) arrays as they are, so the weights exist once for both.
            self.reflect_sampler.use_weights_of(self.sampler)
        self.weights_version = int(version)

    # ------------------------------------------------------------------ 7. checkpoint
    def _save(self) -> None:
        memory_state = self.memory.state_dict() if self.memory is not None else None
        if memory_state is None and self.uses_memory:
            # Not process 0: the slot must exist on every process of a multi-process save
            # (process 0 alone writes it), its value here is never written.
            memory_state = {"process": "not written"}
        extras = {
            "step": self.step,
            **self.rollouts.state_dict(),  # the data cursor, a prefetched batch
            "memory": memory_state,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "skipped_long_prompts": self.skipped_long_prompts,
            "mode_state": self.mode_rt.state_dict(),
        }
        self.ckpt.save(self.step, self.state, extras)  # (names the step of a failed write)

    def _initial_state(self) -> Any:
        """The train state a run starts from, made again from the model's source weights
        (the resume let go of the first one before restoring; no checkpoint was usable)."""
        if self.state.lora is not None:  # (the adapters' init; the base is still held)
            return self.state.step_fn.init(None, rng=int(self.cfg.seed))
        log.info("loading the initial weights again to start from step 0")
        return self.state.step_fn.init(build.load_model(self.cfg).params, rng=int(self.cfg.seed))

    def _restore(self) -> None:
        restored = (self.ckpt.restore_latest(self.state, rebuild=self._initial_state)
                    if self.cfg.resume else None)
        if restored is None:
            # the run starts at step 0: records of an earlier attempt in this run directory
            # that left no checkpoint would otherwise stay beside the new ones (the grid's
            # restarted cells logged their step-0 evaluation twice)
            dropped = self.metrics.truncate_after(-1)
            if dropped:
                log.warning("starting at step 0: dropped %d metrics records of an earlier "
                            "attempt in %s that left no checkpoint", dropped, self.run_dir)
            return
        self.state, extras = restored
        self.step = int(extras["step"])
        prefetched = self.rollouts.load_state_dict(extras, self.step)
        if self.memory is not None and extras.get("memory") is not None:
            self.memory.load_state_dict(extras["memory"])
        self.nonfinite_in_a_row = int(extras.get("nonfinite_in_a_row", 0))
        self.skipped_long_prompts = int(extras.get("skipped_long_prompts", 0))
        if extras.get("mode_state") is not None:
            self.mode_rt.load_state_dict(extras["mode_state"])
        self.metrics.truncate_after(self.step - 1, keep=("eval", self.step))
        self._restored_eval = multihost.broadcast_object(self.metrics.last("eval", self.step))
        if self.mode.trains_policy:  # (else the weights never change)
            self._publish(self.step)
        log.info("resumed from checkpoint at step %d%s%s", self.step,
                 " (with its prefetched rollouts)" if prefetched else "",
                 " (its evaluation finished before: kept)" if self._restored_eval else "")

    # ------------------------------------------------------------------ 8. evaluate
    def evaluate(self, step: int) -> dict[str, Any]:
        # The checkpoint written in the background finishes first: its write buffers (0.6-1.6
        # GiB of C heap on the embedded default) and an evaluation's batches, the run's
        # largest sampling programs, would otherwise be resident together.
        self.ckpt.wait()
        footprint.release_free_memory()
        t0 = time.perf_counter()
        out_dir = self.run_dir / "eval" / f"step_{step:06d}"
        key = None if step else eval_reuse.start_key(  # (eval.reuse_from)
            self.cfg, self.mode, self.mode_rt,
            # (LoRA: the initial policy is the base; its adapters change nothing at step 0)
            self.state.state.params if self.state.lora is None else self.state.base,
            self.task, self.eval_problems)
        # Process 0 evaluates and writes the results; the others serve its generate calls.
        res = eval_reuse.taken(self.cfg, key, out_dir, self.run_dir) or multihost.lead(
            lambda: evaluation.evaluate(self.cfg, self.model, self.task, self.textgen,
                                        self.eval_problems, out_dir, self.memory,
                                        context=self.mode_rt.eval_context()),
            self.leader_sampler, f"evaluation at step {step}")
        res["time_eval"] = time.perf_counter() - t0
        if self._final_kl_due(step):
            t1 = time.perf_counter()
            res["kl_policy_initial"] = evaluation.final_kl(
                self.cfg, self.model, self.task, self.state, self.rollouts, self.leader_sampler,
                step)
            res["time_kl_final"] = time.perf_counter() - t1
        footprint.release_free_memory()
        self.metrics.write("eval", step, res)
        if key is not None and "eval_reused_from" not in res:
            eval_reuse.write_key(out_dir, key, res)
        log.info(
            "eval @ step %d: accuracy %.4f [%.4f, %.4f]%s (%d problems x %d samples, %.0fs)",
            step, res["accuracy"], res.get("accuracy_ci_low", float("nan")),
            res.get("accuracy_ci_high", float("nan")),
            f" ({res['in_sample']})" if res.get("in_sample") else "",  # eval.allow_in_sample
            res.get("num_problems", 0), self.cfg.eval.n, res["time_eval"],
        )
        return res

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.train.eval_every
        return (every > 0 and step % every == 0) or (every >= 0 and step >= self.cfg.train.steps)

    def _final_kl_due(self, step: int) -> bool:
        cfg = self.cfg
        return (cfg.eval.kl_final and step == cfg.train.steps and step > 0
                and cfg.train.kl_initial_every > 0 and self.mode.trains_policy)

    # ------------------------------------------------------------------ 9. export, end of run
    def finish(self) -> None:
        if isinstance(self.state.initial_params, offload.DiskParams):
            self.state.initial_params.remove()
        if self.cfg.train.export_hf:
            # Every process takes part in gathering the params; process 0 writes them.
            export_hf(self.cfg, self.model, self.state, self.run_dir / "final_hf")
            if self.state.lora is not None:  # and the adapters, as a PEFT folder
                export_peft(self.cfg, self.model, self.state, self.run_dir / "final_peft")
        if not self.is_main:
            return
        plots = write_plots(self.run_dir)
        if self.memory is not None:
            self.memory.export_jsonl(self.run_dir / "memory.jsonl")
            self.memory.export_html(self.run_dir / "memory.html")
        log.info("run directory %s: %d plots written", self.run_dir, len(plots))
        self.metrics.close()
