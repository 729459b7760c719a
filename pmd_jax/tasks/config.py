"""The run config's ``task`` section (:class:`TaskConfig`), declared next to the tasks as
``distill`` and ``memory`` declare theirs: the task registry reads it, and
:mod:`pmd_jax.config.sections` (which reads the registry) composes it into the run config."""

from __future__ import annotations

import dataclasses

from pmd_jax.config.schema import Section, knob


@dataclasses.dataclass(frozen=True)
class TaskConfig(Section):
    """The task: its problems, prompts and held-out split."""

    name: str = knob("sciq", "A task of pmd_jax/tasks/registry.py.")
    path: str = knob("", "JSONL for sciknoweval / livecodebench / jsonl_mcq|code|math.")
    max_train_problems: int = knob(0, "0 = all.")
    max_eval_problems: int = knob(200, "Evaluation problems.")
    eval_split: str = knob("validation", "The split evaluated.")
    prompt_style: str = knob("reasoning", "Multiple choice: 'reasoning' (SciKnowEval/SDPO "
                             "prompt), 'direct' (answer tag opened, the letter) or "
                             "'direct_text' (answer tag opened, the option's text); the last "
                             "two are ours, for small CPU models.")
    valid_fraction: float = knob(0.1, "SciQ and the jsonl_* kinds (ours): the held-out "
                                 "fraction (0.1 = the SDPO test_ratio).")
    include_support: bool = knob(False, "Whether the question's support passage opens the "
                                 "prompt (SciQ; jsonl_mcq: its 'passage').")
    valid_size: int = knob(0, "jsonl_* kinds (docs/tasks.md, 'Bring your own data'): held-out size "
                           "(0 = valid_fraction).")
    split_seed: int = knob(42, "Seed of the held-out split.")
    shuffle_options: bool = knob(True, "Multiple choice: seeded per-problem option order.")
    sciknoweval_domain: str = knob("Biology,Chemistry,Material,Physics",
                                   "SciKnowEval filter (comma-separated; '' = no filter); "
                                   "defaults as METHOD.md 1.7.")
    sciknoweval_level: str = knob("L3", "SciKnowEval filter.")
    sciknoweval_type: str = knob("mcq-4-choices,mcq-2-choices", "SciKnowEval filter.")
    mbpp_train_size: int = knob(400, "Held-out evaluation (pmd_jax/tasks/heldout.py): MBPP "
                                "and GSM8K are split into disjoint train / validation problems "
                                "of these sizes (a permutation seeded with split_seed).")
    mbpp_eval_size: int = knob(100, "See mbpp_train_size.")
    gsm8k_train_size: int = knob(1000, "See mbpp_train_size.")
    gsm8k_eval_size: int = knob(319, "See mbpp_train_size.")
    eval_task: str = knob("", "Evaluate on that task's eval_split instead ('' = the task's "
                          "own), e.g. 'humaneval' (all 164) for a run trained on MBPP.")
