"""OLMo-3-7B-Instruct on SciKnowEval L3 MCQ with vLLM rollouts on a TPU/GPU mesh.

METHOD.md Table 12 (SciKnowEval column): 32 questions x 8 rollouts, T=1.0, 2048/8192 tokens,
JSD(0.5) top-100 + tail, EMA 0.05, AdamW lr 1e-5 warmup 10, wd 0.01, clip 1.0.
Set model.source to the HF checkpoint folder and task.path to the SciKnowEval JSONL.
"""

from pmd_jax.config import base_config


def get_config():
    c = base_config()
    c.name = "olmo3_sciknoweval"
    c.mode = "pmd"
    c.run_dir = "runs/olmo3_sciknoweval"
    c.model.source = "checkpoints/Olmo-3-7B-Instruct"
    c.model.preset = "olmo3-7b"  # used by --dry_run (no weights needed)
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.attention_impl = "chunked"  # 8k responses: never build [T, S] scores or masks
    c.model.attention_chunk = 512
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    c.task.name = "sciknoweval"
    c.task.path = "data/sciknoweval_l3_train.jsonl"
    c.rollout.sampler = "vllm"
    c.rollout.vllm_url = "http://127.0.0.1:8000"
    c.rollout.weight_store = "file:///tmp/pmd_weights"
    c.rollout.problems_per_step = 32
    c.rollout.n = 8
    c.rollout.max_prompt_tokens = 2048
    c.rollout.max_tokens = 8192
    c.train.steps = 300
    c.train.eval_every = 10
    c.train.checkpoint_every = 10
    c.eval.n = 16
    c.eval.temperature = 0.6
    c.eval.top_p = 0.95
    c.eval.max_tokens = 8192
    c.distill.precision.param_dtype = "bfloat16"
    c.distill.precision.master_weights = True
    c.distill.loss.chunk_size = 1024
    return c
