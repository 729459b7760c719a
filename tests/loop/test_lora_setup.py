"""LoRA with a cast base (``lora.base_dtype``): what the trainer's set-up holds when it hands
the sampler its first weights (the merged policy the step trains, issue 51).

The 1.5B config (``configs/qwen25coder15b_mbpp_lora.py``) was killed by the kernel at 24 GB
in this publish: it still held the float32 weights as loaded (6.2 GB), the sampler's
per-layer copy of them, the bf16 base and the merged weights at once. Here, on the tiny
random Llama in this process: when the sampler receives the merged weights, neither the
loaded weights nor the sampler's old copy is held any more, and what it samples with is the
base as the step holds it (bf16, merged with zero adapters) in float32."""

from __future__ import annotations

import jax
import numpy as np

from pmd_jax.config import apply_mode, config_errors, freeze
from pmd_jax.config.modes import set_dotted
from pmd_jax.distill import train
from pmd_jax.loop import build
from pmd_jax.loop import trainer as trainer_module
from pmd_jax.models import decoder
from pmd_jax.sampling.jax_sampler import JaxSampler
from tests.host import smollm2_gguf
from tests.tiny_runs import embedded_default


def _cfg(run_dir):
    cfg = embedded_default()
    over = {"mode": "sdpo", "run_dir": str(run_dir), "resume": False,
            "model.random_init": "tiny-llama", "train.steps": 0, "train.eval_every": -1,
            "train.eval_at_start": False, "train.export_hf": False,
            "train.compilation_cache_dir": "none", "eval.retention": False,
            "lora.enabled": True, "lora.r": 4, "lora.alpha": 8.0,
            "lora.base_dtype": "bfloat16"}
    with cfg.unlocked():
        for k, v in over.items():
            set_dotted(cfg, k, v)
    cfg = apply_mode(cfg)
    assert not config_errors(cfg), config_errors(cfg)
    return freeze(cfg)


def test_the_first_publish_holds_neither_the_loaded_weights_nor_the_old_copy(tmp_path,
                                                                            monkeypatch):
    smollm2_gguf()  # SmolLM2's tokenizer (skips with the install command when absent)
    bundles, seen = [], []
    load = build.load_model
    monkeypatch.setattr(build, "load_model", lambda cfg: bundles.append(load(cfg)) or bundles[-1])
    set_params = JaxSampler.set_params

    def watched(self, params, *args, **kw):
        seen.append({"sampler_held": self.params is not None,
                     "loaded_held": bundles[-1].params is not None,
                     "dtypes": {str(x.dtype) for x in jax.tree.leaves(params)}})
        return set_params(self, params, *args, **kw)

    monkeypatch.setattr(JaxSampler, "set_params", watched)
    tr = trainer_module.Trainer(_cfg(tmp_path / "run"))
    # the samplers' construction (the loaded weights), then the publish of the merged ones
    assert len(seen) >= 2 and seen[0]["loaded_held"], seen
    assert seen[-1] == {"sampler_held": False, "loaded_held": False, "dtypes": {"float32"}}, seen
    assert tr.model.params is None and tr.state.base is not None
    assert {str(x.dtype) for x in jax.tree.leaves(tr.state.base)} == {"bfloat16"}
    # what it samples with: the base as the step holds it (zero adapters) in float32
    want = jax.tree.map(lambda x: np.asarray(x, np.float32), tr.state.base)
    held = tr.sampler.params
    got = decoder.stack_layers(held) if tr.sampler.unstack_layers else held
    np.testing.assert_equal(jax.tree.map(np.asarray, got), want)
    np.testing.assert_equal(jax.tree.map(np.asarray, train.current_params(tr.cfg, tr.state)),
                            want)
