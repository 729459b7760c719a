"""Our jitted distillation step vs the same step in torch + HF transformers, on CPU.

Both sides do, on SmolLM2-135M (preset ``smollm2-135m``, random init, fp32 or, with
``--dtype bfloat16``, bf16 compute over fp32 master weights and optimizer state):
student forward + backward on student prompt + response (length ``--student-len``), teacher
(EMA copy) forward without gradient on teacher prompt + the same response
(``--teacher-len``), the same loss on the response tokens (generalized JSD alpha=0.5 over
the student's top-100 + tail bucket, or full-vocabulary reverse KL: ``--loss``), token-mean,
global-norm clip 1.0, AdamW (lr 1e-5, wd 0.01), and the EMA teacher update. The torch side
computes logits only on the response positions too (hidden states of the base model gathered,
then ``lm_head``), so neither side pays for prompt logits.

The same run measures this CPU's GEMM peak in the compute dtype (numpy (fp32 only), torch
and XLA matmul of large square matrices, best of them) and prints each side's achieved model
GFLOP/s as a fraction of it. Model FLOPs per step (:func:`model_flops`; remat recompute not
counted): per token of each sequence ``2 * N_body`` (N_body = the decoder's matmul weights
without the LM head, 106M here) plus causal attention ``2 * q_size * T`` per layer, plus ``2
* V * D`` for the LM head on the R response positions only (neither side projects the prompt
positions); the student (forward + backward) counts 3x, the teacher (forward only) 1x.

It also times ``jnp.dot`` against ``torch.matmul`` on the step's matmul shapes (``--gemm-shapes``),
which bounds what XLA:CPU can reach against MKL/oneDNN on this machine.

Each side runs in its own child process (``spawn``), one after the other, so the first one's
memory is released before the second starts and an out-of-memory kill of either is caught
and reported (with the peak resident memory of each side) instead of ending the script.

    python benchmarks/bench_train_step.py                       # B=16, Ts=256, Tt=384
    python benchmarks/bench_train_step.py --batch 4 --steps 2   # a quick figure

Defaults (chosen for B=16 at 135M on a 24 GiB CPU host): ``--remat dots_no_batch`` (keeps
every weight matmul's output, recomputes only attention and elementwise ops: ~4% extra
FLOPs) and no loss-chunk remat (the 49k-vocabulary logits of 192 response tokens fit).
XLA's own memory analysis of the compiled step at B=16 (temporaries + 2 GiB of state):
remat none 12.5 + 2 GiB (too close to this host's free memory next to other jobs),
dots_no_batch 4.6 + 2 GiB, full 2.0 + 2 GiB (+33% FLOPs). The update is the fused
clip + AdamW + EMA pass of :mod:`pmd_jax.distill.optim`.

Threads: torch uses ``--threads`` (default 2) intra-op threads; XLA's CPU backend uses all
cores of the machine. The 1-minute load average is printed with each figure (shared hosts).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import time
import traceback

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
                   default="dots_no_batch",
                   help="decoder remat policy (none: no recompute, but B=16 Ts=256 Tt=384 "
                        "then needs 12.5 GiB of XLA temporaries vs 4.6 GiB)")
    p.add_argument("--layer-loop", choices=("scan", "unrolled"), default="scan",
                   help="distill.precision.layer_loop")
    p.add_argument("--attention", default="auto",
                   help="model.attention_impl[:chunk], e.g. chunked:64 (auto: dense at these "
                        "lengths)")
    p.add_argument("--chunk", type=int, default=96, help="response tokens per loss chunk")
    p.add_argument("--chunk-remat", action="store_true",
                   help="recompute each loss chunk's logits in the backward pass (the "
                        "trainer default; off here: the 135M vocabulary's logits fit)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype of both sides: bfloat16 = our "
                        "precision.param_dtype=bfloat16 (fp32 master weights and AdamW "
                        "state) vs torch.autocast('cpu', bfloat16) (fp32 weights and AdamW); "
                        "the peak is then the bf16 GEMM peak")
    p.add_argument("--matmul-dtype", choices=("", "bfloat16"), default="",
                   help="our distill.precision.matmul_dtype: bfloat16 = bf16 operands, fp32 "
                        "accumulation and result for the weight matmuls only (activations, "
                        "norms, attention, loss in --dtype); the torch side is unchanged")
    p.add_argument("--torch-autocast", action="store_true",
                   help="run the torch side under torch.autocast('cpu', bfloat16) (its bf16 "
                        "mixed precision: the like-for-like peer of --matmul-dtype bfloat16)")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--skip-jax", action="store_true")
    p.add_argument("--gemm-n", type=int, default=2048)
    p.add_argument("--no-gemm-shapes", dest="gemm_shapes", action="store_false",
                   help="skip the jnp.dot vs torch.matmul comparison on the step's shapes")
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
    """Model FLOPs of one step (see the module docstring); no remat recompute counted."""
    b, ts, tt, r = args.batch, args.student_len, args.teacher_len, args.response_len
    head = 2.0 * cfg.vocab_size * cfg.hidden_size  # LM head, per projected position

    def fwd(t: int) -> float:  # forward FLOPs of one sequence of length t
        return t * (cfg.flops_per_token(t) - head) + r * head

    return b * (3.0 * fwd(ts) + fwd(tt))


def load() -> str:
    return "load avg {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def minor_faults() -> int:
    """Minor page faults of this process so far (fresh pages the allocator maps and the
    kernel zero-fills: a per-step cost when big buffers are freed and re-mapped)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ------------------------------------------------------------------------------ peak
