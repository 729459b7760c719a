"""Our jitted distillation step vs the same step in torch + HF transformers, on one CPU or GPU.

Both sides do, on a Llama-shaped model with random weights (``--model``: SmolLM2-135M,
Llama-3-8B, tiny-llama; ``--layers N`` cuts it to N layers), fp32 master weights and AdamW
state, compute in ``--dtype`` (bfloat16: our activations and weight matmuls in bf16, i.e.
ModelConfig.dtype and distill precision.param_dtype; torch under ``torch.autocast`` bf16):
student forward + backward on student prompt + response (length ``--student-len``), teacher
(EMA copy) forward without gradient on teacher prompt + the same response
(``--teacher-len``), the same loss on the response tokens (generalized JSD alpha=0.5 over
the student's top-100 + tail bucket, or full-vocabulary reverse KL: ``--loss``), token-mean,
global-norm clip 1.0, AdamW (lr 1e-5, wd 0.01), and the EMA teacher update. The torch side
computes logits only on the response positions too (hidden states of the base model gathered,
then ``lm_head``), so neither side pays for prompt logits. Both get an all-ones attention mask,
as a trainer would pass (HF drops an all-ones mask; ours runs the mask it is given).

Each side runs in its own process (``python bench_train_step.py --child jax|torch ...``,
one after the other; see ``benchmarks/bench_common.py``): JAX keeps the GPU memory it took
until its process ends. Each child also measures its framework's GEMM peak on the device in
the compute dtype (a large square ``jnp.dot`` / ``torch.matmul``; ``--gemm-n``); the parent
takes the larger as the peak and prints, per side: s/step (median of ``--steps`` after a
warm-up step), model TFLOP/s and its fraction of that peak, peak memory (GPU: the device
allocator's peak; CPU: peak RSS), and the ratio.

Model FLOPs per step (:func:`model_flops`; remat recompute not counted): per token of each
sequence ``2 * N_body`` (the decoder's matmul weights without the LM head) plus causal
attention ``2 * q_size * T`` per layer (QK^T and PV over the causal half of the T x T
scores), plus ``2 * V * D`` for the LM head on the R response positions only; the student
(forward + backward) counts 3x, the teacher (forward only) 1x.

    python benchmarks/bench_train_step.py                       # CPU, SmolLM2-135M, B=16
    python benchmarks/bench_train_step.py --batch 4 --steps 2   # a quick CPU figure
    python benchmarks/bench_train_step.py --device gpu --model llama3-8b --layers 8 \\
        --batch 16 --student-len 1024 --teacher-len 1536 --response-len 512 \\
        --dtype bfloat16 --steps 5                               # the GPU figure (README)

``--gemm-shapes`` also times ``jnp.dot`` against ``torch.matmul`` on the step's matmul
shapes. Threads (CPU): torch uses ``--threads`` intra-op threads; XLA's CPU backend uses all
cores. The 1-minute load average is printed with each figure (shared hosts).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_common as bc  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--model", choices=bc.MODELS, default="smollm2-135m")
    p.add_argument("--layers", type=int, default=0, help="cut the model to N layers (0: all)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--student-len", type=int, default=256)
    p.add_argument("--teacher-len", type=int, default=384)
    p.add_argument("--response-len", type=int, default=192)
    p.add_argument("--steps", type=int, default=3, help="timed steps per side (after warm-up)")
    p.add_argument("--loss", choices=("jsd_top100", "rkl_full"), default="jsd_top100")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (CPU)")
    p.add_argument("--remat", choices=("none", "full", "dots", "dots_no_batch"),
                   default="dots_no_batch", help="our decoder's remat policy")
    p.add_argument("--layer-loop", choices=("scan", "unrolled"), default="scan",
                   help="distill.precision.layer_loop")
    p.add_argument("--attention", default="auto",
                   help="model.attention_impl[:chunk], e.g. chunked:64, cudnn (auto: by "
                        "backend, see pmd_jax/models/attention_select.py)")
    p.add_argument("--chunk", type=int, default=96, help="response tokens per loss chunk")
    p.add_argument("--chunk-remat", action="store_true",
                   help="recompute each loss chunk's logits in the backward pass")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype of both sides (fp32 master weights and AdamW state)")
    p.add_argument("--matmul-dtype", choices=("", "bfloat16"), default="",
                   help="our distill.precision.matmul_dtype (bf16 operands, fp32 results) ")
    p.add_argument("--torch-autocast", action="store_true",
                   help="torch under autocast bf16 even with --dtype float32")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--skip-jax", action="store_true")
    p.add_argument("--gemm-n", type=int, default=0,
                   help="square GEMM size of the peak (0: 2048 on CPU, 8192 on GPU)")
    p.add_argument("--gemm-shapes", action="store_true",
                   help="also time jnp.dot vs torch.matmul on the step's matmul shapes")
    p.add_argument("--attention-probe", action="store_true",
                   help="also time one layer's attention forward+backward at the student's "
                        "shape in each implementation (cuDNN with and without the padding "
                        "mask on GPU, its xla twin on CPU, dense, chunked)")
    p.add_argument("--xla-flags", default="", help="extra XLA_FLAGS for our child")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per side")
    p.add_argument("--child", choices=("jax", "torch"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.gemm_n:
        args.gemm_n = 8192 if args.device == "gpu" else 2048
    return args


def peak_dtype(args) -> str:
    """bf16 matmuls on either side: the bf16 GEMM peak is the ceiling."""
    return ("bfloat16" if args.dtype == "bfloat16" or args.matmul_dtype
            or args.torch_autocast else "float32")


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
    """Model FLOPs of one step (see the module docstring); no remat recompute counted."""
    b, ts, tt, r = args.batch, args.student_len, args.teacher_len, args.response_len
    head = 2.0 * cfg.vocab_size * cfg.hidden_size  # LM head, per projected position

    def fwd(t: int) -> float:  # forward FLOPs of one sequence of length t
        return t * (cfg.flops_per_token(t) - head) + r * head

    return b * (3.0 * fwd(ts) + fwd(tt))


def step_gemm_shapes(cfg, args) -> list[tuple[str, tuple[int, int, int]]]:
    """The step's matmuls (forward orientation) at the student's token count."""
    m = args.batch * args.student_len
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [
        ("q/o proj", (m, d, q)), ("k/v proj", (m, d, kv)), ("gate/up", (m, d, f)),
        ("down", (m, f, d)), ("dW gate/up (bwd)", (d, m, f)),
        ("LM head chunk", (args.batch * min(args.chunk, args.response_len), d,
                           cfg.vocab_size)),
    ]


def _gemms(args, cfg, rate) -> dict:
    out = {"gemm_peak_tflops": rate(args.gemm_n, args.gemm_n, args.gemm_n)}
    if args.gemm_shapes:
        out["gemm_shapes"] = {name: rate(*mkn) for name, mkn in step_gemm_shapes(cfg, args)}
    return out


# ------------------------------------------------------------------------------ jax
def attention_probe(cfg, args) -> dict[str, float | str]:
    """ms per forward+backward of one layer's attention (B, student T, the model's heads) in
    each implementation; a variant that fails gives its error instead."""
    import functools

    import jax
    import jax.numpy as jnp

    from pmd_jax.models import attention as attn
    from pmd_jax.models import attention_fused as fused

    B, T, hd = args.batch, args.student_len, cfg.head_dim
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    dt = jnp.dtype(cfg.dtype)
    q = jax.random.normal(ks[0], (B, T, cfg.num_heads, hd), jnp.float32).astype(dt)
    k, v = (jax.random.normal(kk, (B, cfg.num_kv_heads, T, hd), jnp.float32).astype(dt)
            for kk in ks[1:])
    km = jnp.ones((B, T), jnp.bool_)
    i = jnp.arange(T)
    lib = "cudnn" if args.device == "gpu" else "xla"
    variants = {
        f"{lib} + padding mask (as the step)": functools.partial(
            fused.dpa_attention, key_mask=km, implementation=lib),
        f"{lib} causal only": functools.partial(fused.dpa_attention, implementation=lib),
        "dense": functools.partial(attn.dense_attention,
                                   mask=jnp.broadcast_to(i[None, :] <= i[:, None], (B, T, T))),
        "chunked": functools.partial(attn.chunked_attention, key_mask=km,
                                     q_chunk=cfg.attention_chunk, k_chunk=cfg.attention_chunk),
    }
    out: dict[str, float | str] = {}
    for name, fn in variants.items():
        g = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                             argnums=(0, 1, 2)))
        try:
            out[name] = 1e3 * bc.best_time(lambda g=g: jax.block_until_ready(g(q, k, v)), 5)
        except Exception as e:  # noqa: BLE001  (reported, the benchmark goes on)
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return out


def child_jax(args) -> dict:
    import jax

    from pmd_jax.distill import step as st
    from pmd_jax.distill.config import default_distill_config, freeze_distill_config
    from pmd_jax.models import attend

    cfg = bc.model_config(args.model, args.layers, args.dtype)
    impl, _, blk = args.attention.partition(":")
    cfg = cfg.replace(attention_impl=impl, **({"attention_chunk": int(blk)} if blk else {}))
    res = _gemms(args, cfg, lambda m, k, n: bc.jax_matmul_tflops(m, k, n, peak_dtype(args)))
    bc.log(f"jax: {bc.device_name('jax', args.device)}; GEMM peak "
           f"{res['gemm_peak_tflops']:.3g} TFLOP/s ({peak_dtype(args)})")
    res["attention"] = {
        side: attend.choose(cfg, impl, T=t, S=t, has_cache=False, key_padding=True,
                            segments=False, shared_prefix=False).__dict__
        for side, t in (("student", args.student_len), ("teacher", args.teacher_len))}
    if args.attention_probe:
        res["attention_probe_ms"] = attention_probe(cfg, args)
    params = bc.init_params(cfg)
    data = make_data(args, cfg.vocab_size)
    c = default_distill_config()
    c.teacher.rule = "ema"
    c.optim.warmup_steps = 0
    c.loss.chunk_size = args.chunk
    c.loss.rollout_is_threshold = None
    c.precision.remat = args.remat != "none"
    c.precision.layer_loop = args.layer_loop
    c.precision.param_dtype = args.dtype
    c.precision.matmul_dtype = args.matmul_dtype
    if args.remat != "none":
        c.precision.remat_policy = args.remat
    if args.loss == "jsd_top100":
        c.loss.alpha, c.loss.topk, c.loss.add_tail = 0.5, 100, True
    else:
        c.loss.alpha, c.loss.topk = 1.0, None
    ts = st.TrainStep(cfg, freeze_distill_config(c), loss_chunk_remat=args.chunk_remat)
    b = args.batch
    batch = dict(data)
    for side in ("student", "teacher"):
        t = data[f"{side}_tokens"].shape[1]
        batch[f"{side}_positions"] = np.broadcast_to(np.arange(t), (b, t)).astype(np.int32)
        batch[f"{side}_attn_mask"] = np.ones((b, t), np.int32)
    batch["response_mask"] = np.ones(data["responses"].shape, np.int32)
    batch["sd_mask"] = np.ones((b,), np.float32)
    batch = {k: jax.device_put(v) for k, v in batch.items()}
    state = ts.init(params, 0)
    del params
    t0 = time.perf_counter()
    state, m = ts.step(state, batch)
    jax.block_until_ready(m)
    res["first_step_s"] = time.perf_counter() - t0
    res["first_loss"] = float(m["loss"])
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = ts.step(state, batch)
        jax.block_until_ready((state.params, m))
        times.append(time.perf_counter() - t0)
    res["steps_s"] = times
    res["peak_mem_gib"], res["mem_what"] = bc.jax_peak_memory()
    res["device"] = bc.device_name("jax", args.device)
    return res


# ------------------------------------------------------------------------------ torch
def child_torch(args) -> dict:
    import jax
    import torch

    dev = bc.torch_device(args.device)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = bc.model_config(args.model, args.layers, args.dtype)
    res = _gemms(args, cfg, lambda m, k, n: bc.torch_matmul_tflops(
        m, k, n, peak_dtype(args), args.device))
    bc.log(f"torch: {bc.device_name('torch', args.device)}; GEMM peak "
           f"{res['gemm_peak_tflops']:.3g} TFLOP/s ({peak_dtype(args)})")
    params = jax.tree.map(np.asarray, bc.init_params(cfg))  # JAX on the CPU (child_env)
    data = make_data(args, cfg.vocab_size)
    student = bc.hf_llama(cfg, args.device)
    bc.load_into_torch(student, params, cfg)
    del params
    student.train()
    teacher = copy.deepcopy(student).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)

    def tens(name):
        return torch.from_numpy(data[name].astype(np.int64)).to(dev)

    s_tok, t_tok, resp = tens("student_tokens"), tens("teacher_tokens"), tens("responses")
    s_idx, t_idx = tens("student_index"), tens("teacher_index")
    mask = torch.ones(resp.shape, dtype=torch.float32, device=dev)
    alpha = 0.5 if args.loss == "jsd_top100" else 1.0

    def resp_logits(model, tok, idx):
        h = model.model(input_ids=tok, attention_mask=torch.ones_like(tok)).last_hidden_state
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

    def autocast():
        on = args.dtype == "bfloat16" or args.torch_autocast
        return torch.autocast("cuda" if dev == "cuda" else "cpu", dtype=torch.bfloat16,
                              enabled=on)

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def step():
        with torch.no_grad(), autocast():
            t_logits = resp_logits(teacher, t_tok, t_idx)
        with autocast():
            s_logits = resp_logits(student, s_tok, s_idx)
        loss = loss_fn(s_logits, t_logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            for pt, ps in zip(teacher.parameters(), student.parameters()):
                pt.lerp_(ps, 0.05)
        return loss.detach()

    t0 = time.perf_counter()
    res["first_loss"] = float(step())
    sync()
    res["first_step_s"] = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    res["steps_s"] = times
    res["peak_mem_gib"], res["mem_what"] = bc.torch_peak_memory(args.device)
    res["device"] = bc.device_name("torch", args.device)
    return res


def child_main(args) -> None:
    bc.child_job(args, {"jax": child_jax, "torch": child_torch})


# ------------------------------------------------------------------------------ parent
def main() -> None:
    args = parse()
    if args.child:
        child_main(args)
        return
    cfg = bc.model_config(args.model, args.layers, args.dtype)
    flops = model_flops(cfg, args)
    print(f"{args.model} ({cfg.num_layers} layers, {cfg.num_params() / 1e9:.2f}B params, "
          f"random weights) train step on {args.device}: B={args.batch} student "
          f"T={args.student_len} teacher T={args.teacher_len} response R={args.response_len} "
          f"loss={args.loss} dtype={args.dtype} matmul_dtype={args.matmul_dtype or 'same'} "
          f"remat={args.remat} layer_loop={args.layer_loop} attention={args.attention} "
          f"chunk={args.chunk} chunk_remat={args.chunk_remat}; {flops / 1e12:.3f} model "
          f"TFLOP/step; {bc.load()}", flush=True)
    res = {}
    for side in ("jax", "torch"):
        if getattr(args, f"skip_{side}"):
            continue
        r = bc.run_child(os.path.abspath(__file__), side, sys.argv[1:],
                         bc.child_env(side, args.device, args.xla_flags), args.timeout)
        if r is not None:
            res[side] = r
            r["s_per_step"] = float(np.median(r["steps_s"]))
            first = "compile+first step" if side == "jax" else "first step"
            print(f"{side}: {r['device']}; {first} {r['first_step_s']:.1f} s, "
                  f"steps {[round(x, 3) for x in r['steps_s']]}, first-step loss "
                  f"{r['first_loss']:.6f} ({r['load']})", flush=True)
            if side == "jax":
                for s, c in r["attention"].items():
                    print(f"  attention ({s}): {c['impl']} ({c['reason']})")
                for name, ms in r.get("attention_probe_ms", {}).items():
                    val = f"{ms:.2f} ms" if isinstance(ms, float) else ms
                    print(f"  attention probe, one layer fwd+bwd at B={args.batch} "
                          f"T={args.student_len}: {name}: {val}")
    if not res:
        return
    peak = max(r["gemm_peak_tflops"] for r in res.values())
    who = " / ".join(f"{s} {r['gemm_peak_tflops']:.3g}" for s, r in res.items())
    print(f"{peak_dtype(args)} GEMM peak ({args.gemm_n}^3, same run, same device): {who} "
          f"TFLOP/s -> peak {peak:.3g} TFLOP/s")
    if args.gemm_shapes and len(res) == 2:
        print("the step's matmul shapes [m, k] x [k, n], TFLOP/s (jnp.dot vs torch.matmul):")
        for name, (m, k, n) in step_gemm_shapes(cfg, args):
            print(f"  {name:18s} {m:6d} x {k:5d} x {n:6d}: "
                  f"xla {res['jax']['gemm_shapes'][name]:8.3g}  "
                  f"torch {res['torch']['gemm_shapes'][name]:8.3g}")
    for side, r in res.items():
        tf = flops / r["s_per_step"] / 1e12
        name = "pmd_jax" if side == "jax" else "torch+HF"
        print(f"{name}: {r['s_per_step']:.3f} s/step, {tf:.3g} model TFLOP/s = "
              f"{tf / peak:.0%} of the {peak:.3g} TFLOP/s GEMM peak; peak memory "
              f"{r['peak_mem_gib']:.1f} GiB ({r['mem_what']})", flush=True)
    if len(res) == 2:
        j, t = res["jax"], res["torch"]
        rel = abs(j["first_loss"] - t["first_loss"]) / max(abs(t["first_loss"]), 1e-12)
        print(f"same weights, same batch: first-step loss pmd_jax {j['first_loss']:.6f} vs "
              f"torch {t['first_loss']:.6f} (rel. diff {rel:.1e})")
        print(f"ratio: pmd_jax is {t['s_per_step'] / j['s_per_step']:.2f}x torch+HF's speed "
              f"(s/step {j['s_per_step']:.3f} vs {t['s_per_step']:.3f}); peak memory "
              f"{j['peak_mem_gib']:.1f} vs {t['peak_mem_gib']:.1f} GiB")


if __name__ == "__main__":
    main()
