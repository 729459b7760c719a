"""Per-token cost of grammar-constrained decoding in the JaxSampler (llguidance masks).

SmolLM2-135M-Instruct (the embedded default), one batch of chat prompts asking for a reflection
as JSON, T = 1, float32, all in one process. Three timed runs, each after one warm-up call of
the same shapes (JIT compilation is not counted):

1. unconstrained: ``max_tokens`` new tokens per row, no stop token (every row runs to the end);
2. constrained, full length: a reflection-like schema whose strings have a ``minLength`` so
   that no row can finish inside the budget: same batch, same number of tokens as (1), so the
   tokens/s ratio is the per-token overhead of the constrained loop (host-driven decode steps
   + llguidance masks + masked sampling);
3. constrained, realistic: the reflection schema the memory would use (bounded arrays and
   strings); rows stop when their JSON is complete (a finished row still rides along until
   the batch's longest row ends, as with any stop token, so its tokens/s is lower than its
   row-steps/s). Prints the parse/validation rate. Its budget (256 tokens) is below the
   schema's worst case (6 strings of 200 characters), so a rambling row can end "length".

    python benchmarks/bench_structured.py [--batch 16] [--new-tokens 128]

A run on the shared 2-core dev box (load average 1.2-1.6): unconstrained 97.1, constrained
full length 87.8 new tokens/s (0.36 s of 23.3 s in the grammar engine, 2.8 ms per step), ratio
1.11x; an earlier run (load 0.9-1.7) gave 92.1 vs 98.5, 0.93x. Reflection: 16/16 and 15/16
valid (one row ran out of its 256 tokens).

Prints new tokens/s of each run, the ratio unconstrained / constrained (the issue's aim is
<= 1.5x), the host seconds spent in the grammar engine, and the load average (the dev box is a
shared 2-core CPU: compare runs of the same invocation only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pmd_jax.models import gguf_io, hf_io  # noqa: E402
from pmd_jax.models.tokenizer import Tokenizer  # noqa: E402
from pmd_jax.sampling.base import SamplingParams  # noqa: E402
from pmd_jax.sampling.jax_sampler import JaxSampler  # noqa: E402

PROBLEMS = [
    "Which gas do plants absorb during photosynthesis?",
    "What is the average speed of a train that travels 60 km in 1.5 hours?",
    "How many legs does a spider have?",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Which planet is the largest in the solar system?",
    "What does DNA stand for?",
    "What force keeps the planets in orbit around the sun?",
    "What is the chemical symbol for sodium?",
]


def _list(item_min: int, item_max: int, n_min: int, n_max: int) -> dict:
    return {"type": "array", "minItems": n_min, "maxItems": n_max,
            "items": {"type": "string", "minLength": item_min, "maxLength": item_max}}


def reflection_schema(min_len: int = 1) -> dict:
    """Strategies and lessons, as the memory's reflection calls ask for them."""
    return {
        "type": "object",
        "properties": {"strategies": _list(min_len, 200 + min_len, 1, 3),
                       "lessons": _list(min_len, 200 + min_len, 1, 3)},
        "required": ["strategies", "lessons"],
        "additionalProperties": False,
    }


def schema_param(schema: dict) -> str:
    """The schema as a JSON string in its own key order (the engine emits properties in the
    order listed; ``base.schema_string`` would sort "lessons" before "strategies")."""
    return json.dumps(schema)


def prompts_for(tok: Tokenizer, batch: int) -> list[list[int]]:
    out = []
    for i in range(batch):
        q = PROBLEMS[i % len(PROBLEMS)]
        msg = (f"Problem: {q}\nA student answered it. Reflect on how to solve problems like "
               "this one. Reply with JSON only: {\"strategies\": [up to 3 short strategies], "
               "\"lessons\": [up to 3 short lessons]}.")
        out.append(tok.encode_chat([{"role": "user", "content": msg}]))
    return out


def timed(s: JaxSampler, prompts, sp: SamplingParams) -> tuple[float, list, float]:
    s.generate(prompts, sp)  # warm-up: same shapes, so the timed call compiles nothing
    t0 = time.perf_counter()
    out = s.generate(prompts, dataclass_replace(sp, seed=sp.seed + 1))
    dt = time.perf_counter() - t0
    return dt, list(out), s.last_metrics.grammar_seconds


def dataclass_replace(sp: SamplingParams, **kw) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(sp, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()

    d = gguf_io.smollm2_hf_dir()
    tok = Tokenizer.from_files(d / "tokenizer.json", d / "tokenizer_config.json",
                               chat_format="chatml")
    cfg, params = hf_io.load_hf_checkpoint(d)
    s = JaxSampler(cfg, params, max_len=1024, pad_id=int(tok.pad_id), tokenizer=tok)
    prompts = prompts_for(tok, args.batch)
    n_new = args.new_tokens
    print(f"SmolLM2-135M-Instruct, batch {args.batch}, {n_new} new tokens, T=1, float32; "
          f"prompt lengths {min(map(len, prompts))}..{max(map(len, prompts))}; "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs; "
          f"load average before {os.getloadavg()[0]:.2f}", flush=True)

    base = SamplingParams(temperature=1.0, max_tokens=n_new, seed=0)
    dt_u, out_u, _ = timed(s, prompts, base)
    n_u = sum(len(r.tokens) for r in out_u)
    assert n_u == args.batch * n_new, n_u
    rate_u = n_u / dt_u
    print(f"  unconstrained:              {rate_u:8.1f} new tokens/s ({n_u} tokens, "
          f"{dt_u:.1f} s)", flush=True)

    stops = tuple(tok.stop_ids)
    full = dataclass_replace(base, stop_token_ids=stops,
                             json_schema=schema_param(reflection_schema(min_len=n_new * 16)))
    dt_c, out_c, g_c = timed(s, prompts, full)
    n_c = sum(len(r.tokens) for r in out_c)
    assert n_c == args.batch * n_new and all(r.finish_reason == "length" for r in out_c), n_c
    rate_c = n_c / dt_c
    print(f"  constrained (full length):  {rate_c:8.1f} new tokens/s ({n_c} tokens, "
          f"{dt_c:.1f} s; {g_c:.2f} s of it in the grammar engine, "
          f"{1e3 * g_c / n_new:.2f} ms per decode step)", flush=True)

    real = dataclass_replace(base, stop_token_ids=stops, max_tokens=max(n_new, 256),
                             json_schema=schema_param(reflection_schema()))
    dt_r, out_r, g_r = timed(s, prompts, real)
    n_r = sum(len(r.tokens) for r in out_r)
    steps_r = max(len(r.tokens) for r in out_r)
    import jsonschema

    ok = 0
    for r in out_r:
        try:
            jsonschema.validate(json.loads(tok.decode(r.tokens.tolist())), reflection_schema())
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    print(f"  constrained (reflection):   {n_r / dt_r:8.1f} new tokens/s ({n_r} tokens, "
          f"{dt_r:.1f} s; rows stop at the end of their JSON, the batch runs {steps_r} decode "
          f"steps = {len(out_r) * steps_r / dt_r:.1f} row-steps/s; {g_r:.2f} s in the grammar "
          f"engine); valid JSON {ok}/{len(out_r)}, finish 'stop' "
          f"{sum(r.finish_reason == 'stop' for r in out_r)}/{len(out_r)}", flush=True)
    print(f"  e.g. {tok.decode(out_r[0].tokens.tolist())[:300]!r}")
    print(f"ratio unconstrained / constrained tokens/s = {rate_u / rate_c:.2f}x "
          f"(aim <= 1.5x); load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
