"""Scale by simulation: compile a full-size train step on abstract arrays for a simulated mesh.

Lowers and compiles forward + backward + an optax AdamW update of a model config (e.g. the full
OLMo-3-7B or Qwen3-8B) with every input a ``jax.ShapeDtypeStruct`` carrying its sharding, so no
weight is ever allocated. On CPU the mesh devices are simulated with
``--xla_force_host_platform_device_count``. Reports per-device bytes (params, optimizer state,
XLA's argument / output / temp sizes from ``compiled.memory_analysis()``) and FLOPs
(``cfg.flops_per_token`` and ``compiled.cost_analysis()``).

    python -m pmd_jax.dry_run --model=olmo3-7b --mesh=data:1,fsdp:32,tensor:2 --seq=4096 --batch=32

The importable ``dry_run(cfg, mesh_shape, batch, seq)`` needs the devices to exist already
(set ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before jax starts, or use
``dry_run_subprocess``, which runs this module in a fresh interpreter).

Notes on reading the figures: the step is compiled by XLA:CPU, which does not keep bf16 dots in
bf16 the way TPU/GPU backends do and schedules differently, so the temp (activation) figure is
an estimate of what a TPU/GPU compile would need, not a measurement of it. The params and
optimizer figures are exact (they follow from shapes and shardings).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from pmd_jax.models import decoder
from pmd_jax.models.config import preset
from pmd_jax.run import sharding as sh

if TYPE_CHECKING:
    from pmd_jax.models.config import ModelConfig

GiB = 1024**3


def parse_mesh(text: str) -> dict[str, int]:
    """'data:1,fsdp:32,tensor:2' -> {'data': 1, 'fsdp': 32, 'tensor': 2}."""
    out: dict[str, int] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        if ":" not in part:
            raise ValueError(f"--mesh entry {part!r} must look like axis:size (e.g. fsdp:32)")
        k, v = part.split(":", 1)
        out[k.strip()] = int(v)
    return out


def _set_host_devices(n: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _shard_bytes(shape: tuple[int, ...], dtype: Any, sharding: Any) -> int:
    shard = sharding.shard_shape(tuple(shape)) if shape else ()
    return int(math.prod(shard)) * np.dtype(dtype).itemsize


def _tree_bytes(abstract_tree: Any, shardings: Any) -> int:
    return sum(
        _shard_bytes(a.shape, a.dtype, s)
        for a, s in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings))
    )


def opt_state_shardings(opt_shapes: Any, param_shardings: Any, mesh: Any) -> Any:
    """Shardings for an optax state: a leaf whose tree path ends with a param's path (mu, nu,
    ...) and has its shape gets that param's sharding; anything else (step counts) is
    replicated."""

    by_path = {
        tuple(str(k) for k in path): s
        for path, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]
    }
    depth = max(len(k) for k in by_path)
    replicated = NamedSharding(mesh, PartitionSpec())

    def pick(path: Any, leaf: Any) -> Any:
        keys = tuple(str(k) for k in path)
        for n in range(min(depth, len(keys)), 0, -1):
            s = by_path.get(keys[-n:])
            if s is not None and len(s.spec) <= len(leaf.shape):
                return s
        return replicated

    return jax.tree_util.tree_map_with_path(pick, opt_shapes)


def next_token_loss(logits: Any, tokens: Any, mask: Any) -> Any:
    """Mean next-token cross-entropy where a real token predicts a real token."""

    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    w = (mask[:, 1:] * mask[:, :-1]).astype(jnp.float32)
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def chunked_next_token_loss(hidden: Any, params: Any, cfg: ModelConfig, tokens: Any, mask: Any,
                            chunk: int = 1024, unroll: int | bool = 1) -> Any:
    """:func:`next_token_loss` from the final hidden states [B, T, D], computing the logits
    chunk by chunk over the sequence (``jax.checkpoint`` per chunk, so neither the forward
    nor the backward holds more than one [B, chunk, V] float32 block). ``unroll`` goes to the
    ``lax.scan`` over chunks (unrolled, XLA's cost analysis counts every chunk)."""

    B, T, D = hidden.shape
    chunk = max(1, min(chunk, T - 1))
    h, tgt = hidden[:, :-1], tokens[:, 1:].astype(jnp.int32)
    w = (mask[:, 1:] * mask[:, :-1]).astype(jnp.float32)
    n = -(-(T - 1) // chunk)
    pad = n * chunk - (T - 1)
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, D).swapaxes(0, 1)
    tgt = jnp.pad(tgt, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)
    w = jnp.pad(w, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def block(hc, tc, wc):
        lg = decoder.logits_from_hidden(hc, params, cfg)  # [B, chunk, V] float32
        nll = jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, tc[..., None], -1)[..., 0]
        return jnp.sum(nll * wc)

    total, _ = jax.lax.scan(lambda c, xs: (c + block(*xs), None), jnp.float32(0), (h, tgt, w),
                            unroll=unroll)
    return total / jnp.maximum(jnp.sum(w), 1.0)


def _depth(cfg: ModelConfig, n: int) -> ModelConfig:
    over: dict[str, Any] = {"num_layers": n}
    if cfg.layer_types is not None:
        over["layer_types"] = tuple(cfg.layer_types[-n:])
    return cfg.replace(**over)


def _flops(compiled: Any) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older jax returns one dict per computation
        cost = cost[0] if cost else {}
    return float(dict(cost or {}).get("flops", float("nan")))


def _compile_step(cfg, mesh, rules_obj, batch, seq, remat, learning_rate, unroll):
    axes = decoder.param_axes(cfg)
    shapes = decoder.param_shapes(cfg)
    p_shard = sh.tree_shardings(mesh, rules_obj, axes)
    abstract_params = jax.tree.map(
        lambda s, shd: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shd), shapes, p_shard
    )
    opt = optax.adamw(learning_rate, weight_decay=0.0)
    opt_shapes = jax.eval_shape(opt.init, abstract_params)
    o_shard = opt_state_shardings(opt_shapes, p_shard, mesh)
    abstract_opt = jax.tree.map(
        lambda a, shd: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shd), opt_shapes, o_shard
    )
    data_shard = sh.named_sharding(mesh, rules_obj, ("batch", "seq"))
    tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=data_shard)
    msk = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=data_shard)

    def train_step(params, opt_state, tokens, mask):
        positions = decoder.positions_from_mask(mask)

        def loss_fn(p):
            # the logits are never materialised as [B, T, V] (chunked over the sequence)
            hidden, _ = decoder.forward(
                p, tokens, positions, cfg, attn_mask=mask, remat=remat,
                shard_ctx=(mesh, rules_obj), unroll=unroll, return_hidden=True,
            )
            return chunked_next_token_loss(hidden, p, cfg, tokens, mask, unroll=unroll)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(
        train_step,
        in_shardings=(p_shard, o_shard, data_shard, data_shard),
        out_shardings=(p_shard, o_shard, None),
        donate_argnums=(0, 1),
    )
    t0 = time.perf_counter()
    lowered = step.lower(abstract_params, abstract_opt, tok, msk)
    t_lower = time.perf_counter() - t0
    return lowered.compile(), abstract_params, p_shard, abstract_opt, o_shard, t_lower


