"""Held-out splits: seeded disjoint train/validation problems, id overlap, transfer tasks.

- ``split_problems``: the seeded disjoint train/validation split of MBPP and GSM8K.
- ``overlapping_ids``: the problem ids a run would both train and evaluate on; config
  validation refuses a run with any unless ``eval.allow_in_sample=True``, and then labels its
  evaluation "in-sample" (``IN_SAMPLE``).
- ``TransferTask``: trains on one task's "train" split and evaluates on another task
  (``task.eval_task``, e.g. MBPP -> HumanEval); each problem is prompted, verified and
  leak-checked by the task it came from.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from pmd_jax.tasks.base import BaseTask, Messages, Problem, Task, TaskError, VerifyResult

IN_SAMPLE = "in-sample"


def split_problems(probs: Sequence[Problem], train_size: int, eval_size: int, seed: int,
                   task: str) -> tuple[list[Problem], list[Problem]]:
    """Seeded disjoint (train, validation): the ids sorted, then permuted with ``seed``; the
    first ``train_size`` are train, the next ``eval_size`` validation (load order kept)."""
    n = len(probs)
    if train_size < 1 or eval_size < 1 or train_size + eval_size > n:
        raise TaskError(f"{task}: train_size={train_size} and eval_size={eval_size} must be "
                        f">= 1 with train_size + eval_size <= {n} (the problems available)")
    ids = [p.id for p in probs]
    if len(set(ids)) != n:
        raise TaskError(f"{task}: problem ids are not unique")
    order = sorted(ids)
    random.Random(seed).shuffle(order)
    train_ids = set(order[:train_size])
    val_ids = set(order[train_size:train_size + eval_size])
    return [p for p in probs if p.id in train_ids], [p for p in probs if p.id in val_ids]


def overlapping_ids(train: Sequence[Problem], evaluation: Sequence[Problem]) -> list[str]:
    """Sorted ids present in both problem lists."""
    return sorted({str(p.id) for p in train} & {str(p.id) for p in evaluation})


class TransferTask(BaseTask):
    """"train" problems from ``train_task``, every other split from ``eval_task``."""

    def __init__(self, train_task: Task, eval_task: Task) -> None:
        self.train_task = train_task
        self.eval_task = eval_task
        self.name = f"{train_task.name}->{eval_task.name}"
        self._owner: dict[str, Task] = {}

    def __getattr__(self, attr: str) -> Any:  # other attributes: the training task's
        if attr in ("train_task", "eval_task", "_owner"):
            raise AttributeError(attr)
        return getattr(self.train_task, attr)

    def problems(self, split: str) -> list[Problem]:
        task = self.train_task if split == "train" else self.eval_task
        probs = task.problems(split)
        for p in probs:
            self._owner.setdefault(str(p.id), task)
        return probs

    def owner(self, problem: Problem) -> Task:
        """The task a problem came from (the training task for one never listed)."""
        return self._owner.get(str(problem.id), self.train_task)

    def prompt(self, problem: Problem) -> Messages:
        return self.owner(problem).prompt(problem)

    def response_prefix(self, problem: Problem) -> str:
        fn = getattr(self.owner(problem), "response_prefix", None)
        return fn(problem) if fn is not None else ""

    def verify(self, problem: Problem, response_text: str, split: str = "train") -> VerifyResult:
        return self.owner(problem).verify(problem, response_text, split)

    def verify_batch(self, problems: Sequence[Problem], responses: Sequence[str],
                     split: str = "train") -> list[VerifyResult]:
        if len(problems) != len(responses):
            raise ValueError(
                f"verify_batch: {len(problems)} problems but {len(responses)} responses")
        groups: dict[int, tuple[Task, list[int]]] = {}
        for i, p in enumerate(problems):
            t = self.owner(p)
            groups.setdefault(id(t), (t, []))[1].append(i)
        out: list[VerifyResult | None] = [None] * len(problems)
        for t, idx in groups.values():
            res = t.verify_batch([problems[i] for i in idx], [responses[i] for i in idx], split)
            for i, r in zip(idx, res, strict=True):
                out[i] = r
        return out  # type: ignore[return-value]

    def gold_leak_strings(self, problem: Problem) -> list[str]:
        return self.owner(problem).gold_leak_strings(problem)

    def close(self) -> None:
        for t in (self.train_task, self.eval_task):
            fn = getattr(t, "close", None)
            if fn is not None:
                fn()