def _gemm_rates(m: int, k: int, n: int, threads: int, reps: int = 3,
                dtype: str = "float32") -> dict[str, float]:
    """GFLOP/s of an [m, k] x [k, n] matmul: numpy (fp32 only), torch.matmul, jitted jnp.dot
    (bfloat16: bf16 inputs; XLA accumulates in fp32, torch as oneDNN does)."""
    import jax
    import jax.numpy as jnp
    import torch

    torch.set_num_threads(threads)
    a = np.random.default_rng(0).standard_normal((m, k), dtype=np.float32)
    bm = np.random.default_rng(1).standard_normal((k, n), dtype=np.float32)
    tdt = getattr(torch, dtype)
    ta, tb = torch.from_numpy(a).to(tdt), torch.from_numpy(bm).to(tdt)
    ja, jb = jnp.asarray(a, dtype), jnp.asarray(bm, dtype)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    fns = {
        "torch": lambda: torch.matmul(ta, tb),
        "xla": lambda: mm(ja, jb).block_until_ready(),
    }
    if dtype == "float32":
        fns["numpy"] = lambda: a @ bm
    out = {}
    for name, fn in fns.items():
        fn()
        out[name] = 2.0 * m * k * n / min(_timeit(fn) for _ in range(reps)) / 1e9
    return out


def gemm_peak(n: int, threads: int, dtype: str = "float32") -> dict[str, float]:
    return _gemm_rates(n, n, n, threads, dtype=dtype)


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
    impl, _, blk = args.attention.partition(":")
    cfg = cfg.replace(attention_impl=impl, **({"attention_chunk": int(blk)} if blk else {}))
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
    ts = st.TrainStep(cfg, c, loss_chunk_remat=args.chunk_remat)
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
    t0 = time.perf_counter()
    state, m = ts.step(state, batch)
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    first_loss = float(m["loss"])
    times = []
    f0 = minor_faults()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = ts.step(state, batch)
        jax.block_until_ready((state.params, m))
        times.append(time.perf_counter() - t0)
    faults = (minor_faults() - f0) / max(args.steps, 1)
    print(f"  jax: compile+first step {first:.1f}s, first-step loss {first_loss:.6f}, "
          f"steps {[round(x, 2) for x in times]} ({load()}, peak RSS {peak_rss_gib():.1f} GiB, "
          f"{faults / 1e6:.2f}M minor page faults/step)", flush=True)
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

    def autocast():
        on = args.dtype == "bfloat16" or args.torch_autocast
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)

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
        return float(loss.detach())

    t0 = time.perf_counter()
    first_loss = step()
    first = time.perf_counter() - t0
    times = []
    f0 = minor_faults()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    faults = (minor_faults() - f0) / max(args.steps, 1)
    print(f"  torch: first step {first:.1f}s, first-step loss {first_loss:.6f}, "
          f"steps {[round(x, 2) for x in times]} ({load()}, peak RSS {peak_rss_gib():.1f} GiB, "
          f"{faults / 1e6:.2f}M minor page faults/step)", flush=True)
    return float(np.median(times)), first_loss


def _child(side: str, args: argparse.Namespace, q) -> None:
    try:
        from pmd_jax.models.config import preset

        data = make_data(args, preset("smollm2-135m").vocab_size)
        params = init_params()
        fn = bench_jax if side == "jax" else bench_torch
        if side == "torch":
            import jax

            params = jax.tree.map(np.asarray, params)  # host copies for the torch model
        t, loss = fn(args, data, params)
        q.put(("ok", t, loss, peak_rss_gib(), load()))
    except BaseException as e:  # noqa: BLE001  (reported by the parent)
        q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))