def dry_run(
    cfg: ModelConfig,
    mesh_shape: Mapping[str, int],
    batch: int,
    seq: int,
    *,
    rules: Mapping[str, Any] | None = None,
    remat: str = "full",
    learning_rate: float = 1e-6,
    count_flops: bool = True,
    verbose: bool = False,
) -> dict[str, Any]:
    """Compile one sharded AdamW train step of ``cfg`` on abstract inputs; return a report.

    ``mesh_shape`` maps data/fsdp/tensor to sizes whose product must equal the number of
    available devices (use as many fake CPU devices as needed). Raises ``ShardingError`` naming
    the tensor if a parameter cannot be split over its mesh axes, or the batch over
    data x fsdp.
    """

    n_needed = math.prod(int(v) for v in mesh_shape.values())
    devices = jax.devices()
    if len(devices) < n_needed:
        raise sh.ShardingError(
            f"mesh {dict(mesh_shape)} needs {n_needed} devices but jax has {len(devices)}; on "
            f"CPU set XLA_FLAGS=--xla_force_host_platform_device_count={n_needed} before jax "
            f"starts (or call dry_run_subprocess)"
        )
    mesh = sh.make_mesh(mesh_shape, devices=devices[:n_needed])
    rules_obj = sh.ShardingRules.from_mapping(rules)
    axes = decoder.param_axes(cfg)
    shapes = decoder.param_shapes(cfg)
    sh.check_divisible(mesh, rules_obj, shapes, axes)
    batch_parts = rules_obj.spec(("batch",))[0]
    batch_parts = () if batch_parts is None else (
        (batch_parts,) if isinstance(batch_parts, str) else batch_parts)
    n_batch = math.prod(mesh.shape[a] for a in batch_parts)
    if batch % n_batch:
        raise sh.ShardingError(
            f"batch={batch} is not divisible by the mesh axes {batch_parts} it is split over "
            f"(total size {n_batch})"
        )

    t0 = time.perf_counter()
    compiled, abstract_params, p_shard, abstract_opt, o_shard, t_lower = _compile_step(
        cfg, mesh, rules_obj, batch, seq, remat, learning_rate, unroll=1)
    t_compile = time.perf_counter() - t0 - t_lower
    flops_note = "XLA cost analysis of the scanned step (loop body counted once)"
    compiled_flops = _flops(compiled)
    if count_flops:
        # XLA's cost analysis counts a while-loop body once. Compile the same step with 1 and 2
        # layers, scan unrolled, and extrapolate linearly in depth: f(L) = f1 + (L-1)(f2 - f1).
        # Dense attention here: the chunked kernel's loops have data-dependent trip counts
        # that the cost analysis cannot see (it would count one tile).
        dense = {"attention_impl": "dense"}
        f1 = _flops(_compile_step(_depth(cfg, 1).replace(**dense), mesh, rules_obj, batch, seq,
                                  remat, learning_rate, unroll=True)[0])
        f2 = _flops(_compile_step(_depth(cfg, 2).replace(**dense), mesh, rules_obj, batch, seq,
                                  remat, learning_rate, unroll=True)[0])
        compiled_flops = f1 + (cfg.num_layers - 1) * (f2 - f1)
        flops_note = ("XLA cost analysis, extrapolated over depth from unrolled 1- and "
                      "2-layer compiles with dense attention (full T x S scores; chunked "
                      "attention skips the masked causal half)")
    mem = compiled.memory_analysis()
    n_dev = n_needed
    tokens_total = batch * seq
    flops_fwd = cfg.flops_per_token(seq)
    report: dict[str, Any] = {
        "model": cfg.family,
        "num_params": cfg.num_params(),
        "param_dtype": cfg.param_dtype,
        "compute_dtype": cfg.dtype,
        "mesh": dict(mesh.shape),
        "devices": n_dev,
        "batch": batch,
        "seq": seq,
        "remat": remat,
        "per_device_bytes": {
            "params": _tree_bytes(abstract_params, p_shard),
            "optimizer_state": _tree_bytes(abstract_opt, jax.tree.leaves(o_shard)),
            "xla_arguments": int(getattr(mem, "argument_size_in_bytes", -1)),
            "xla_outputs": int(getattr(mem, "output_size_in_bytes", -1)),
            "xla_aliased": int(getattr(mem, "alias_size_in_bytes", -1)),
            "xla_temp_activations": int(getattr(mem, "temp_size_in_bytes", -1)),
            "xla_generated_code": int(getattr(mem, "generated_code_size_in_bytes", -1)),
        },
        "model_flops_per_token_fwd": flops_fwd,
        "model_flops_per_token_train": 3.0 * flops_fwd,
        "model_flops_per_step_train": 3.0 * flops_fwd * tokens_total,
        "compiled_flops_per_device": compiled_flops,
        "compiled_flops_per_token": compiled_flops * n_dev / tokens_total,
        "compiled_flops_note": flops_note,
        "lower_seconds": round(t_lower, 1),
        "compile_seconds": round(t_compile, 1),
    }
    pd = report["per_device_bytes"]
    pd["total_estimate"] = (
        pd["xla_arguments"] + pd["xla_outputs"] - max(pd["xla_aliased"], 0)
        + pd["xla_temp_activations"]
    )
    if verbose:
        print(format_report(report))
    return report


