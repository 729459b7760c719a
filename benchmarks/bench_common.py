"""Pieces shared by the side-by-side benchmarks (bench_train_step.py, bench_sampler.py).

* Model shapes with random weights (``--model``, ``--layers``): SmolLM2-135M and Llama-3-8B
  (cut to N layers), built from a :class:`ModelConfig`; the torch side gets the same weights
  through :func:`load_into_torch` (HF ``LlamaForCausalLM``).
* One process per side: the parent runs ``python <script> --child <side> ...`` for each side
  in turn (:func:`run_child`); a child prints its progress on stderr and one ``RESULT {json}``
  line on stdout (:func:`emit`). On a GPU this is required, not only tidy: JAX keeps the device
  memory it took until its process ends, so torch in the same process would run out of memory.
  The torch child runs JAX on the CPU only (``JAX_PLATFORMS=cpu``: it draws the same random
  weights there).
* The GEMM peak of the same run, on the same device, in the compute dtype: a large square
  ``jnp.dot`` timed in our child and ``torch.matmul`` in the torch child; the parent takes the
  larger as the peak both sides are measured against.
* Peak memory: on GPU the device allocator's peak (``memory_stats()['peak_bytes_in_use']`` in
  JAX, ``torch.cuda.max_memory_allocated()`` in torch); on CPU the process's peak RSS.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

RESULT_PREFIX = "RESULT "
MODELS = ("smollm2-135m", "llama3-8b", "tiny-llama")


# ------------------------------------------------------------------------------ models
def llama3_8b():
    """Llama-3-8B's shape (HF meta-llama/Meta-Llama-3.1-8B config; random weights here)."""
    from pmd_jax.models.config import ModelConfig, RopeConfig

    return ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        max_position_embeddings=131072, tie_embeddings=False,
        rope=(("full_attention", RopeConfig(
            theta=500000.0, rope_type="llama3", factor=8.0,
            original_max_position_embeddings=8192, low_freq_factor=1.0,
            high_freq_factor=4.0)),),
    )


def model_config(name: str, layers: int | None = None, dtype: str = "float32"):
    """The ModelConfig of ``--model`` cut to ``layers`` (None: all), compute dtype ``dtype``
    (parameters stay float32: the fp32 master weights)."""
    from pmd_jax.models.config import preset

    if name not in MODELS:
        raise SystemExit(f"--model {name!r} is not one of {MODELS}")
    cfg = llama3_8b() if name == "llama3-8b" else preset(name)
    if layers:
        cfg = cfg.replace(num_layers=int(layers))
    return cfg.replace(dtype=dtype, param_dtype="float32")


def init_params(cfg, seed: int = 0):
    """Random params (HF init) of ``cfg``, float32."""
    import jax

    from pmd_jax.models import decoder

    return decoder.init_params(cfg.replace(param_dtype="float32"), jax.random.PRNGKey(seed))


