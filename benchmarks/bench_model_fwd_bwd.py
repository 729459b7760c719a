"""Forward + backward tokens/s: pmd_jax decoder (jit) vs HF transformers + torch, SmolLM2-135M.

Same weights (random, HF init; the real GGUF weights make no difference to speed), same batch,
same loss (mean next-token cross-entropy), same process. torch gets 2 threads, XLA:CPU uses its
default thread pool (the machine's cores). Prints tokens/s for each and the ratio.

    python benchmarks/bench_model_fwd_bwd.py --batch=8 --seq=256 --steps=5
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from pmd_jax.models import decoder
from pmd_jax.models.config import from_hf_config, smollm2_135m


def hf_model(attn: str):
    c = smollm2_135m()
    hf_cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
        rope_theta=c.rope_for("full_attention").theta,
    )
    hf_cfg._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(hf_cfg).train(), hf_cfg


def to_params(model, cfg) -> dict:
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    L, D, H, KV, hd = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = lambda i, n: sd[f"model.layers.{i}.{n}.weight"]  # noqa: E731
    stack = lambda f: np.stack([f(i) for i in range(L)])  # noqa: E731
    return {
        "embed": sd["model.embed_tokens.weight"],
        "final_norm": sd["model.norm.weight"],
        "layers": {
            "q": stack(lambda i: g(i, "self_attn.q_proj").T.reshape(D, H, hd)),
            "k": stack(lambda i: g(i, "self_attn.k_proj").T.reshape(D, KV, hd)),
            "v": stack(lambda i: g(i, "self_attn.v_proj").T.reshape(D, KV, hd)),
            "o": stack(lambda i: g(i, "self_attn.o_proj").T.reshape(H, hd, D)),
            "gate": stack(lambda i: g(i, "mlp.gate_proj").T),
            "up": stack(lambda i: g(i, "mlp.up_proj").T),
            "down": stack(lambda i: g(i, "mlp.down_proj").T),
            "attn_norm": stack(lambda i: g(i, "input_layernorm")),
            "mlp_norm": stack(lambda i: g(i, "post_attention_layernorm")),
        },
    }


def time_it(fn, steps: int) -> float:
    fn()  # warm-up / compile
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--torch_threads", type=int, default=2)
    ap.add_argument("--attn", default="sdpa", help="HF attention: sdpa (fastest on CPU) | eager")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    B, T = args.batch, args.seq
    ntok = B * T

    model, hf_cfg = hf_model(args.attn)
    cfg = from_hf_config(hf_cfg.to_dict())
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T))
    tt = torch.tensor(tokens)

    def torch_step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=tt, labels=tt, use_cache=False)
        out.loss.backward()
        return out.loss

    t_torch = time_it(torch_step, args.steps)
    params32 = jax.tree.map(jnp.asarray, to_params(model, cfg))
    tok = jnp.asarray(tokens, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    def make_step(c):
        def loss(p):
            logits, _ = decoder.forward(p, tok, pos, c, remat="none")
            logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, tok[:, 1:, None], -1))

        f = jax.jit(jax.value_and_grad(loss))
        return lambda: jax.block_until_ready(f(params32))

    results = {"torch fp32 (" + args.attn + ")": t_torch}
    results["jax fp32"] = time_it(make_step(cfg), args.steps)
    bf16 = make_step(cfg.replace(dtype="bfloat16"))
    results["jax bf16 compute, fp32 params"] = time_it(bf16, args.steps)
    print(f"SmolLM2-135M forward+backward, batch {B} x seq {T}, {args.steps} timed steps, "
          f"torch threads {torch.get_num_threads()}, jax {jax.__version__} on "
          f"{jax.devices()[0].platform} ({jax.device_count()} device(s)), "
          f"torch {torch.__version__}")
    for name, s in results.items():
        print(f"  {name:34s} {s * 1e3:9.1f} ms/step  {ntok / s:9.1f} tokens/s")
    for name in ("jax fp32", "jax bf16 compute, fp32 params"):
        print(f"ratio {name} / torch fp32: {t_torch / results[name]:.2f}x tokens/s")


if __name__ == "__main__":
    main()