def format_report(r: Mapping[str, Any]) -> str:
    pd = r["per_device_bytes"]
    lines = [
        f"dry run: {r['model']} ({r['num_params'] / 1e9:.2f}B params, "
        f"params {r['param_dtype']}, compute {r['compute_dtype']}) on mesh {r['mesh']} "
        f"({r['devices']} devices), batch {r['batch']} x seq {r['seq']}, remat={r['remat']}",
        "per-device memory:",
        f"  params           {pd['params'] / GiB:8.3f} GiB",
        f"  optimizer state  {pd['optimizer_state'] / GiB:8.3f} GiB  (AdamW mu + nu + count)",
        f"  XLA arguments    {pd['xla_arguments'] / GiB:8.3f} GiB  "
        f"(params + opt state + batch; donated, aliased {pd['xla_aliased'] / GiB:.3f} GiB)",
        f"  XLA temp (activations, grads, workspace) {pd['xla_temp_activations'] / GiB:8.3f} GiB",
        f"  total estimate   {pd['total_estimate'] / GiB:8.3f} GiB",
        f"model FLOPs/token: forward {r['model_flops_per_token_fwd'] / 1e9:.2f} GFLOP, "
        f"train (3x) {r['model_flops_per_token_train'] / 1e9:.2f} GFLOP",
        f"compiled FLOPs/token ({r['compiled_flops_note']}; incl. remat recompute, optimizer): "
        f"{r['compiled_flops_per_token'] / 1e9:.2f} GFLOP "
        f"({r['compiled_flops_per_device'] / 1e12:.2f} TFLOP per device per step)",
        f"lower {r['lower_seconds']} s, compile {r['compile_seconds']} s",
    ]
    return "\n".join(lines)


