"""The co-evolution loop (DESIGN.md "The loop"): sample, verify, update memory, build teacher
prompts, one jitted distillation step, publish weights; checkpoint and evaluate memory-free.

No math lives here: the numbers come from ``distill/``, the memory from ``memory/``, rewards
from ``tasks/``. Every mode (grpo, sdpo, pmd, frozen variants, level ablations, controls) runs
through this one code path; a mode only changes config values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pmd_jax.config import to_dict
from pmd_jax.data import DataCursor, ProblemStream
from pmd_jax.metrics import MetricsWriter, Progress, write_plots
from pmd_jax.sampling.base import Rollouts, SamplerError, SamplingParams, TextGenerator

log = logging.getLogger("pmd_jax")


class TrainingError(RuntimeError):
    """The run cannot continue (repeated non-finite losses, unreachable sampler, ...)."""


@contextlib.contextmanager
def _timed(times: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[f"time_{name}"] = times.get(f"time_{name}", 0.0) + time.perf_counter() - t0


def _retry(fn, what: str, retries: int, base_delay: float = 2.0):
    """Calls ``fn`` with exponential backoff on SamplerError/ConnectionError/TimeoutError."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except (SamplerError, ConnectionError, TimeoutError) as e:
            if attempt == retries:
                raise TrainingError(f"{what} failed after {retries + 1} attempts: {e}") from e
            delay = base_delay * 2**attempt
            log.warning("%s failed (%s); retrying in %.0fs", what, e, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


@dataclasses.dataclass
class StepBatch:
    """Host-side record of one step's rollouts (prompt-major, G rollouts per problem)."""

    problems: list[Any]
    student_prompts: list[list[int]]
    rollouts: Rollouts
    texts: list[str]
    rewards: np.ndarray  # [B, G]
    results: list[Any]


class Trainer:
    def __init__(self, cfg: Any) -> None:
        from pmd_jax import wiring

        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2, default=str))
        self.is_main = wiring.is_main_process()
        self.metrics = MetricsWriter(self.run_dir, use_tensorboard=self.is_main)
        self.times: dict[str, float] = {}

        t0 = time.perf_counter()
        self.task = wiring.build_task(cfg)
        self.train_problems = self.task.problems("train")
        if cfg.task.max_train_problems:
            self.train_problems = self.train_problems[: cfg.task.max_train_problems]
        self.eval_problems = self.task.problems(cfg.task.eval_split)[: cfg.task.max_eval_problems]
        log.info(
            "task %s: %d train / %d %s problems",
            cfg.task.name, len(self.train_problems), len(self.eval_problems), cfg.task.eval_split,
        )
        self.model = wiring.load_model(cfg)  # ModelBundle: cfg, params, tokenizer, chat, mesh
        self.sampler = wiring.build_sampler(cfg, self.model)
        self.textgen = TextGenerator(self.sampler, self.model.encode_chat, self.model.decode)
        self.memory = wiring.build_memory(cfg, self.model)
        self.state = wiring.init_train_state(cfg, self.model)
        self.stream = ProblemStream(self.train_problems, seed=cfg.seed)
        self.ckpt = wiring.build_checkpointer(cfg, self.run_dir)
        self.nonfinite_in_a_row = 0
        self.skipped_long_prompts = 0
        self.step = 0
        log.info("set-up took %.1fs", time.perf_counter() - t0)

    # ------------------------------------------------------------------ resume / save
    def _restore(self) -> None:
        if not self.cfg.resume:
            return
        restored = self.ckpt.restore_latest(self.state)
        if restored is None:
            return
        self.state, extras = restored
        self.step = int(extras["step"])
        self.stream.cursor = DataCursor.from_state(extras["data_cursor"])
        if self.memory is not None and extras.get("memory") is not None:
            self.memory.load_state_dict(extras["memory"])
        self.nonfinite_in_a_row = int(extras.get("nonfinite_in_a_row", 0))
        self.metrics.truncate_after(self.step - 1)
        self._publish(self.step)
        log.info("resumed from checkpoint at step %d", self.step)

    def _save(self) -> None:
        extras = {
            "step": self.step,
            "data_cursor": self.stream.cursor.state_dict(),
            "memory": self.memory.state_dict() if self.memory is not None else None,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }
        try:
            self.ckpt.save(self.step, self.state, extras)
        except Exception as e:  # noqa: BLE001 - report which step failed and what is intact
            prev = self.ckpt.latest_committed()
            raise TrainingError(
                f"checkpoint write at step {self.step} failed ({type(e).__name__}: {e}); "
                f"the previous checkpoint (step {prev}) is intact"
            ) from e

    def _publish(self, version: int) -> None:
        from pmd_jax import wiring

        wiring.publish(self.cfg, self.sampler, self.state, version)

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self._restore()
        results: dict[str, Any] = {}
        if self.step == 0 and cfg.train.eval_at_start and cfg.train.eval_every >= 0:
            results["before"] = self.evaluate(0)
        prog = Progress(cfg.train.steps, "train", start=self.step)
        while self.step < cfg.train.steps:
            metrics = self.train_one_step()
            self.step += 1
            prog.update(
                1,
                reward=metrics.get("reward_mean", float("nan")),
                loss=metrics.get("loss", float("nan")),
                s_per_step=metrics.get("time_step", float("nan")),
            )
            if self.step % cfg.train.checkpoint_every == 0 or self.step == cfg.train.steps:
                self._save()
            if cfg.train.eval_every > 0 and self.step % cfg.train.eval_every == 0:
                results[f"step_{self.step}"] = self.evaluate(self.step)
        prog.close()
        if cfg.train.eval_every >= 0 and f"step_{self.step}" not in results:
            results["after"] = self.evaluate(self.step)
        self.ckpt.wait()
        self.finish()
        return results

    def _sampling_params(self, step: int) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            max_tokens=r.max_tokens, stop_token_ids=tuple(self.model.stop_token_ids),
            seed=hash((self.cfg.seed, step)) % (2**31),
        )

    def sample(self, step: int) -> StepBatch:
        from pmd_jax.wiring import response_prefix

        cfg = self.cfg
        problems: list[Any] = []
        prefixes: list[str] = []
        prompts: list[list[int]] = []
        skipped = 0
        while len(problems) < cfg.rollout.problems_per_step:
            for p in self.stream.next_batch(cfg.rollout.problems_per_step - len(problems)):
                pre = response_prefix(self.task, p)
                ids = self.model.encode_prompt(self.task.prompt(p), pre)
                if len(ids) > cfg.rollout.max_prompt_tokens:  # counted and skipped
                    skipped += 1
                    self.skipped_long_prompts += 1
                    if skipped > 100 * cfg.rollout.problems_per_step:
                        raise TrainingError(
                            "almost every prompt is longer than rollout.max_prompt_tokens="
                            f"{cfg.rollout.max_prompt_tokens}: raise it"
                        )
                    continue
                problems.append(p)
                prefixes.append(pre)
                prompts.append(ids)
        if skipped:
            log.warning("step %d: skipped %d problems whose prompts exceed "
                        "rollout.max_prompt_tokens", step, skipped)
        sp = self._sampling_params(step)
        rollouts = _retry(
            lambda: self.sampler.generate(prompts, sp), "rollout generation", cfg.rollout.retries
        )
        texts = [prefixes[r.prompt_index] + self.model.decode(r.tokens.tolist())
                 for r in rollouts]
        return StepBatch(problems, prompts, rollouts, texts, np.zeros(0), [])

    def verify(self, sb: StepBatch) -> None:
        g = self.cfg.rollout.n
        probs = [sb.problems[r.prompt_index] for r in sb.rollouts]
        sb.results = self.task.verify_batch(probs, sb.texts, "train")
        sb.rewards = np.array([r.reward for r in sb.results], np.float64).reshape(-1, g)

    def train_one_step(self) -> dict[str, Any]:
        from pmd_jax import wiring

        cfg, step = self.cfg, self.step
        times: dict[str, float] = {}
        t_step = time.perf_counter()
        with _timed(times, "sample"):
            sb = self.sample(step)
        with _timed(times, "verify"):
            self.verify(sb)
        mem_stats: dict[str, Any] = {}
        if self.memory is not None:
            with _timed(times, "memory"):
                mem_stats = wiring.update_memory(
                    cfg, self.memory, step, sb, self.task, self.textgen
                )
            times["time_reflect"] = float(mem_stats.pop("reflect_seconds", 0.0))
            times["time_memory"] -= times["time_reflect"]
        with _timed(times, "teacher_prompts"):
            batch, prompt_stats = wiring.build_train_batch(
                cfg, self.model, self.task, self.memory, sb
            )
        train_metrics: dict[str, Any] = {}
        if cfg.mode != "pmd_frozen_policy":
            with _timed(times, "train"):
                train_metrics = wiring.train_step(self.state, batch)
            finite = bool(train_metrics.get("finite", True)) and math.isfinite(
                float(train_metrics.get("loss", 0.0))
            )
            if not finite:
                self.nonfinite_in_a_row += 1
                log.warning(
                    "step %d: non-finite loss or gradient; update skipped (%d in a row)",
                    step, self.nonfinite_in_a_row,
                )
                if self.nonfinite_in_a_row >= cfg.train.max_nonfinite_in_a_row:
                    raise TrainingError(
                        f"{self.nonfinite_in_a_row} non-finite updates in a row at step {step}: "
                        "stopping (lower distill.optim.lr or check the data)"
                    )
            else:
                self.nonfinite_in_a_row = 0
            with _timed(times, "publish"):
                self._publish(step + 1)
        if self._kl_due(step):
            with _timed(times, "kl_initial"):
                train_metrics["kl_policy_initial"] = wiring.kl_to_initial(
                    cfg, self.model, self.state, batch)
        times["time_step"] = time.perf_counter() - t_step
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
            **prompt_stats,
            **{k: float(v) for k, v in train_metrics.items() if np.ndim(v) == 0},
            **mem_stats,
            **times,
        }
        self.metrics.write("train", step, out)
        return out

    def _kl_due(self, step: int) -> bool:
        every = self.cfg.train.kl_initial_every
        return every > 0 and ((step + 1) % every == 0 or step == 0)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, step: int) -> dict[str, Any]:
        from pmd_jax import wiring

        t0 = time.perf_counter()
        res = wiring.evaluate(self.cfg, self.model, self.task, self.textgen, self.eval_problems,
                              self.run_dir / "eval" / f"step_{step:06d}", self.memory)
        res["time_eval"] = time.perf_counter() - t0
        self.metrics.write("eval", step, res)
        log.info(
            "eval @ step %d: accuracy %.4f [%.4f, %.4f] (%d problems x %d samples, %.0fs)",
            step, res["accuracy"], res.get("accuracy_ci_low", float("nan")),
            res.get("accuracy_ci_high", float("nan")), res.get("num_problems", 0),
            self.cfg.eval.n, res["time_eval"],
        )
        return res

    # ------------------------------------------------------------------ end of run
    def finish(self) -> None:
        from pmd_jax import wiring

        if not self.is_main:
            return
        plots = write_plots(self.run_dir)
        if self.memory is not None:
            self.memory.export_jsonl(self.run_dir / "memory.jsonl")
            self.memory.export_html(self.run_dir / "memory.html")
        if self.cfg.train.export_hf:
            wiring.export_hf(self.cfg, self.model, self.state, self.run_dir / "final_hf")
        log.info("run directory %s: %d plots written", self.run_dir, len(plots))
        self.metrics.close()


def run_dir_summary(run_dir: str | Path) -> str:
    """A short text summary of a run's eval records (used by the experiment runner)."""
    from pmd_jax.metrics import read_metrics

    evals = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if r["kind"] == "eval"]
    return "\n".join(f"step {r['step']}: accuracy {r.get('accuracy', float('nan')):.4f}"
                     for r in evals)

