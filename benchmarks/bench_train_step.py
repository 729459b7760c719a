"""Our jitted distillation step vs the same step in torch + HF transformers, on CPU.

Both sides do, on SmolLM2-135M (preset ``smollm2-135m``, random init, fp32):
student forward + backward on student prompt + response (length ``--student-len``), teacher
(EMA copy) forward without gradient on teacher prompt + the same response
(``--teacher-len``), the same loss on the response tokens (generalized JSD alpha=0.5 over
the student's top-100 + tail bucket, or full-vocabulary reverse KL: ``--loss``), token-mean,
global-norm clip 1.0, AdamW (lr 1e-5, wd 0.01), and the EMA teacher update. The torch side
computes logits only on the response positions too (hidden states of the base model gathered,
then ``lm_head``), so neither side pays for prompt logits.

The same run measures this CPU's fp32 GEMM peak (numpy and XLA matmul of large square
matrices, best of both) and prints our achieved model GFLOP/s (6 N per trained token + 2 N
per teacher token + attention, without counting remat recompute) as a fraction of it.

    python benchmarks/bench_train_step.py                       # B=16, Ts=256, Tt=384
    python benchmarks/bench_train_step.py --batch 4 --steps 2   # a quick figure

Threads: torch uses ``--threads`` (default 2) intra-op threads; XLA's CPU backend uses all
cores of the machine.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--student-len", type=int, default=256)
    p.add_argument("--teacher-len", type=int, default=384)
    p.add_argument("--response-len", type=int, default=192)
    p.add_argument("--steps", type=int, default=3, help="timed steps per side (after warm-up)")
    p.add_argument("--loss", choices=("jsd_top100", "rkl_full"), default="jsd_top100")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--remat", choices=("none", "full", "dots", "dots_no_batch"),
                   default="dots_no_batch", help="decoder remat (none: B=16 needs >9 GB)")
    p.add_argument("--chunk", type=int, default=64, help="response tokens per loss chunk")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--skip-jax", action="store_true")
    p.add_argument("--gemm-n", type=int, default=2048)
    return p.parse_args()


# ------------------------------------------------------------------------------ data
def make_data(args, vocab: int) -> dict[str, np.ndarray]:
    b, ts, tt, r = args.batch, args.student_len, args.teacher_len, args.response_len
    if not (0 < r < ts and r < tt):
        raise SystemExit(f"--response-len {r} must be < student {ts} and teacher {tt} lengths")
    rng = np.random.default_rng(0)
    resp = rng.integers(0, vocab, (b, r), dtype=np.int64)
    s_tok = np.concatenate([rng.integers(0, vocab, (b, ts - r)), resp], axis=1)
    t_tok = np.concatenate([rng.integers(0, vocab, (b, tt - r)), resp], axis=1)
    return {
        "student_tokens": s_tok.astype(np.int32),
        "teacher_tokens": t_tok.astype(np.int32),
        "responses": resp.astype(np.int32),
        "student_index": np.broadcast_to(np.arange(ts - r - 1, ts - 1), (b, r)).astype(np.int32),
        "teacher_index": np.broadcast_to(np.arange(tt - r - 1, tt - 1), (b, r)).astype(np.int32),
    }


def model_flops(cfg, args) -> float:
    b, ts, tt = args.batch, args.student_len, args.teacher_len
    return 3.0 * b * ts * cfg.flops_per_token(ts) + b * tt * cfg.flops_per_token(tt)


# ------------------------------------------------------------------------------ peak
def gemm_peak(n: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    out = {}
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    bm = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    a @ bm
    best = min(_timeit(lambda: a @ bm) for _ in range(3))
    out["numpy"] = 2 * n**3 / best / 1e9
    ja, jb = jnp.asarray(a), jnp.asarray(bm)
    mm = jax.jit(lambda x, y: x @ y)
    mm(ja, jb).block_until_ready()
    best = min(_timeit(lambda: mm(ja, jb).block_until_ready()) for _ in range(3))
    out["xla"] = 2 * n**3 / best / 1e9
    return out


def _timeit(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ------------------------------------------------------------------------------ jax
def init_params():
    import jax

    from pmd_jax.models import decoder
    from pmd_jax.models.config import preset

    return decoder.init_params(preset("smollm2-135m"), jax.random.PRNGKey(0))


def bench_jax(args, data, params) -> tuple[float, float]:
    import jax

    from pmd_jax.distill import step as st
    from pmd_jax.distill.config import default_distill_config
    from pmd_jax.models.config import preset

    cfg = preset("smollm2-135m")
    c = default_distill_config()
    c.teacher.rule = "ema"
    c.optim.warmup_steps = 0
    c.loss.chunk_size = args.chunk
    c.loss.rollout_is_threshold = None
    c.precision.remat = args.remat != "none"
    if args.remat != "none":
        c.precision.remat_policy = args.remat
    if args.loss == "jsd_top100":
        c.loss.alpha, c.loss.topk, c.loss.add_tail = 0.5, 100, True
    else:
        c.loss.alpha, c.loss.topk = 1.0, None
    ts = st.TrainStep(cfg, c)
    b = args.batch
    batch = dict(data)
    for side in ("student", "teacher"):
        t = data[f"{side}_tokens"].shape[1]
        batch[f"{side}_positions"] = np.broadcast_to(np.arange(t), (b, t)).astype(np.int32)
        batch[f"{side}_attn_mask"] = np.ones((b, t), np.int32)
    batch["response_mask"] = np.ones(data["responses"].shape, np.int32)
    batch["sd_mask"] = np.ones((b,), np.float32)
    state = ts.init(params, 0)
    t0 = time.perf_counter()
    state, m = ts.step(state, batch)
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    first_loss = float(m["loss"])
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = ts.step(state, batch)
        jax.block_until_ready((state.params, m))
        times.append(time.perf_counter() - t0)
    print(f"  jax: compile+first step {first:.1f}s, first-step loss {first_loss:.6f}, "
          f"steps {[round(x, 2) for x in times]}")
    return float(np.median(times)), first_loss


# ------------------------------------------------------------------------------ torch
def load_into_torch(model, params, mc) -> None:
    """Copy our param pytree (``decoder`` layout) into a HF LlamaForCausalLM."""
    import torch

    d, h, kv, hd = mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim

    def t(x):
        return torch.from_numpy(np.array(x, dtype=np.float32, copy=True))

    lp = params["layers"]
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(t(params["embed"]))
        model.model.norm.weight.copy_(t(params["final_norm"]))
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            a.q_proj.weight.copy_(t(np.asarray(lp["q"][i]).reshape(d, h * hd).T))
            a.k_proj.weight.copy_(t(np.asarray(lp["k"][i]).reshape(d, kv * hd).T))
            a.v_proj.weight.copy_(t(np.asarray(lp["v"][i]).reshape(d, kv * hd).T))
            a.o_proj.weight.copy_(t(np.asarray(lp["o"][i]).reshape(h * hd, d).T))
            layer.mlp.gate_proj.weight.copy_(t(np.asarray(lp["gate"][i]).T))
            layer.mlp.up_proj.weight.copy_(t(np.asarray(lp["up"][i]).T))
            layer.mlp.down_proj.weight.copy_(t(np.asarray(lp["down"][i]).T))
            layer.input_layernorm.weight.copy_(t(lp["attn_norm"][i]))
            layer.post_attention_layernorm.weight.copy_(t(lp["mlp_norm"][i]))


def bench_torch(args, data, params) -> tuple[float, float]:
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pmd_jax.models.config import preset

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mc = preset("smollm2-135m")
    hf = LlamaConfig(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps, tie_word_embeddings=True,
        rope_theta=mc.rope_for("full_attention").theta, max_position_embeddings=8192,
        attn_implementation="sdpa",
    )
    student = LlamaForCausalLM(hf).float()
    load_into_torch(student, params, mc)
    student.train()
    teacher = copy.deepcopy(student).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    s_tok = torch.from_numpy(data["student_tokens"].astype(np.int64))
    t_tok = torch.from_numpy(data["teacher_tokens"].astype(np.int64))
    resp = torch.from_numpy(data["responses"].astype(np.int64))
    s_idx = torch.from_numpy(data["student_index"].astype(np.int64))
    t_idx = torch.from_numpy(data["teacher_index"].astype(np.int64))
    mask = torch.ones(resp.shape, dtype=torch.float32)
    alpha = 0.5 if args.loss == "jsd_top100" else 1.0

    def resp_logits(model, tok, idx):
        h = model.model(input_ids=tok).last_hidden_state
        h = torch.gather(h, 1, idx[..., None].expand(-1, -1, h.shape[-1]))
        return model.lm_head(h).float()

    def add_tail(lp):
        lse = torch.logsumexp(lp, dim=-1, keepdim=True).clamp(max=-1e-7)
        return torch.cat([lp, torch.log(-torch.expm1(lse))], dim=-1)

    def loss_fn(s_logits, t_logits):
        s = torch.log_softmax(s_logits, -1)
        t = torch.log_softmax(t_logits, -1)
        if args.loss == "jsd_top100":
            idx = s.detach().topk(100, dim=-1).indices
            s, t = add_tail(s.gather(-1, idx)), add_tail(t.gather(-1, idx))
            log_m = torch.logsumexp(
                torch.stack([s + np.log(1 - alpha), t + np.log(alpha)]), dim=0)
            per = (1 - alpha) * (s.exp() * (s - log_m)).sum(-1) + alpha * (
                t.exp() * (t - log_m)).sum(-1)
        else:
            per = (s.exp() * (s - t)).sum(-1)
        return (per * mask).sum() / mask.sum().clamp(min=1)

    def step():
        with torch.no_grad():
            t_logits = resp_logits(teacher, t_tok, t_idx)
        s_logits = resp_logits(student, s_tok, s_idx)
        loss = loss_fn(s_logits, t_logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for pt, ps in zip(teacher.parameters(), student.parameters()):
                pt.lerp_(ps, 0.05)
        return float(loss.detach())

    t0 = time.perf_counter()
    first_loss = step()
    first = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(f"  torch: first step {first:.1f}s, first-step loss {first_loss:.6f}, "
          f"steps {[round(x, 2) for x in times]}")
    return float(np.median(times)), first_loss


def main() -> None:
    args = parse()
    from pmd_jax.models.config import preset

    cfg = preset("smollm2-135m")
    data = make_data(args, cfg.vocab_size)
    flops = model_flops(cfg, args)
    print(f"SmolLM2-135M train step: B={args.batch} student T={args.student_len} teacher "
          f"T={args.teacher_len} response R={args.response_len} loss={args.loss} "
          f"remat={args.remat}; {flops / 1e12:.2f} model TFLOP/step")
    peak = gemm_peak(args.gemm_n)
    best_peak = max(peak.values())
    print(f"fp32 GEMM peak ({args.gemm_n}^3): numpy {peak['numpy']:.1f} GFLOP/s, "
          f"XLA {peak['xla']:.1f} GFLOP/s")
    t_jax = t_torch = l_jax = l_torch = None
    params = init_params()
    if not args.skip_jax:
        t_jax, l_jax = bench_jax(args, data, params)
        gf = flops / t_jax / 1e9
        print(f"pmd_jax: {t_jax:.2f} s/step, {gf:.1f} GFLOP/s = {gf / best_peak:.0%} of peak")
    if not args.skip_torch:
        t_torch, l_torch = bench_torch(args, data, params)
        gf = flops / t_torch / 1e9
        print(f"torch+HF: {t_torch:.2f} s/step, {gf:.1f} GFLOP/s = {gf / best_peak:.0%} of peak")
    if t_jax and t_torch:
        print(f"same weights, same batch: first-step loss pmd_jax {l_jax:.6f} vs torch "
              f"{l_torch:.6f} (rel. diff {abs(l_jax - l_torch) / max(abs(l_torch), 1e-12):.1e})")
        print(f"speed-up pmd_jax vs torch: {t_torch / t_jax:.2f}x")


if __name__ == "__main__":
    main()
