"""Embedded default: SmolLM2-135M-Instruct on SciQ, PMD, in-process JAX sampler, CPU.

Sized to finish in about 30 minutes on a 2-core CPU; every value can be overridden on the
command line, e.g. --config.train.steps=40 --config.mode=sdpo.
"""

from pmd_jax.config import base_config


def get_config():
    c = base_config()
    c.name = "smollm2_sciq"
    c.mode = "pmd"
    c.run_dir = "runs/smollm2_sciq"
    c.model.source = "smollm2"
    c.task.name = "sciq"
    c.task.max_train_problems = 0
    c.task.max_eval_problems = 64
    c.rollout.problems_per_step = 8
    c.rollout.n = 4
    c.rollout.temperature = 1.0
    c.rollout.max_prompt_tokens = 384
    c.rollout.max_tokens = 96
    c.rollout.max_batch = 32
    c.teacher_prompt.max_tokens = 1024
    c.train.steps = 24
    c.train.eval_every = 12
    c.train.checkpoint_every = 4
    c.eval.n = 2
    c.eval.max_tokens = 96
    # Small model, short runs: SciKnowEval-style settings scaled down (METHOD.md Table 12).
    c.distill.optim.lr = 1e-5
    c.distill.optim.warmup_steps = 2
    c.memory.behavior.every_n_steps = 4
    c.memory.behavior.min_problems = 8
    c.memory.insight.sampling.max_tokens = 160
    c.memory.behavior.sampling.max_tokens = 256
    c.memory.context.max_tokens = 640
    return c
