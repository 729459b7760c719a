"""The train step with shared-prefix rows (``train.shared_prefix``) against one row per
rollout, on the embedded default's model and batch shape, in one process.

SmolLM2-135M-Instruct (the default's weights), ``--problems`` SciQ training problems x
``--n`` rollouts in the default's prompt style; each rollout's response is the tokens of one
of the problem's options (so responses differ in length); each teacher prompt is the problem
+ ``--memory-lines`` lines of memory text (shared by a problem's rollouts) + a demonstration
that differs per rollout, as the PMD teacher's are laid out (problem first). Both steps start
from the same state and get the same batches; the warm-up step (its compile) is not timed.
Printed: each layout's rows x slots per side, the FLOP estimate, seconds per step (median over
``--steps``, the two layouts alternating), the ratio, and how far the shared layout's
metrics and params are from the per-rollout ones (float rounding only: the same function).

    python benchmarks/bench_shared_prefix.py               # 4 problems x 4 rollouts
    python benchmarks/bench_shared_prefix.py --n 8 --steps 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--problems", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="rollouts per problem")
    p.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    p.add_argument("--memory-lines", type=int, default=8)
    return p.parse_args()


def batches(cfg, model, task, args, count):
    from pmd_jax.distill import align
    from pmd_jax.distill.batch import make_batch
    from pmd_jax.loop import teaching

    probs = task.problems("train")
    rng = np.random.default_rng(0)
    memory = "".join(f"\n- Lesson {i}: read the passage for the term the question names, then "
                     f"choose the option it supports ({i})." for i in range(args.memory_lines))
    out = []
    for k in range(count):
        sp, tp, rs = [], [], []
        for i in range(args.problems):
            p = probs[k * args.problems + i]
            msgs = task.prompt(p)
            pre = teaching.response_prefix(task, p)
            student = model.encode_prompt(msgs, pre)
            opts = list(p.meta.get("options", [])) or [str(p.gold)]
            for j in range(args.n):
                answer = opts[j % len(opts)]
                demo = opts[(j + 1) % len(opts)]
                text = (teaching.user_text(msgs) + "\n\nWhat the memory holds:" + memory
                        + f"\n\nA successful attempt: {demo}\n")
                sp.append(student)
                tp.append(model.encode_prompt(teaching.teacher_messages(msgs, text), pre))
                rs.append(model.tokenizer.encode(f"{answer}</answer>")[:cfg.rollout.max_tokens])
        db = align.build_distill_batch(sp, tp, rs, pad_id=model.pad_id, pad_side="right",
                                       pad_to_multiple=16)
        b, r = db.responses.shape
        out.append(make_batch(db, sd_mask=np.ones(b, np.float32),
                              sampler_logp=rng.normal(-2.0, 0.5, (b, r)).astype(np.float32),
                              rewards=rng.integers(0, 2, b).astype(np.float32)))
    return out


def main() -> None:
    args = parse()
    import jax

    from pmd_jax.config.cli import load_config_file
    from pmd_jax.config.modes import apply_mode
    from pmd_jax.config.validate import freeze
    from pmd_jax.distill import shared_prefix as spx
    from pmd_jax.distill import train
    from pmd_jax.loop import build

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    c = load_config_file(os.path.join(here, "configs", "smollm2_sciq.py"))
    c.rollout.problems_per_step, c.rollout.n = args.problems, args.n
    apply_mode(c)
    cfg = freeze(c)
    model = build.load_model(cfg)
    task = build.build_task(cfg)
    data = batches(cfg, model, task, args, 1 + args.steps)
    per_token, per_pair = spx.flops_per_token_and_pair(model.cfg)
    bundles, layouts = {}, {}
    for mode in ("off", "auto"):
        b = train.init_train_state(cfg, model)
        b.step_fn.shared_prefix = mode
        bundles[mode] = b
        _, layouts[mode] = b.step_fn.pack(data[0])
        flops = 0.0
        for side in ("student", "teacher"):
            rows = layouts[mode][f"{side}_forward_rows"]
            slots = layouts[mode][f"{side}_forward_slots"]
            flops += spx.layout_cost(int(rows), int(slots // rows), per_token, per_pair)
        lay = layouts[mode]
        shape = {side: (lay[f"{side}_forward_rows"],
                        lay[f"{side}_forward_slots"] / lay[f"{side}_forward_rows"])
                 for side in ("student", "teacher")}
        print(f"{mode:4s}: student {shape['student'][0]:.0f} rows x {shape['student'][1]:.0f} "
              f"slots, teacher {shape['teacher'][0]:.0f} x {shape['teacher'][1]:.0f}; forward "
              f"estimate {flops / 1e12:.2f} TFLOP", flush=True)
    times: dict[str, list[float]] = {"off": [], "auto": []}
    first: dict[str, dict[str, float]] = {}
    for k, batch in enumerate(data):
        order = ("off", "auto") if k % 2 == 0 else ("auto", "off")
        for mode in order:
            t0 = time.perf_counter()
            m = train.train_step(bundles[mode], batch)
            jax.block_until_ready(bundles[mode].state)
            dt = time.perf_counter() - t0
            if k == 0:
                first[mode] = m
                print(f"{mode:4s} warm-up (compile + step) {dt:.1f} s", flush=True)
            else:
                times[mode].append(dt)
                print(f"{mode:4s} step {k}: {dt:.1f} s  (load {os.getloadavg()[0]:.2f})",
                      flush=True)
    med = {m: float(np.median(v)) for m, v in times.items()}
    print(f"\nmedian s/step: per rollout {med['off']:.1f}, shared prefix {med['auto']:.1f}; "
          f"ratio shared / per-rollout {med['auto'] / med['off']:.2f}")
    for key in ("loss", "kl", "grad_norm", "top1_agree", "logp_mismatch_mean"):
        a, b = first["auto"][key], first["off"][key]
        print(f"step 0 {key}: shared {a:.8g}, per rollout {b:.8g}, rel diff "
              f"{abs(a - b) / max(abs(b), 1e-30):.1e}")
    worst = 0.0
    for a, b in zip(jax.tree.leaves(bundles["auto"].state.params),
                    jax.tree.leaves(bundles["off"].state.params), strict=True):
        worst = max(worst, float(np.max(np.abs(np.asarray(a) - np.asarray(b)))))
    print(f"params after {1 + args.steps} steps: max |shared - per rollout| = {worst:.2e}")


if __name__ == "__main__":
    main()