def run_side(side: str, args: argparse.Namespace) -> tuple[float, float, float, str] | None:
    """Run one side in a spawned child; None (and a printed reason) if it failed or was
    killed (e.g. by the kernel's OOM killer)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_child, args=(side, args, q))
    proc.start()
    res = None
    while proc.is_alive() or not q.empty():
        try:
            res = q.get(timeout=5)
            break
        except Exception:  # noqa: BLE001  (queue.Empty: keep waiting while the child lives)
            continue
    proc.join()
    if res is None:
        sig = -proc.exitcode if proc.exitcode and proc.exitcode < 0 else None
        why = f"killed by signal {sig}" + (" (SIGKILL: most likely the OOM killer)"
                                            if sig == 9 else "") if sig else \
            f"exit code {proc.exitcode}"
        print(f"{side}: FAILED, {why}; {load()}", flush=True)
        return None
    if res[0] == "error":
        print(f"{side}: FAILED with {res[1]}", flush=True)
        return None
    return res[1], res[2], res[3], res[4]


def main() -> None:
    args = parse()
    from pmd_jax.models.config import preset

    cfg = preset("smollm2-135m")
    flops = model_flops(cfg, args)
    print(f"SmolLM2-135M train step: B={args.batch} student T={args.student_len} teacher "
          f"T={args.teacher_len} response R={args.response_len} loss={args.loss} "
          f"dtype={args.dtype} matmul_dtype={args.matmul_dtype or 'same'} remat={args.remat} "
          f"layer_loop={args.layer_loop} "
          f"attention={args.attention} "
          f"chunk={args.chunk} "
          f"chunk_remat={args.chunk_remat}; "
          f"{flops / 1e12:.3f} model TFLOP/step; {os.cpu_count()} CPUs; {load()}", flush=True)
    # bf16 matmuls on either side: the bf16 GEMM peak is the ceiling (AMX: ~3.5x fp32's)
    peak_dtype = ("bfloat16" if args.dtype == "bfloat16" or args.matmul_dtype
                  or args.torch_autocast else "float32")
    peak = gemm_peak(args.gemm_n, args.threads, peak_dtype)
    best_peak = max(peak.values())
    print(f"{peak_dtype} GEMM peak ({args.gemm_n}^3): "
          + ", ".join(f"{k} {v:.1f}" for k, v in peak.items())
          + f" GFLOP/s -> peak {best_peak:.1f} GFLOP/s ({load()})", flush=True)
    if args.gemm_shapes:
        print("the step's matmul shapes [m, k] x [k, n], GFLOP/s (jnp.dot vs torch.matmul):")
        for name, (m, k, n) in step_gemm_shapes(cfg, args):
            r = _gemm_rates(m, k, n, args.threads, dtype=peak_dtype)
            print(f"  {name:18s} {m:6d} x {k:5d} x {n:6d}: "
                  + "  ".join(f"{k_} {v:6.1f}" for k_, v in r.items()), flush=True)
    res = {}
    for side in ("jax", "torch"):
        if getattr(args, f"skip_{side}"):
            continue
        r = run_side(side, args)
        if r is None:
            continue
        res[side] = r
        t, _, rss, ld = r
        gf = flops / t / 1e9
        name = "pmd_jax" if side == "jax" else "torch+HF"
        print(f"{name}: {t:.2f} s/step, {gf:.1f} GFLOP/s = {gf / best_peak:.0%} of the "
              f"{best_peak:.1f} GFLOP/s GEMM peak; peak RSS {rss:.1f} GiB ({ld})", flush=True)
    if "jax" in res and "torch" in res:
        (t_jax, l_jax, *_), (t_torch, l_torch, *_) = res["jax"], res["torch"]
        print(f"same weights, same batch: first-step loss pmd_jax {l_jax:.6f} vs torch "
              f"{l_torch:.6f} (rel. diff {abs(l_jax - l_torch) / max(abs(l_torch), 1e-12):.1e})")
        print(f"speed-up pmd_jax vs torch: {t_torch / t_jax:.2f}x (aim >= 2x); pmd_jax at "
              f"{flops / t_jax / 1e9 / best_peak:.0%} of the GEMM peak (aim >= 75%)")


if __name__ == "__main__":
    main()
