"""The peer SDPO trainer, sdpo-rl (SDPO for TRL), set up on one of our run configs.

Shared by ``bench_sdpo_peer.py`` (speed, same batch) and ``peer_sdpo_rl_cells.py`` (learning,
same budget), issue 53. Runs in the venv of ``launch/setup_peer_venv.sh`` (TRL 1.16.0,
sdpo-rl 0.0.3, seeing this environment's torch, transformers and pmd_jax).

What the peer gets from the run config ``cfg`` (the same values our run uses):

* the training problems (``task.max_train_problems`` of ``task.name``), each prompt as the
  token ids our run samples from (our chat format, then the task's response prefix) given to
  TRL as a plain-text prompt; :func:`peer_data` checks that the HF tokenizer gives the same ids
  back;
* ``rollout.problems_per_step`` prompts x ``rollout.n`` generations a step (one optimizer step
  per generation batch, as verl and our loop do), ``rollout.temperature`` / ``top_p`` /
  ``top_k``, ``rollout.max_tokens``;
* the reward: our task's verifier on prefix + completion (:class:`Grader`), its feedback
  offered to the teacher as ``teacher_prompt.include_feedback`` says;
* SDPO: ``distill.loss`` (alpha, top-K, tail, IS clip), the EMA teacher at
  ``distill.teacher.rate``, ``teacher_prompt`` (success threshold, no self-demonstration,
  feedback only without a solution, reprompt cap);
* AdamW: ``distill.optim`` (lr, linear warmup then constant, weight decay, clip, betas, eps).

Where sdpo-rl and TRL have a choice we do not make, their defaults stand (HF ``generate`` for
sampling, TRL's seeded prompt shuffling, its teacher-prompt template, which is verl's).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # pmd_jax from this checkout, installed or not
    sys.path.insert(1, str(ROOT))
def default_peer_python() -> str:
    """``$PMD_PEER_PYTHON``, else the interpreter of ``launch/setup_peer_venv.sh``'s venv
    (``$PMD_PEER_VENV``, default ``~/.cache/pmd_jax/venv-sdpo-rl``)."""
    import os

    venv = os.environ.get("PMD_PEER_VENV", str(Path.home() / ".cache" / "pmd_jax"
                                               / "venv-sdpo-rl"))
    return os.environ.get("PMD_PEER_PYTHON", str(Path(venv) / "bin" / "python"))


SETUP_HINT = ("run launch/setup_peer_venv.sh (a venv with trl 1.16.0 and sdpo-rl 0.0.3 that "
              "sees this environment), or pass --peer_python")


def load_run_config(config: str, overrides: dict[str, Any]):
    """The frozen run config of ``config`` (a path under the repo) with dotted overrides."""
    from pmd_jax.config import apply_mode, freeze
    from pmd_jax.config.cli import load_config_file
    from pmd_jax.config.modes import set_dotted

    c = load_config_file(str(ROOT / config))
    for key, value in overrides.items():
        set_dotted(c, key, value)
    return freeze(apply_mode(c))


@dataclasses.dataclass
class PeerData:
    cfg: Any
    task: Any
    problems: list
    ids: list[list[int]]
    texts: list[str]
    prefixes: list[str]
    hf_dir: Path


def peer_data(cfg) -> PeerData:
    """The run's training problems as the peer sees them (prompt texts with our token ids)."""
    from transformers import AutoTokenizer

    from pmd_jax import episode
    from pmd_jax.loop.build import build_task, select_problems
    from pmd_jax.models.assets import EMBEDDED_MODELS
    from pmd_jax.models.gguf_io import embedded_hf_dir
    from pmd_jax.models.tokenizer import Tokenizer

    task = build_task(cfg)
    problems, _ = select_problems(cfg, task)
    embedded = EMBEDDED_MODELS[cfg.model.source]
    hf_dir = Path(embedded_hf_dir(cfg.model.source))
    tok = Tokenizer.from_pretrained(hf_dir, chat_format=embedded.chat_format)
    ids, texts, prefixes = [], [], []
    for p in problems:
        pre = episode.response_prefix(task, p)
        toks = tok.encode_chat(task.prompt(p), add_generation_prompt=True)
        toks = toks + (tok.encode(pre) if pre else [])
        ids.append(toks)
        texts.append(tok.decode(toks, skip_special=False))
        prefixes.append(pre)
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    differ = sum(hf_tok(t, add_special_tokens=False)["input_ids"] != i
                 for t, i in zip(texts, ids, strict=True))
    if differ:
        raise RuntimeError(f"{differ} of {len(texts)} prompts tokenize differently in HF: the "
                           "peer would not see our prompt tokens")
    return PeerData(cfg, task, problems, ids, texts, prefixes, hf_dir)


class Grader:
    """The peer's reward function: our task's verifier on prefix + completion; the verifier's
    feedback kept in ``last_feedback`` (sdpo-rl reads it when feedback is on)."""

    def __init__(self, data: PeerData):
        self.data = data
        self.last_feedback: list[str] = []
        self.__name__ = "pmd_jax_verifier"

    def __call__(self, prompts, completions, problem_index, **_):
        rewards, feedback = [], []
        for c, i in zip(completions, problem_index, strict=True):
            r = self.data.task.verify(self.data.problems[i], self.data.prefixes[i] + c)
            rewards.append(float(r.reward))
            feedback.append(r.feedback)
        self.last_feedback = feedback
        return rewards


