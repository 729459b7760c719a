"""The train step's host memory, one program against two, from XLA's own accounting.

Compiles a run config's distillation step on abstract arrays (no weights are allocated or
read: the model's shapes come from its config.json, or the embedded model's GGUF export) at
the config's update batch (``rollout.problems_per_step x rollout.n`` rows, student length
``rollout.max_prompt_tokens + rollout.max_tokens``, teacher length ``teacher_prompt.max_tokens
+ rollout.max_tokens``, ``train.microbatch_rows`` as the run uses them) and prints
``compiled.memory_analysis()`` for:

1. the step as one program (``TrainStep.step``): the train state (params, AdamW moments,
   teacher) are its arguments, donated and aliased to its outputs, plus XLA's temporaries;
2. the step as two programs (``TrainStep.gradients`` then ``TrainStep.apply_gradients``,
   ``train.offload_optimizer_during_grads``): the gradient program's arguments are params and
   teacher only (the moments wait in a file), its output the gradient; the update's arguments
   are the state and the gradient.

Resident arrays of a program = arguments + outputs - aliased + temporaries (XLA:CPU reports
no peak of its own); the two-program figure is the larger of the two. The ratio two / one is
printed last. This is what the arrays need at the step's peak; the process adds Python, the
runtime, compiled programs and the allocator's slack (about 2 GiB on the 0.5B coder's cells).

    python benchmarks/bench_step_memory.py --config configs/qwen25coder05b_mbpp.py --mode pmd
    python benchmarks/bench_step_memory.py --config configs/smollm2_sciq.py --mode sdpo
"""

from __future__ import annotations

import argparse
import ast
import json
import time
from typing import Any


def _analysis(compiled: Any) -> dict[str, float]:
    """The dry run's reading of ``memory_analysis()`` (GiB), under short names."""
    from pmd_jax.dry_run.distill_step import memory_gib

    m = memory_gib(compiled.memory_analysis())
    return {"argument": m["argument_size_gib"], "output": m["output_size_gib"],
            "alias": m["alias_size_gib"], "temp": m["temp_size_gib"],
            "resident": m["total_estimate_gib"]}


def step_memory(cfg: Any) -> dict[str, Any]:
    """One- and two-program memory of ``cfg``'s train step (a frozen RunConfig)."""
    import jax

    from pmd_jax.distill.step import TrainStep
    from pmd_jax.dry_run.distill_step import abstract_batch
    from pmd_jax.loop.build import attention_options, source_model_config
    from pmd_jax.models.config import preset

    m = cfg.model
    name = m.random_init or m.preset
    if name:
        mc = preset(name).replace(dtype=m.dtype, param_dtype=m.param_dtype,
                                  **attention_options(cfg))
    else:
        mc = source_model_config(cfg)[1]
    ts = TrainStep(mc, cfg.distill, microbatch_rows=int(cfg.train.microbatch_rows),
                   shared_prefix="off")
    r = cfg.rollout
    rows = int(r.problems_per_step) * int(r.n)
    student, response = int(r.max_prompt_tokens) + int(r.max_tokens), int(r.max_tokens)
    teacher = int(cfg.teacher_prompt.max_tokens) + response
    state = ts.abstract_state()
    batch = abstract_batch(ts, rows, student, teacher, response)
    t0 = time.perf_counter()
    one = _analysis(ts.lower(state, batch).compile())
    grads = jax.jit(ts._loss_and_grads).lower(state.params, state.teacher, batch).compile()
    outs = jax.eval_shape(ts._loss_and_grads, state.params, state.teacher, batch)
    update = ts._get_update_program().lower(state, *outs).compile()
    two = {"gradient": _analysis(grads), "update": _analysis(update)}
    two_peak = max(two["gradient"]["resident"], two["update"]["resident"])
    return {
        "model": name or m.source, "params": mc.num_params(), "loss": cfg.distill.loss.name,
        "rows": rows, "microbatch_rows": int(cfg.train.microbatch_rows),
        "student_len": student, "teacher_len": teacher, "response_len": response,
        "one_program": one, "two_programs": two,
        "one_program_resident_gib": one["resident"], "two_programs_resident_gib": two_peak,
        "ratio_two_over_one": two_peak / one["resident"],
        "compile_seconds": time.perf_counter() - t0,
    }


def format_report(r: dict[str, Any]) -> str:
    def line(name: str, a: dict[str, float]) -> str:
        return (f"  {name:<22} arguments {a['argument']:6.2f}  outputs {a['output']:6.2f}  "
                f"aliased {a['alias']:6.2f}  temporaries {a['temp']:6.2f}  "
                f"resident {a['resident']:6.2f} GiB")

    return "\n".join([
        f"{r['model']} ({r['params'] / 1e6:.0f}M params), loss {r['loss']}, {r['rows']} rows "
        f"(microbatches of {r['microbatch_rows'] or r['rows']}), student {r['student_len']} / "
        f"teacher {r['teacher_len']} / response {r['response_len']} tokens",
        line("one program", r["one_program"]),
        line("two: gradient", r["two_programs"]["gradient"]),
        line("two: update", r["two_programs"]["update"]),
        f"  resident arrays at the step's peak: one program {r['one_program_resident_gib']:.2f}"
        f" GiB, two programs {r['two_programs_resident_gib']:.2f} GiB: ratio "
        f"{r['ratio_two_over_one']:.2f} (train.offload_optimizer_during_grads)",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/qwen25coder05b_mbpp.py")
    ap.add_argument("--mode", default="", help="run mode (default: the config's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override, as --config.KEY=VALUE on pmd_jax.main")
    ap.add_argument("--json", action="store_true", help="print the report as JSON too")
    a = ap.parse_args(argv)
    from pmd_jax.config import apply_mode, config_errors, freeze
    from pmd_jax.config.cli import load_config_file

    c = load_config_file(a.config)
    if a.mode:
        c.mode = a.mode
    for kv in a.set:
        key, _, text = kv.partition("=")
        *path, last = key.split(".")
        node = c
        for part in path:
            node = node[part]
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text  # a bare string
        node[last] = value
    errs = config_errors(apply_mode(c))
    if errs:
        raise SystemExit("bad config: " + "; ".join(errs))
    r = step_memory(freeze(c))
    print(format_report(r))
    if a.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
