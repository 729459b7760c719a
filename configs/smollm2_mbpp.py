"""SmolLM2-135M-Instruct on MBPP (sandboxed code execution) on CPU, rich feedback on.

Trains on MBPP's seeded train split (400 of the 500 shipped problems) and evaluates on its
disjoint validation split (the other 100; task.mbpp_train_size / task.mbpp_eval_size,
task.split_seed). HumanEval as a held-out transfer set instead (all 164 problems):
``--config.task.eval_task=humaneval --config.task.max_eval_problems=164``.
"""

from pmd_jax.config import base_config
from pmd_jax.memory.config import small_model_memory_calls


def get_config():
    c = base_config()
    c.name = "smollm2_mbpp"
    c.mode = "pmd"
    c.run_dir = "runs/smollm2_mbpp"
    c.model.source = "smollm2"
    c.task.name = "mbpp"
    c.task.mbpp_train_size = 400
    c.task.mbpp_eval_size = 100
    c.task.eval_split = "validation"  # MBPP's held-out 100 (task.eval_task: see above)
    c.task.max_eval_problems = 64
    c.rollout.problems_per_step = 4
    c.rollout.n = 4
    c.rollout.max_prompt_tokens = 512
    c.rollout.max_tokens = 192
    c.rollout.max_cache_gib = 1.0  # one batch's KV cache (a 16 GB laptop runs this)
    # One prefill call of several prompts holds at most 2,048 padded positions (ours): on the
    # 2-core CPU a (64, 512) group held 1.5 GiB of temporaries beside its 1.4 GiB cache,
    # and smaller groups ran faster per token (3.1 ms at 4 x 512, 3.6 at 16 x 512).
    c.rollout.max_prefill_tokens = 2048
    # Host memory (ours): the initial policy, read only by the KL to it, waits in a file
    # (0.50 GiB less resident), and the compiled programs of past batch shapes are dropped
    # after every step (the RSS between steps rose ~0.2 GiB a step without it).
    c.train.offload_initial_policy = True
    c.train.clear_compiled_every = 1
    c.teacher_prompt.include_feedback = True
    c.teacher_prompt.max_tokens = 1536
    c.train.steps = 20
    c.train.eval_every = 10
    c.train.checkpoint_every = 5
    c.eval.n = 2
    c.eval.max_tokens = 192
    c.distill.loss.alpha = 1.0
    c.distill.loss.topk = 20
    c.distill.teacher.rate = 0.01
    c.distill.optim.warmup_steps = 2
    c.memory.behavior.every_n_steps = 5
    c.memory.context.max_tokens = 900
    # Memory call bounds and budgets for a 135M model, as in smollm2_sciq.py (worst-case
    # schema-bounded replies, memory/schemas.py reply_token_bound: reflection 377 tokens,
    # extraction 767, evolution 697, summary 115; budgets above them plus the stop token).
    small_model_memory_calls(c.memory)
    return c
