"""Phase 1 of the loop, the rollouts: the problem stream, a step's rollout record, and the
phase itself with its background thread.

:class:`ProblemStream` draws the training problems: each epoch is a seeded permutation of them;
the cursor (epoch, position) is all the state there is, so a restored run draws exactly the
batches it would have drawn. :class:`StepBatch` is what one step's rollouts carry through the
loop (sampled, then verified, then turned into teacher prompts and a train batch).
:class:`RolloutPhase` draws a step's problems, samples and decodes them on the episode road
(``pmd_jax/episode.py``), verifies them, and with ``rollout.overlap`` samples the next step's
batch in a background thread (``loop/trainer.py``'s docstring: when, and with which weights).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import numpy as np

from pmd_jax import episode
from pmd_jax.loop.phases import TrainingError, retry
from pmd_jax.sampling.base import Messages, Rollout, Rollouts

T = TypeVar("T")


@dataclasses.dataclass
class DataCursor:
    epoch: int = 0
    position: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> DataCursor:
        return cls(int(d["epoch"]), int(d["position"]))


class ProblemStream(Generic[T]):
    """Draws batches of problems epoch by epoch in a seeded order (no problem repeats within
    an epoch; a batch that crosses an epoch boundary continues into the next permutation)."""

    def __init__(self, items: Sequence[T], seed: int, cursor: DataCursor | None = None) -> None:
        if not items:
            raise ValueError("ProblemStream needs at least one problem")
        self.items = list(items)
        self.seed = int(seed)
        self.cursor = cursor or DataCursor()

    def _order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        return rng.permutation(len(self.items))

    def next_batch(self, size: int) -> list[T]:
        out: list[T] = []
        while len(out) < size:
            order = self._order(self.cursor.epoch)
            take = min(size - len(out), len(order) - self.cursor.position)
            idx = order[self.cursor.position : self.cursor.position + take]
            out.extend(self.items[i] for i in idx)
            self.cursor.position += take
            if self.cursor.position >= len(order):
                self.cursor = DataCursor(self.cursor.epoch + 1, 0)
        return out



@dataclasses.dataclass(frozen=True)
class Verdicts:
    """What verification made of a step's rollouts: one task result per rollout (reward,
    feedback, ...) in rollout order, and the rewards as ``[B, G]``."""

    results: list[Any]
    rewards: np.ndarray


@dataclasses.dataclass
class StepBatch:
    """Host-side record of one step's rollouts (prompt-major, G rollouts per problem).

    ``messages``: each problem's prompt as the task writes it (``task.prompt``, computed once
    when the problems are drawn; the student's rollout prompt may add to it, e.g. fast_slow's
    context). ``rewards`` / ``results`` are empty until :meth:`verified` gives the verified
    batch."""

    problems: list[Any]
    student_prompts: list[list[int]]
    rollouts: Rollouts
    texts: list[str]
    rewards: np.ndarray  # [B, G]
    results: list[Any]
    step: int = -1  # the training step these rollouts are for
    weights_version: int = 0  # the policy version (published step) that sampled them
    skipped: int = 0  # problems skipped for over-long prompts while drawing this batch
    sample_seconds: float = 0.0  # wall time of the generate() call (wherever it ran)
    prefetched: bool = False  # sampled during the previous step (rollout.overlap)
    messages: list[Any] = dataclasses.field(default_factory=list)

    def verified(self, v: Verdicts) -> StepBatch:
        """This batch with its verdicts (a new record; this one is unchanged)."""
        return dataclasses.replace(self, results=list(v.results), rewards=v.rewards)

    # a checkpoint holds a sampled batch before verification (the prefetched one)
    def to_tree(self) -> dict[str, Any]:
        """This (unverified) batch as a tree of JSON values and arrays (``run/host_state``),
        each problem as its id."""
        if self.results:
            raise ValueError("StepBatch.to_tree: a verified batch (its results are task "
                             "objects; a checkpoint holds the batch before verification)")
        return {
            "problems": [str(p.id) for p in self.problems],
            "student_prompts": [[int(t) for t in x] for x in self.student_prompts],
            "rollouts": [{"prompt_index": int(r.prompt_index), "sample_index": int(r.sample_index),
                          "tokens": r.tokens, "logprobs": r.logprobs,
                          "finish_reason": str(r.finish_reason)} for r in self.rollouts],
            "weights_version_of_rollouts": self.rollouts.weights_version,
            "texts": list(self.texts), "rewards": np.asarray(self.rewards),
            "step": int(self.step), "weights_version": int(self.weights_version),
            "skipped": int(self.skipped), "sample_seconds": float(self.sample_seconds),
            "prefetched": bool(self.prefetched), "messages": self.messages,
        }

    @classmethod
    def from_tree(cls, tree: dict[str, Any], items: Sequence[Any]) -> StepBatch:
        """The batch :meth:`to_tree` wrote, its problems taken from ``items`` (the data
        stream's) by id; refused when one is not there, or not once (the task or its training
        set changed)."""

        by_id: dict[str, list[Any]] = {}
        for p in items:
            by_id.setdefault(str(p.id), []).append(p)
        problems = []
        for pid in tree["problems"]:
            found = by_id.get(str(pid), [])
            if len(found) != 1:
                raise ValueError(
                    f"the checkpoint's prefetched rollouts are of problem {pid!r}, which this "
                    f"run's training problems hold {len(found)} times, not once (the task, its "
                    "training set or task.max_train_problems changed)")
            problems.append(found[0])
        rollouts = Rollouts([Rollout(int(r["prompt_index"]), int(r["sample_index"]),
                                     r["tokens"], r["logprobs"], r["finish_reason"])
                             for r in tree["rollouts"]], tree["weights_version_of_rollouts"])
        return cls(problems, [list(x) for x in tree["student_prompts"]], rollouts,
                   list(tree["texts"]), tree["rewards"], [], step=int(tree["step"]),
                   weights_version=int(tree["weights_version"]), skipped=int(tree["skipped"]),
                   sample_seconds=float(tree["sample_seconds"]),
                   prefetched=bool(tree["prefetched"]), messages=tree["messages"])


@dataclasses.dataclass
class Drawn:
    """A step's problems and prompts, drawn from the data stream (main thread) before the
    generate() call, which may run in the background sampler thread."""

    step: int
    problems: list[Any]
    prefixes: list[str]
    prompts: list[list[int]]
    skipped: int
    messages: list[Any]  # each problem's task prompt (StepBatch.messages)


class RolloutPhase:
    """Draws, samples, decodes and verifies a step's rollouts; owns the data stream and, with
    ``rollout.overlap``, the background thread and the batch it prefetches (``next``: a Future
    while it samples, the StepBatch once joined; the checkpoint stores the joined batch).

    ``sampler``: the rollout sampler (the only thing the background thread touches);
    ``student_messages(step, index, task_messages)``: the mode's student prompt (fast_slow
    adds its context)."""

    def __init__(self, cfg: Any, model: Any, task: Any, sampler: Any, stream: ProblemStream,
                 student_messages: Callable[[int, int, Messages], Messages]) -> None:
        self.cfg, self.model, self.task, self.sampler = cfg, model, task, sampler
        self.stream = stream
        self.student_messages = student_messages
        self.next: Future | StepBatch | None = None
        self._pool: ThreadPoolExecutor | None = None

    def params(self, step: int) -> Any:
        return episode.rollout_params(self.cfg, self.model, int(self.cfg.rollout.n), "rollout",
                                      int(step))

    def sample(self, step: int) -> StepBatch:
        """Draws step ``step``'s problems and samples their rollouts (in this thread)."""
        drawn = self.draw(step)
        return self.decode(drawn, self.generate(drawn))

    def draw(self, step: int) -> Drawn:
        """The next problems of the data stream (advances the cursor) and their prompts;
        problems whose prompt exceeds ``rollout.max_prompt_tokens`` are counted and skipped."""
        r = self.cfg.rollout
        problems: list[Any] = []
        prefixes: list[str] = []
        prompts: list[list[int]] = []
        messages: list[Any] = []
        skipped = 0
        while len(problems) < r.problems_per_step:
            for p in self.stream.next_batch(r.problems_per_step - len(problems)):
                task_msgs = self.task.prompt(p)  # (the only call: StepBatch.messages)
                msgs = self.student_messages(step, len(problems), task_msgs)  # (+ a context)
                pre, ids = episode.encode(self.model, self.task, p, msgs)
                if len(ids) > r.max_prompt_tokens:
                    skipped += 1
                    if skipped > 100 * r.problems_per_step:
                        raise TrainingError(
                            "almost every prompt is longer than rollout.max_prompt_tokens="
                            f"{r.max_prompt_tokens}: raise it"
                        )
                    continue
                problems.append(p)
                prefixes.append(pre)
                prompts.append(ids)
                messages.append(task_msgs)
        return Drawn(step, problems, prefixes, prompts, skipped, messages)

    def generate(self, drawn: Drawn) -> tuple[Rollouts, float]:
        """The generate() call alone: the only part that runs in the rollout thread (it
        touches nothing but the sampler; tokenizing and the data stream stay on the main
        thread)."""
        t0 = time.perf_counter()
        sp = self.params(drawn.step)
        rollouts = retry(lambda: episode.generate(self.sampler, drawn.prompts, sp),
                         "rollout generation", self.cfg.rollout.retries)
        return rollouts, time.perf_counter() - t0

    def decode(self, drawn: Drawn, generated: tuple[Rollouts, float]) -> StepBatch:
        rollouts, seconds = generated
        texts = episode.decode(self.model, rollouts, drawn.prefixes)
        v = rollouts.weights_version
        return StepBatch(drawn.problems, drawn.prompts, rollouts, texts, np.zeros(0), [],
                         step=drawn.step, weights_version=0 if v is None else int(v),
                         skipped=drawn.skipped, sample_seconds=seconds,
                         messages=drawn.messages)

    def verify(self, sb: StepBatch) -> Verdicts:
        """The task's verdict on each rollout (``sb`` is not changed: ``sb.verified``)."""
        results = episode.grade(self.task, sb.problems, sb.rollouts, sb.texts, "train")
        return Verdicts(results, np.array([r.reward for r in results],
                                          np.float64).reshape(-1, int(self.cfg.rollout.n)))

    # ------------------------------------------------------------------ overlap
    def take(self, step: int) -> StepBatch:
        """This step's rollouts: the batch prefetched during the previous step, or sampled
        now (the first step, overlap off, or a resume without a prefetched batch)."""
        nxt, self.next = self.next, None
        if isinstance(nxt, Future):
            nxt = self._join(nxt)
        if nxt is None:
            return self.sample(step)
        if nxt.step != step:
            raise TrainingError(f"internal: prefetched rollouts of step {nxt.step} at step {step}")
        nxt.prefetched = True
        return nxt

    def prefetch(self, step: int) -> None:
        """Starts sampling step ``step``'s rollouts in the background with the weights the
        sampler holds now (published after step - 2): one version stale when trained on."""
        drawn = self.draw(step)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pmd-rollouts")
        fut = self._pool.submit(self.generate, drawn)
        fut.drawn = drawn  # type: ignore[attr-defined]
        self.next = fut

    def _join(self, fut: Future) -> StepBatch:
        return self.decode(fut.drawn, fut.result())  # type: ignore[attr-defined]

    def finish_prefetch(self) -> StepBatch | None:
        """Waits for the background batch and returns it (None: none); must precede the next
        publish (the batch is sampled entirely with one weights version) and any checkpoint
        (which stores it)."""
        if isinstance(self.next, Future):
            self.next = self._join(self.next)
        return self.next

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The phase's checkpoint slots: the data cursor and, with rollout.overlap, the next
        step's rollouts (joined first; the cursor is already past them)."""
        nxt = self.finish_prefetch()
        return {"data_cursor": self.stream.cursor.state_dict(),
                "prefetch": nxt.to_tree() if nxt is not None else None}

    def load_state_dict(self, extras: dict[str, Any], step: int) -> bool:
        """Restores :meth:`state_dict`'s slots at step ``step``; whether a prefetched batch
        came back. That batch was sampled (one version stale) before the checkpoint and the
        cursor is already past it: the resumed run trains on it exactly as the killed run
        would have (its stale weights are not in the checkpoint to sample it again)."""
        self.stream.cursor = DataCursor.from_state(extras["data_cursor"])
        tree = extras.get("prefetch")
        if tree is None:
            return False
        try:
            sb = StepBatch.from_tree(tree, self.stream.items)
        except ValueError as e:
            raise TrainingError(str(e)) from None
        if not sb.messages:  # (converted from a pickle made before StepBatch carried them)
            sb.messages = [self.task.prompt(p) for p in sb.problems]
        if sb.step != step:
            raise TrainingError(f"checkpoint at step {step} holds the prefetched rollouts of "
                                f"step {sb.step}")
        self.next = sb
        return True

    def stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