def hf_llama(mc, device: str):
    """An HF ``LlamaForCausalLM`` of ``mc``'s shape (fp32 weights, SDPA attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    r = mc.rope_for("full_attention")
    rope: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type == "llama3":
        rope.update(factor=r.factor, low_freq_factor=r.low_freq_factor,
                    high_freq_factor=r.high_freq_factor,
                    original_max_position_embeddings=r.original_max_position_embeddings)
    hf = LlamaConfig(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps,
        tie_word_embeddings=mc.tie_embeddings, rope_theta=r.theta, rope_scaling=rope,
        max_position_embeddings=mc.max_position_embeddings, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(hf).float().to(torch_device(device))


def load_into_torch(model, params, mc) -> None:
    """Copy our param pytree (``decoder`` layout, stacked layers) into a HF Llama model."""
    import torch

    d, h, kv, hd = mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim
    dev = next(model.parameters()).device

    def t(x):
        return torch.from_numpy(np.array(x, dtype=np.float32, copy=True)).to(dev)

    lp = params["layers"]
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(t(params["embed"]))
        model.model.norm.weight.copy_(t(params["final_norm"]))
        if not mc.tie_embeddings:
            model.lm_head.weight.copy_(t(np.asarray(params["lm_head"]).T))
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


def torch_device(device: str) -> str:
    return {"gpu": "cuda", "meta": "meta"}.get(device, "cpu")


# ------------------------------------------------------------------------------ processes
def child_env(side: str, device: str, xla_flags: str = "") -> dict[str, str]:
    """The environment of a side's child: ours on ``device``; torch's JAX on the CPU."""
    env = dict(os.environ)
    if side == "jax":
        env["JAX_PLATFORMS"] = "cuda" if device == "gpu" else "cpu"
        if device == "gpu":  # torch may use the whole GPU: so may we (default is 75%)
            env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
        if xla_flags:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    else:
        env["JAX_PLATFORMS"] = "cpu"
    return env


def run_child(script: str, side: str, argv: Sequence[str], env: dict[str, str],
              timeout: float | None = None, python: str | None = None
              ) -> dict[str, Any] | None:
    """Run ``python script --child side argv...`` (``python``: this interpreter unless given,
    e.g. a peer's venv); its stderr goes to ours as it comes, its ``RESULT`` line is parsed.
    None (and a printed reason) if it failed or was killed."""
    cmd = [python or sys.executable, script, "--child", side, *argv]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"{side}: FAILED, no result within {timeout:.0f} s", flush=True)
        return None
    res = None
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            res = json.loads(line[len(RESULT_PREFIX):])
        elif line.strip():
            print(f"  [{side}] {line}", flush=True)
    if res is None:
        rc = p.returncode
        why = (f"killed by signal {-rc}" + (" (SIGKILL: most likely the OOM killer)"
                                           if rc == -9 else "")) if rc < 0 else f"exit code {rc}"
        print(f"{side}: FAILED ({why}) after {time.perf_counter() - t0:.0f} s; {load()}",
              flush=True)
        return None
    if "error" in res:
        print(f"{side}: FAILED with {res['error']}", flush=True)
        return None
    return res


def run_trainer(config: str, prefix: str, overrides: dict[str, Any],
                extra: Sequence[str] = ()) -> tuple[Any, float]:
    """``python -m pmd_jax.main --config=<repo>/config`` in a fresh temp run directory (named
    ``prefix``...) with ``--config.key=value`` for each override and ``extra`` flags, its output
    on our stderr; (run directory, wall seconds). Raises if the run fails."""
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    cmd = [sys.executable, "-m", "pmd_jax.main", f"--config={root / config}",
           f"--config.run_dir={run_dir}"]
    cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
    cmd += [f"--config.{f}" for f in extra]
    log(f"{prefix.strip('_')}: " + " ".join(cmd[1:]))
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=root, stdout=sys.stderr)
    return run_dir, time.perf_counter() - t0


def train_records(run_dir: Any) -> list[dict[str, Any]]:
    """The per-step records (``kind`` train) of a run's metrics.jsonl."""
    from pathlib import Path

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


def emit(result: dict[str, Any]) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def child_job(args: Any, sides: dict[str, Callable[[Any], dict[str, Any]]]) -> None:
    """A child process's whole job: measure ``sides[args.child]`` and emit its result, or the
    error (with a short traceback) for the parent to report."""
    import traceback

    try:
        res = sides[args.child](args)
        res["load"] = load()
        emit(res)
    except BaseException as e:  # noqa: BLE001  (reported by the parent)
        emit({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"})


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load() -> str:
    return "load avg {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


# ------------------------------------------------------------------------------ measurements
def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def best_time(fn: Callable[[], Any], reps: int, sync: Callable[[], Any] = lambda: None
              ) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def jax_matmul_tflops(m: int, k: int, n: int, dtype: str, reps: int = 5) -> float:
    """TFLOP/s of a jitted ``jnp.dot`` [m, k] x [k, n] in ``dtype`` (fp32 accumulation) on
    JAX's default device; 8 products per timed call (one dispatch)."""
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (k, n), jnp.float32).astype(dtype)

    @jax.jit
    def mm(a, b):
        def body(i, acc):
            return acc + jnp.dot(a + i.astype(a.dtype), b,
                                 preferred_element_type=jnp.float32)[0, 0]
        return jax.lax.fori_loop(0, 8, body, jnp.float32(0))

    t = best_time(lambda: mm(a, b).block_until_ready(), reps)
    return 8 * 2.0 * m * k * n / t / 1e12


def jax_read_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes/s a jitted sum over a float32 array of ``nbytes`` reaches on JAX's default device:
    the rate at which a program can read that many bytes once (a read-once bound's divisor)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((max(1, nbytes // 4),), jnp.float32)
    total = jax.jit(jnp.sum)
    return a.nbytes / best_time(lambda: total(a).block_until_ready(), reps)


def torch_matmul_tflops(m: int, k: int, n: int, dtype: str, device: str, reps: int = 5
                        ) -> float:
    """TFLOP/s of ``torch.matmul`` [m, k] x [k, n] in ``dtype`` on ``device``."""
    import torch

    dev = torch_device(device)
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn((m, k), generator=g).to(dev, tdt)
    b = torch.randn((k, n), generator=g).to(dev, tdt)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def run():
        for _ in range(8):
            torch.matmul(a, b)

    return 8 * 2.0 * m * k * n / best_time(run, reps, sync) / 1e12


def jax_peak_memory() -> tuple[float, str]:
    """(GiB, what): the device allocator's peak on an accelerator, else peak RSS."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if jax.default_backend() != "cpu" and "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**30, "device peak_bytes_in_use"
    return rss_gib(), "peak RSS"


def torch_peak_memory(device: str) -> tuple[float, str]:
    import torch

    if device == "gpu":
        return torch.cuda.max_memory_allocated() / 2**30, "torch.cuda.max_memory_allocated"
    return rss_gib(), "peak RSS"


def device_name(side: str, device: str) -> str:
    if side == "jax":
        import jax

        d = jax.devices()[0]
        return f"{d.device_kind} (jax {jax.__version__}, {jax.default_backend()})"
    import torch

    if device == "gpu":
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    return f"CPU x{os.cpu_count()} (torch {torch.__version__})"
