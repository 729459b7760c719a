"""Qwen3-8B (thinking off) on LiveCodeBench v6 with rich feedback, vLLM rollouts.

METHOD.md Table 12 (LCBv6 column): reverse KL top-20, EMA 0.01, lr 1e-6, no warmup, feedback
on. For SciKnowEval instead: --config.task.name=sciknoweval --config.task.path=... and the
SciKnowEval distill settings (alpha 0.5, top-100, EMA 0.05, lr 1e-5, warmup 10).
"""

from pmd_jax.config import base_config
from pmd_jax.distill.config import lcb_distill_config


def get_config():
    c = base_config()
    c.name = "qwen3_lcb"
    c.mode = "pmd"
    c.run_dir = "runs/qwen3_lcb"
    c.model.source = "checkpoints/Qwen3-8B"
    c.model.preset = "qwen3-8b"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.attention_impl = "chunked"  # 8k responses: never build [T, S] scores or masks
    c.model.attention_chunk = 512
    c.task.name = "livecodebench"
    c.task.path = "data/lcb_v6.jsonl"
    # SDPO's LiveCodeBench setting trains and evaluates on the same problems (train rewards
    # use half of each problem's tests, evaluation all of them): allowed explicitly, and every
    # evaluation number of the run is labelled "in-sample".
    c.eval.allow_in_sample = True
    c.rollout.sampler = "vllm"
    c.rollout.vllm_url = "http://127.0.0.1:8000"
    c.rollout.weight_store = "file:///tmp/pmd_weights"
    c.rollout.problems_per_step = 32
    c.rollout.n = 8
    c.rollout.max_prompt_tokens = 2048
    c.rollout.max_tokens = 8192
    c.teacher_prompt.include_feedback = True
    c.train.steps = 100
    c.train.eval_every = 10
    c.eval.n = 4
    c.eval.temperature = 0.6
    c.eval.top_p = 0.95
    c.eval.max_tokens = 8192
    lcb_distill_config(c.distill)  # (its knobs set on the run's distill section)
    c.distill.precision.param_dtype = "bfloat16"
    c.distill.loss.chunk_size = 1024
    return c