def teacher_prefix_template(data: PeerData) -> dict[str, Any]:
    """``apply_chat_template_kwargs`` that give sdpo-rl's teacher the task's response prefix.

    sdpo-rl builds the teacher's context from the decoded student prompt, as a new user turn
    under the chat template with a fresh generation prompt, then the completion: a response
    prefix the task put at the start of the assistant turn (SciQ's ``<answer>`` in the
    embedded default) is not in it, so the teacher scores the completion as if the turn had
    begun without it. Its config passes ``apply_chat_template_kwargs`` to the tokenizer; a
    chat template that ends the generation prompt with the prefix puts it back. Only for a
    task whose problems share one prefix."""
    from transformers import AutoTokenizer

    prefixes = set(data.prefixes)
    if len(prefixes) != 1 or not next(iter(prefixes)):
        raise ValueError(f"the task's response prefixes are {sorted(prefixes)}: one shared, "
                         "non-empty prefix is needed")
    tpl = AutoTokenizer.from_pretrained(data.hf_dir).chat_template
    pre = next(iter(prefixes)).replace("'", "\\'")
    return {"chat_template": tpl + "{% if add_generation_prompt %}{{ '" + pre + "' }}{% endif %}"}


def build_trainer(data: PeerData, *, seed: int, max_steps: int, out_dir: str | Path,
                  device: str = "cpu", teacher_prefix: bool = False):
    """sdpo-rl's ``SDPOTrainer`` on ``data`` with the run config's settings; with
    ``teacher_prefix`` its teacher's context also gets the task's response prefix
    (:func:`teacher_prefix_template`)."""
    try:
        import torch
        from datasets import Dataset
        from sdpo_rl import SDPOConfig, SDPOTrainer
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig
    except ImportError as e:
        raise RuntimeError(f"the peer's environment lacks {e.name}: {SETUP_HINT}") from e
    cfg = data.cfg
    r, o, tp, loss = cfg.rollout, cfg.distill.optim, cfg.teacher_prompt, cfg.distill.loss
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(data.hf_dir, dtype=torch.float32)
    gargs = GRPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=r.problems_per_step * r.n,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=int(r.n), max_completion_length=int(r.max_tokens),
        temperature=float(r.temperature), top_p=float(r.top_p), top_k=int(r.top_k) or None,
        learning_rate=float(o.lr), lr_scheduler_type="constant_with_warmup",
        warmup_steps=int(o.warmup_steps), weight_decay=float(o.weight_decay),
        max_grad_norm=float(o.grad_clip) if o.grad_clip is not None else 0.0,
        adam_beta1=float(o.b1), adam_beta2=float(o.b2), adam_epsilon=float(o.eps),
        max_steps=int(max_steps), logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=device == "cpu", bf16=False, seed=int(seed), beta=0.0,
        dataloader_num_workers=0)
    scfg = SDPOConfig(
        alpha=float(loss.alpha), distillation_topk=int(loss.topk),
        distillation_add_tail=bool(loss.add_tail), is_clip=loss.is_clip,
        teacher_mode="ema", teacher_update_rate=float(cfg.distill.teacher.rate),
        success_reward_threshold=float(tp.success_threshold),
        dont_reprompt_on_self_success=bool(tp.dont_reprompt_on_self_success),
        include_environment_feedback=bool(tp.include_feedback),
        environment_feedback_only_without_solution=bool(tp.feedback_only_without_solution),
        max_reprompt_length=int(tp.max_tokens),
        apply_chat_template_kwargs=teacher_prefix_template(data) if teacher_prefix else {})
    rows = [{"prompt": t, "problem_index": i} for i, t in enumerate(data.texts)]
    return SDPOTrainer(model=model, args=gargs, sdpo_config=scfg,
                       processing_class=AutoTokenizer.from_pretrained(data.hf_dir),
                       reward_funcs=[Grader(data)], train_dataset=Dataset.from_list(rows))


def clock(trainer) -> dict[str, list[float]]:
    """Per-step times of ``trainer`` (filled as it trains): ``generate`` (TRL's
    ``_generate``), ``score`` (``_generate_and_score_completions``, which holds it) and
    ``step`` (``on_step_begin`` -> ``on_step_end``, after the EMA update's callback)."""
    from transformers import TrainerCallback

    times: dict[str, list[float]] = {"generate": [], "score": [], "step": []}

    def timed(name, fn):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[name].append(time.perf_counter() - t0)
        return wrapped

    trainer._generate = timed("generate", trainer._generate)
    trainer._generate_and_score_completions = timed(
        "score", trainer._generate_and_score_completions)

    class StepClock(TrainerCallback):
        t0 = 0.0

        def on_step_begin(self, *a, **k):
            StepClock.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times["step"].append(time.perf_counter() - StepClock.t0)

    trainer.add_callback(StepClock())  # after sdpo-rl's EMA callback (added at __init__)
    return times


def step_rewards(trainer) -> list[float | None]:
    """The mean training reward of each logged step (TRL's ``reward``)."""
    return [float(h["reward"]) for h in trainer.state.log_history if "reward" in h]
