"""One evaluation of the embedded default: pmd_jax's evaluation vs HF transformers generate.

The embedded default (configs/smollm2_sciq.py: SmolLM2-135M-Instruct, float32, CPU) evaluates
its 100 held-out SciQ questions x 1 sample (T=0.6, top-p 0.95, 24 new tokens) at every
evaluation point. This script runs that evaluation exactly as a run does
(``pmd_jax.loop.evaluate.evaluate``: prompts, the sampler's batch plan, verification, the results
file) and prints its wall time, warm (after one call that compiles), and the peers' times in
the same process:

* ``sort``: the same evaluation with the vocabulary sort of ``sample_ops.top_k_filter`` +
  ``top_p_filter`` in every decode step instead of ``sample_ops.fast_filter`` (the code before
  the fast filter), with whether both gave the same answers;
* ``whole``: the same evaluation with each batch prefilled in one call, every prompt
  left-padded to the batch's length bucket, and batches planned by padded prefill positions
  (the plan before prefill groups, ``batching.plan_prefill_groups``), same answers or not;
* ``bf16prefill``: the same evaluation with ``rollout.prefill_matmul_dtype=bfloat16`` (the
  prefill's weight matmuls with bf16 operands, float32 accumulation; decode unchanged), with
  how many answers kept their reward;
* ``hf``: HF transformers ``generate`` (torch, float32, the same weights exported by
  ``hf_io``) on the same prompts, sorted by length in batches of 16, the same sampling
  settings, verified by the same task.

    python benchmarks/bench_eval.py [--peers sort,whole,bf16prefill,hf] [--reps 1]
        [--config configs/...]

Quote the ratios, on a quiet machine (``uptime``); absolute times drift between runs here.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
_BATCH_COST = None


def _setup(config: str):
    from pmd_jax.config.cli import load_config_file
    from pmd_jax.config.modes import apply_mode
    from pmd_jax.config.validate import freeze
    from pmd_jax.loop import build
    from pmd_jax.sampling.base import TextGenerator

    cfg = load_config_file(config)
    apply_mode(cfg)
    cfg = freeze(cfg)
    task = build.build_task(cfg)
    problems = task.problems(cfg.task.eval_split)[: cfg.task.max_eval_problems]
    model = build.load_model(cfg)
    sampler = build.build_sampler(cfg, model)
    textgen = TextGenerator(sampler, model.encode_chat, model.decode)
    return cfg, task, problems, model, sampler, textgen


def _ours(cfg, task, problems, model, textgen, out: Path) -> tuple[float, float, list[float]]:
    from pmd_jax.loop import evaluate

    t = time.perf_counter()
    res = evaluate.evaluate(cfg, model, task, textgen, problems, out)
    dt = time.perf_counter() - t
    return dt, float(res["accuracy"]), _rewards(out / "results.jsonl")


def _rewards(path: Path) -> list[float]:
    import json

    return [r for line in path.read_text().splitlines() if line.strip()
            for r in json.loads(line)["rewards"]]


def _reset_programs(sampler, fast_k: int | None, whole: bool = False,
                    prefill_dtype: str | None = None) -> None:
    """Recompile the sampler's programs with ``FAST_FILTER_K = fast_k``; ``whole``: one
    prefill per batch at the batch's length bucket, batches planned by padded positions;
    ``prefill_dtype``: the prefill's matmul operand dtype (None: the model's)."""
    import jax

    from pmd_jax.sampling import batching, decode, jax_sampler, sample_ops

    sample_ops.FAST_FILTER_K = fast_k if fast_k is not None else sample_ops.FAST_FILTER_K
    jax_sampler.plan_prefill_groups = _whole_batch if whole else batching.plan_prefill_groups
    jax_sampler._batch_cost = (lambda *args: None) if whole else _BATCH_COST
    decode.compiled_programs.cache_clear()
    jax.clear_caches()
    jax_sampler._SHAPES_RUN.clear()
    shard_ctx = None if sampler.mesh is None else (sampler.mesh, sampler.rules)
    sampler.prefill_matmul_dtype = prefill_dtype
    sampler._fns = decode.compiled_programs(sampler.cfg, sampler.pad_id, shard_ctx,
                                            sampler.cache_dtype, prefill_dtype)


def _whole_batch(lengths, max_rows, *, divisor=1, limit=None, compiled=(), cost=None):
    from pmd_jax.sampling.batching import bucket_length, row_bucket

    p = bucket_length(lengths[-1]) if limit is None else min(limit, bucket_length(lengths[-1]))
    return [(0, len(lengths), row_bucket(len(lengths), divisor), p)]


def _hf(cfg, task, problems, model, batch: int = 16) -> tuple[float, float]:
    import torch
    import transformers

    from pmd_jax.loop.teaching import response_prefix
    from pmd_jax.models.hf_io import save_hf_checkpoint

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(model.params, model.cfg, d, dtype="float32")
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    hf.eval()
    prefixes = [response_prefix(task, p) for p in problems]
    prompts = [model.encode_prompt(task.prompt(p), pre) for p, pre in zip(problems, prefixes,
                                                                           strict=True)]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    texts: list[str] = [""] * len(prompts)
    e = cfg.eval
    t = time.perf_counter()
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), model.pad_id, dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            att[r, width - len(prompts[i]):] = 1
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=att, do_sample=True,
                              temperature=e.temperature, top_p=e.top_p, top_k=0,
                              max_new_tokens=e.max_tokens, pad_token_id=model.pad_id,
                              eos_token_id=list(model.stop_token_ids))
        for r, i in enumerate(idx):
            new = [int(x) for x in out[r, width:] if int(x) != model.pad_id]
            texts[i] = prefixes[i] + model.decode(new)
    dt = time.perf_counter() - t
    res = task.verify_batch(list(problems), texts, cfg.task.eval_split)
    return dt, sum(r.reward for r in res) / len(res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "smollm2_sciq.py"))
    ap.add_argument("--peers", default="sort,whole,hf",
                    help="comma list of: sort, whole, bf16prefill, hf ('' = none)")
    ap.add_argument("--reps", type=int, default=1, help="warm timed calls per engine")
    args = ap.parse_args()
    peers = [p for p in args.peers.split(",") if p]

    from pmd_jax.sampling import jax_sampler, sample_ops

    global _BATCH_COST
    _BATCH_COST = jax_sampler._batch_cost
    cfg, task, problems, model, sampler, textgen = _setup(args.config)
    print(f"{len(problems)} {cfg.task.name} problems x {cfg.eval.n}, T={cfg.eval.temperature} "
          f"top_p={cfg.eval.top_p} max_tokens={cfg.eval.max_tokens}", flush=True)
    fast_k = sample_ops.FAST_FILTER_K
    times: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        runs = [("ours", fast_k, False, None)]
        runs += [("sort", 10**9, False, None)] if "sort" in peers else []
        runs += [("whole", fast_k, True, None)] if "whole" in peers else []
        runs += [("bf16prefill", fast_k, False, "bfloat16")] if "bf16prefill" in peers else []
        answers = {}
        for name, k, whole, pdt in runs:
            _reset_programs(sampler, k, whole, pdt)
            cold, acc, _ = _ours(cfg, task, problems, model, textgen, Path(d) / f"{name}_0")
            warm = []
            for r in range(args.reps):
                dt, acc, rw = _ours(cfg, task, problems, model, textgen,
                                    Path(d) / f"{name}_{r + 1}")
                warm.append(dt)
            times[name] = min(warm)
            answers[name] = rw
            print(f"{name}: {min(warm):.1f} s warm (first call {cold:.1f} s), accuracy {acc:.2f}",
                  flush=True)
            m = sampler.last_metrics
            print(f"  {m.batches} batches, {m.prefill_groups} prefill calls, "
                  f"{m.prefill_positions} prefilled positions", flush=True)
        _reset_programs(sampler, fast_k)
        for name in answers:
            if name != "ours":
                same = sum(a == b for a, b in zip(answers["ours"], answers[name], strict=True))
                print(f"same reward as {name} on {same}/{len(answers['ours'])} questions")
    if "hf" in peers:
        dt, acc = _hf(cfg, task, problems, model)
        times["hf"] = dt
        print(f"hf generate: {dt:.1f} s, accuracy {acc:.2f} (its own random draws)", flush=True)
    for name in times:
        if name != "ours":
            print(f"ratio {name} / ours: {times[name] / times['ours']:.2f}")


if __name__ == "__main__":
    main()