def dry_run_subprocess(
    model: str, mesh: str, batch: int, seq: int, *, remat: str = "full",
    num_layers: int | None = None, timeout: float | None = None, count_flops: bool = True,
) -> dict[str, Any]:
    """Run ``python -m pmd_jax.dry_run.forward_backward`` in a fresh interpreter (so the fake
    device count can be set) and return its JSON report."""
    cmd = [sys.executable, "-m", "pmd_jax.dry_run.forward_backward", f"--model={model}",
           f"--mesh={mesh}", f"--batch={batch}", f"--seq={seq}", f"--remat={remat}", "--json"]
    if not count_flops:
        cmd.append("--skip_flop_count")
    if num_layers is not None:
        cmd.append(f"--num_layers={num_layers}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"dry run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pmd_jax.dry_run", description=__doc__.split(
        "\n")[0])
    ap.add_argument("--model", default="olmo3-7b", help="preset: olmo3-7b, qwen3-8b, ...")
    ap.add_argument("--mesh", default="data:1,fsdp:32,tensor:2")
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: data*fsdp)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--remat", default="full",
                    help="the decoder's remat policy: none | full | dots | dots_no_batch | "
                         "minimal | save_qkv_proj | ... (pmd_jax.models.remat.REMAT_POLICIES)")
    ap.add_argument("--param_dtype", default=None, help="override (e.g. float32 master weights)")
    ap.add_argument("--num_layers", type=int, default=None, help="override depth (tests)")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON line")
    ap.add_argument("--skip_flop_count", action="store_true",
                    help="skip the two extra unrolled compiles that correct XLA's FLOP count")
    args = ap.parse_args(argv)

    mesh_shape = parse_mesh(args.mesh)
    n = math.prod(mesh_shape.values())
    _set_host_devices(n)  # before the jax backend starts

    cfg = preset(args.model)
    over: dict[str, Any] = {}
    if args.param_dtype:
        over["param_dtype"] = args.param_dtype
    if args.num_layers:
        over["num_layers"] = args.num_layers
        if cfg.layer_types is not None:
            # the last layers: for OLMo-3 this keeps both sliding and full layers
            over["layer_types"] = tuple(cfg.layer_types[-args.num_layers:])
    if over:
        cfg = cfg.replace(**over)
    batch = args.batch or mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1)
    report = dry_run(cfg, mesh_shape, batch, args.seq, remat=args.remat,
                     count_flops=not args.skip_flop_count)
    report["preset"] = args.model
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
