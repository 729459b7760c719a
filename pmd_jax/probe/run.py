"""The probe's run: screen problems, sample every arm with paired keys, grade, report.

1. Problems: the training problems the memory holds items for (insights or a remembered
   success) that the task knows, and the first ``max_heldout`` problems of the evaluation
   split (none of them in the memory). Code tasks grade training problems on their hidden
   tests (``split="hidden"``: the half of the tests whose results never reached training
   feedback, so never the memory); a problem without hidden tests is left out.
2. Screening: ``screen_samples`` attempts of the ``none`` arm per problem (their own sampling
   seed, never reused below); only problems solved sometimes but not always are kept (a
   problem at 0 or 1 gives no discordant pairs), up to ``max_train`` / ``max_heldout``.
3. Arms: one request per arm over the kept problems in one fixed order, ``samples`` attempts
   each, one seed for every arm: the sampler folds its randomness from (seed, prompt index,
   sample index), so attempt j at a problem uses the same key in every arm. Where an arm is
   undefined the row is sent as ``none`` (keeping every other row's key) and dropped.
4. Statistics (probe/stats.py) and the report (probe/report.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pmd_jax import episode
from pmd_jax.episode import user_text
from pmd_jax.loop import build
from pmd_jax.loop.build import runs_code
from pmd_jax.loop.teaching import memory_prompt
from pmd_jax.memory.embedder import shared_embedder
from pmd_jax.memory.experience import MAX_PROBLEM_CHARS
from pmd_jax.memory.sanitize import sanitize_text
from pmd_jax.probe import arms as arms_mod
from pmd_jax.probe.memory_file import ProbeMemory
from pmd_jax.probe.report import write_report
from pmd_jax.run.metrics import Progress
from pmd_jax.sampling.base import SamplingParams
from pmd_jax.sampling.seeds import derive_seed

if TYPE_CHECKING:
    from pmd_jax.config.sections import RunConfig

log = logging.getLogger("pmd_jax.probe")


class ProbeError(ValueError):
    """The probe cannot run as asked (no problem of the memory in the task, no mixed ones)."""


def grade_split(task: Any) -> str:
    """The split training problems are graded on: "hidden" for code tasks, else "train"."""

    return "hidden" if runs_code(task) else "train"


class ProbeRunner:
    """The model, sampler and task of a run config, and one probe over them."""

    def __init__(self, cfg: RunConfig, memory: ProbeMemory, *, samples: int = 16,
                 screen_samples: int = 8, max_train: int = 64, max_heldout: int = 100,
                 heldout_candidates: int = 200,
                 train_arms: Sequence[str] = arms_mod.TRAIN_ARMS,
                 heldout_arms: Sequence[str] = arms_mod.HELDOUT_ARMS,
                 resume_dir: Path | None = None) -> None:
        if samples < 2 or screen_samples < 2:
            raise ProbeError(f"samples ({samples}) and screen_samples ({screen_samples}) must "
                             "be >= 2")
        self.cfg, self.memory = cfg, memory
        self.samples, self.screen_samples = int(samples), int(screen_samples)
        self.max_train, self.max_heldout = int(max_train), int(max_heldout)
        self.heldout_candidates = int(heldout_candidates)
        self.arms = {"train": arms_mod.check_arms("train", train_arms),
                     "heldout": arms_mod.check_arms("heldout", heldout_arms)}
        self.task = build.build_task(cfg, check_heldout=False, check_sandbox=True)
        self.model = build.load_model(cfg)
        self.sampler = build.build_sampler(cfg, self.model)
        self.split = grade_split(self.task)
        self.timings: dict[str, float] = {}
        # each finished batch of attempts, so a killed probe restarted with the same command
        # redoes only the batch it was in (None: nothing kept)
        self.done = DoneBatches(resume_dir / DONE_FILE) if resume_dir is not None else None

    # ------------------------------------------------------------------------ problems
    def problems(self) -> dict[str, list[Any]]:
        """The candidate problems of each group (before screening)."""
        mem = self.memory
        train = {str(p.id): p for p in self.task.problems("train")}
        wanted = sorted(set(mem.insights) | set(mem.successes))
        known = [train[p] for p in wanted if p in train]
        if not known:
            raise ProbeError(
                f"none of the memory's {len(wanted)} problems is a training problem of task "
                f"{self.cfg.task.name!r} (memory ids like {wanted[:3]}): probe a memory with "
                "the config of the run that wrote it")
        if self.split == "hidden":
            known = [p for p in known if self._owner(p).test_indices(p, "hidden")]
        self.missing = len(wanted) - len([p for p in wanted if p in train])
        held = [p for p in self.task.problems(self.cfg.task.eval_split)
                if str(p.id) not in set(wanted)]
        return {"train": known, "heldout": held[: self.heldout_candidates]}

    def _owner(self, problem: Any) -> Any:
        return self.task.owner(problem) if hasattr(self.task, "owner") else self.task

    # ------------------------------------------------------------------------ sampling
    def _params(self, n: int, purpose: str) -> SamplingParams:
        return episode.rollout_params(self.cfg, self.model, int(n), purpose)

    def attempt(self, problems: Sequence[Any], attempts: Sequence[arms_mod.Attempt | None],
                params: SamplingParams, split: str, label: str) -> np.ndarray:
        """bool[len(problems), params.n]: each attempt graded (undefined rows: ``none``);
        a batch finished before a restart is read back instead (:class:`DoneBatches`)."""

        prompts = []
        for p, att in zip(problems, attempts, strict=True):
            a = att or arms_mod.NONE
            prompts.append(memory_prompt(self.cfg, self.model, self.task, p, self.task.prompt(p),
                                         a.items, a.successful_attempt))
        key = batch_key(label, split, params, prompts, self.cfg)
        if self.done is not None and (kept := self.done.get(key)) is not None:
            log.info("%s: %d attempts restored from %s", label, kept.size, self.done.path)
            return kept
        ok = self._sample_and_grade(problems, prompts, params, split, label)
        if self.done is not None:
            self.done.put(key, ok)
        return ok

    def _sample_and_grade(self, problems: Sequence[Any], prompts: list[list[int]],
                          params: SamplingParams, split: str, label: str) -> np.ndarray:
        prog = Progress(len(prompts) * params.n, label, unit="attempt")

        def progress(rows: int) -> None:
            prog.update(rows)

        att = episode.attempt(self.sampler, self.model, self.task, problems, prompts, params,
                              split=split, progress=progress)
        prog.close()
        thr = float(self.cfg.teacher_prompt.success_threshold)
        return att.grid(len(problems), params.n, att.solved(thr), bool)

    # ------------------------------------------------------------------------ the probe
    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        cands = self.problems()
        splits = {"train": self.split, "heldout": self.cfg.task.eval_split}
        caps = {"train": self.max_train, "heldout": self.max_heldout}
        kept: dict[str, list[Any]] = {}
        screen: dict[str, dict[str, Any]] = {}
        for group, probs in cands.items():
            if group == "heldout" and self.max_heldout <= 0:
                kept[group] = []
                continue
            ts = time.perf_counter()
            ok = self.attempt(probs, [arms_mod.NONE] * len(probs),
                              self._params(self.screen_samples, f"probe.screen.{group}"),
                              splits[group], f"probe screening ({group})")
            solved = ok.sum(axis=1)
            mixed = [p for p, s in zip(probs, solved, strict=True)
                     if 0 < s < self.screen_samples]
            kept[group] = mixed[: caps[group]]
            screen[group] = {"candidates": len(probs), "mixed": len(mixed),
                             "kept": len(kept[group]),
                             "never_solved": int((solved == 0).sum()),
                             "always_solved": int((solved == self.screen_samples).sum()),
                             "screen_rate": float(ok.mean()) if ok.size else float("nan")}
            self.timings[f"screen_{group}"] = time.perf_counter() - ts
            log.info("probe screening (%s): %d candidates, %d mixed, %d kept", group,
                     len(probs), len(mixed), len(kept[group]))
        if not kept["train"]:
            raise ProbeError(
                f"screening kept no training problem: of {len(cands['train'])}, none was solved"
                f" in some but not all of {self.screen_samples} attempts; raise "
                "--screen_samples or probe a model that solves some of them")

        # embeddings of every problem that retrieval can touch, as the memory embeds them
        mcfg = self.cfg.memory
        embedder = shared_embedder(mcfg.embedder)
        extra = tuple(self.model.tokenizer.special_tokens)
        pool = {str(p.id): p for p in cands["train"]}
        train_all = {str(p.id): p for p in self.task.problems("train")}
        need = set(pool) | {m for ms in self.memory.clusters.values() for m in ms}
        need |= set(self.memory.insights)
        text_of = {pid: user_text(self.task.prompt(train_all[pid]))
                   for pid in sorted(need) if pid in train_all}
        text_of.update({str(p.id): user_text(self.task.prompt(p)) for p in kept["heldout"]})
        ids = sorted(text_of)
        vecs = embedder.embed([sanitize_text(text_of[i][:MAX_PROBLEM_CHARS], 4000, extra)
                               for i in ids], query=True)
        vectors = dict(zip(ids, vecs, strict=True))
        train_vectors = {i: v for i, v in vectors.items() if i in train_all}
        retrieval = arms_mod.Retrieval(self.memory, train_vectors, mcfg.index,
                                       int(mcfg.behavior.top_k))

        outcomes: dict[str, dict[str, dict[str, np.ndarray]]] = {}
        defined: dict[str, dict[str, int]] = {}
        examples: dict[str, dict[str, str]] = {}
        diags: dict[str, Any] = {}
        for group in ("train", "heldout"):
            probs = kept[group]
            if not probs:
                continue
            pids = [str(p.id) for p in probs]
            rng = np.random.default_rng(derive_seed(f"probe.arms.{group}", int(self.cfg.seed)))
            planted = {str(p.id): arms_mod.planted_item(self.task, p) for p in probs}
            atts, diags[group] = arms_mod.build_attempts(
                group, self.arms[group], pids, self.memory, retrieval,
                {**train_vectors, **vectors}, planted.get, rng)
            params = self._params(self.samples, f"probe.arms.{group}")
            outcomes[group], defined[group], examples[group] = {}, {}, {}
            for arm in self.arms[group]:
                rows = atts[arm]
                n_def = sum(a is not None for a in rows)
                defined[group][arm] = n_def
                if not n_def:
                    log.info("probe arm %s (%s): undefined for every problem, skipped", arm,
                             group)
                    continue
                ta = time.perf_counter()
                ok = self.attempt(probs, rows, params, splits[group],
                                  f"probe arm {arm} ({group})")
                outcomes[group][arm] = {pid: ok[i] for i, pid in enumerate(pids)
                                        if rows[i] is not None}
                first = next(i for i, a in enumerate(rows) if a is not None)
                examples[group][arm] = self._example(probs[first], rows[first])
                self.timings[f"{group}_{arm}"] = time.perf_counter() - ta
        self.timings["total"] = time.perf_counter() - t0
        return {"screen": screen, "outcomes": outcomes, "defined": defined,
                "examples": examples, "diagnostics": diags, "timings": dict(self.timings),
                "missing_problems": int(self.missing)}

    def _example(self, problem: Any, att: arms_mod.Attempt | None) -> str:
        """The decoded prompt of one arm at one problem (for the report)."""

        a = att or arms_mod.NONE
        ids = memory_prompt(self.cfg, self.model, self.task, problem, self.task.prompt(problem),
                            a.items, a.successful_attempt)
        return f"[{problem.id}] " + self.model.tokenizer.decode(ids, skip_special=False)


DONE_FILE = "probe_batches.jsonl"


def batch_key(label: str, split: str, params: SamplingParams, prompts: list[list[int]],
              cfg: RunConfig) -> str:
    """What a batch of attempts depends on: its label and grading split, the sampling
    parameters (seed included), every prompt's tokens, the model and the task's knobs."""

    h = hashlib.sha256()
    for part in (label, split, repr(params), cfg.model.source, repr(cfg.task)):
        h.update(part.encode())
        h.update(b"\0")
    for ids in prompts:
        h.update(np.asarray(ids, np.int64).tobytes())
        h.update(b"\1")
    return h.hexdigest()


class DoneBatches:
    """Finished batches of a probe, one JSON line each (key, outcomes), appended as each
    ends; a line cut by a kill is ignored when read back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[str, np.ndarray] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    self.rows[str(row["key"])] = np.asarray(row["ok"], bool)
                except (ValueError, KeyError, TypeError):
                    continue  # (a line cut by a kill)

    def get(self, key: str) -> np.ndarray | None:
        return self.rows.get(key)

    def put(self, key: str, ok: np.ndarray) -> None:
        self.rows[key] = ok
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"key": key, "ok": ok.astype(int).tolist()}) + "\n")
            f.flush()
            os.fsync(f.fileno())


def write_outputs(out: Path, setup: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    return write_report(Path(out), setup, result)
