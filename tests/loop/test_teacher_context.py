"""Teacher contexts as the trainer builds them, and memory-free evaluation (issue 13, item 5).

A memory holding known strategies, lessons, behaviors and remembered successes (each with a
distinctive marker word) is loaded through ``ProceduralMemory.load_state_dict``; a
deterministic stand-in embedder replaces the sentence-transformers model. The teacher prompts
come from ``teaching.build_train_batch``, the function the trainer calls: each rollout's teacher
prompt is cut from the batch's teacher tokens (up to the logit that predicts the first
response token) and decoded with SmolLM2's own tokenizer, so every assertion is on the token
sequence the teacher actually scores.

- every item appears, in the METHOD.md 2.1 order (problem, strategies, lessons, behaviors,
  correct solution, feedback, instruction), under the configured budget;
- tight budgets cut exactly in ``memory.context.truncation_order`` (the default and another
  permutation), from the end of a list and to a prefix of a text;
- ``random_other_problem``: the mode's form (as many strategies, lessons and behaviors, a
  remembered success only where the mode shows one) with other problems' content;
- ``inverted_lessons``: the lessons under the strategies header and the strategies under the
  lessons header (prompts.py / context.py);
- a real ``Trainer.run`` in mode pmd (tiny random Llama, JAX sampler, in a subprocess like
  test_trainer.py's runs; evaluation at the start and at the end, no training step, to keep
  it fast): every prompt the evaluation sends to the sampler is exactly the task's
  memory-free prompt and holds no memory item or teacher header, while the memory holds items
  (loaded before the run) that a memory-conditioned prompt of the same problems shows.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pmd_jax.config import apply_mode, base_config, freeze
from pmd_jax.loop import build, teaching
from pmd_jax.memory import prompts
from pmd_jax.memory.index import ScannIndex
from pmd_jax.memory.types import Provenance, RolloutRecord
from pmd_jax.sampling.base import Rollout, Rollouts
from tests.fakes import HashEmbedder

ROOT = Path(__file__).resolve().parents[2]


def _header(template: str) -> str:
    return template.strip().split("\n")[0]


STRATEGIES_HEADER = _header(prompts.TEACHER_STRATEGIES_TEMPLATE)
LESSONS_HEADER = _header(prompts.TEACHER_LESSONS_TEMPLATE)
BEHAVIORS_HEADER = _header(prompts.TEACHER_BEHAVIORS_TEMPLATE)
SOLUTION_HEADER = _header(prompts.TEACHER_SOLUTION_TEMPLATE)
FEEDBACK_HEADER = _header(prompts.TEACHER_FEEDBACK_TEMPLATE)
INSTRUCTION = prompts.TEACHER_INSTRUCTION.strip()
TEACHER_HEADERS = (STRATEGIES_HEADER, LESSONS_HEADER, BEHAVIORS_HEADER, SOLUTION_HEADER,
                   FEEDBACK_HEADER, INSTRUCTION)

SYSTEM = "You are a careful science tutor."
PROBLEMS = {
    "pA": "Which gas do plants take in for photosynthesis?\nOptions: oxygen, carbon dioxide, "
          "nitrogen, helium",
    "pB": "What is the SI unit of electrical resistance?\nOptions: volt, ampere, ohm, watt",
    "pC": "Which organelle holds most of a cell's DNA?\nOptions: nucleus, ribosome, vacuole, "
          "membrane",
}
ANIMALS = ("quokka", "narwhal", "axolotl", "pangolin", "okapi", "kinkajou", "tarsier",
           "capybara")
BEHAVIORS = [
    ("behavior_wombat_recall", "Recall the wombat definition before reading the options."),
    ("behavior_ibis_units", "Keep the ibis units consistent from the first line to the last."),
    ("behavior_tapir_verify", "Verify the tapir answer against every clue in the question."),
]
FEEDBACK = ("The verifier rejected the marmoset answer: the chosen option is not among the "
            "correct ones. The expected reasoning names the gas that leaves the stomata at "
            "night, and the reply named the one that enters during the day instead.")


def known_items(pids) -> dict[str, dict]:
    """Per problem: two strategies, two lessons and a success, each with a marker word."""
    out = {}
    for i, pid in enumerate(pids):
        a = ANIMALS[i]
        out[pid] = dict(
            strategies=[f"Restate the {a} clue before choosing (strategy {i}.{j})."
                        for j in range(2)],
            lessons=[f"Never skip the {a} check at the end (lesson {i}.{j})." for j in range(2)],
            success=f"Worked answer for the {a} question, step by step (success {i}).",
        )
    return out


def behavior_line(name: str, instruction: str) -> str:
    return f"{name}: {instruction}"


def memory_texts(items: dict[str, dict]) -> list[str]:
    """Every memory item text: strategies, lessons, successes, behavior names/instructions."""
    out = [x for n, i in BEHAVIORS for x in (n, i)]
    for it in items.values():
        out += it["strategies"] + it["lessons"] + [it["success"]]
    return out


def install_known(mem, problem_text: dict[str, str], items: dict[str, dict],
                  step: int = 0) -> None:
    """Loads ``items`` (and BEHAVIORS) into an empty memory via ``load_state_dict``.

    The successes are stored as step ``step`` rollouts through ExperienceStore.add, the
    problems' vectors through the problem index; strategies, lessons and behaviors are written
    into the memory's own state dict, which is loaded back. The latest update is ``step + 1``,
    so the successes count as remembered from a previous step.
    """
    assert not mem.insights.items and not mem.behaviors.behaviors, "memory must start empty"
    pids = list(problem_text)
    mem.experience.add([RolloutRecord(p, problem_text[p], step, 0, items[p]["success"], 1.0)
                        for p in pids])
    new = [p for p in pids if p not in mem.problems]
    if new:
        mem.problems.upsert(new, mem.embedder.embed([problem_text[p] for p in new], query=True))
    state = mem.state_dict()

    rows, order, ids, texts = [], {}, [], []
    for p in pids:
        for kind, key in (("strategy", "strategies"), ("lesson", "lessons")):
            for t in items[p][key]:
                d = f"ins/{p}/{kind}/{len(ids)}"
                prov = Provenance("reflection", step, (p,), (0, 1), (1.0, 0.0))
                rows.append(dict(docid=d, problem_id=p, kind=kind, text=t,
                                 provenance=prov.to_json(), support=1, last_step=step))
                order.setdefault(p, {}).setdefault(kind, []).append(d)
                ids.append(d)
                texts.append(t)
    idx = ScannIndex(mem.dim, mem.config.index)
    idx.upsert(ids, mem.embedder.embed(texts))
    state["insights"].update(items=rows, order=order, index=idx.state_dict(), next_id=len(ids))

    bids = [f"beh/{k}" for k in range(len(BEHAVIORS))]
    anchors = mem.embedder.embed([behavior_line(n, i) for n, i in BEHAVIORS])
    cent = mem.problems.matrix(pids).mean(axis=0, keepdims=True)
    cent /= np.linalg.norm(cent)
    bidx = ScannIndex(mem.dim, mem.config.index)
    bidx.upsert(bids, anchors)
    state["behaviors"].update(
        behaviors=[dict(docid=d, name=n, instruction=i, cluster_id=0,
                        provenance=Provenance("extraction", step, tuple(pids)).to_json(),
                        created_step=step, updated_step=step, version=1)
                   for d, (n, i) in zip(bids, BEHAVIORS, strict=True)],
        anchors_ids=bids, anchors=anchors, index=bidx.state_dict(), centroids=cent,
        summaries=["Short science questions."], members={"0": pids}, rounds=1,
        last_round_step=step, next_id=len(bids))
    state["last_update_step"] = step + 1
    mem.load_state_dict(state)
    s = mem.stats()
    assert (s["strategies"], s["lessons"], s["behaviors"]) == (2 * len(pids), 2 * len(pids),
                                                               len(BEHAVIORS))


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model() -> build.ModelBundle:
    from pmd_jax.models.gguf_io import smollm2_hf_dir
    from pmd_jax.models.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(smollm2_hf_dir(), chat_format="chatml")  # as load_model
    return build.ModelBundle(cfg=None, params=None, tokenizer=tok, mesh=None, rules=None)


@pytest.fixture(autouse=True)
def _hash_embedder(monkeypatch):
    import pmd_jax.memory.memory as memory_module

    monkeypatch.setattr(memory_module, "shared_embedder", lambda cfg: HashEmbedder())


class Task:
    """The two task methods build_train_batch uses: a system + user prompt, no prefix."""

    def prompt(self, p):
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p.text}]


def run_config(n: int = 1, **over):
    cfg = base_config()
    cfg.mode = "pmd"
    cfg.rollout.n = n
    cfg.teacher_prompt.include_feedback = True  # the fake rollouts all fail: show why
    # ... also next to the memory's success (one knob since issue 16: the memory's
    # context.feedback_only_without_solution is teacher_prompt's; no sibling succeeds here)
    cfg.teacher_prompt.feedback_only_without_solution = False
    for k, v in over.items():
        node = cfg
        *path, last = k.split(".")
        for part in path:
            node = node[part]
        node[last] = v
    return freeze(apply_mode(cfg))  # what the trainer reads: the frozen RunConfig


def make_memory(cfg, model, pids=("pA", "pB", "pC")):
    mem = build.build_memory(cfg, model)  # the trainer's constructor (control tokens etc.)
    items = known_items(pids)
    install_known(mem, {p: PROBLEMS[p] for p in pids}, items)
    return mem, items


def step_batch(cfg, model, pids):
    """A StepBatch of failed rollouts (no sibling success: the memory's success is shown)."""
    from pmd_jax.loop.rollout import StepBatch

    task = Task()
    g = cfg.rollout.n
    problems = [SimpleNamespace(id=p, text=PROBLEMS[p]) for p in pids]
    students = [model.encode_prompt(task.prompt(p)) for p in problems]
    rollouts, texts, results = [], [], []
    for i, p in enumerate(problems):
        for j in range(g):
            text = f"Attempt {j} on {p.id}: the answer is helium."
            toks = np.asarray(model.tokenizer.encode(text), np.int32)
            rollouts.append(Rollout(i, j, toks, np.full(len(toks), -1.0, np.float32), "stop"))
            texts.append(text)
            results.append(SimpleNamespace(reward=0.0, feedback=FEEDBACK, ok=True))
    return StepBatch(problems, students, Rollouts(rollouts, 0), texts,
                     np.zeros((len(problems), g)), results, step=1,
                     messages=[task.prompt(p) for p in problems])


def teacher_user_texts(cfg, model, mem, sb, task=None, sampler=None
                       ) -> tuple[list[str], dict]:
    """build_train_batch's teacher prompts, decoded; returns each one's user message
    (``task``, ``sampler``: for the check before use's replays)."""
    batch, _ = teaching.build_train_batch(cfg, model, task or Task(), mem, sb, sampler=sampler)
    out = []
    head, end = "<|im_start|>user\n", "<|im_end|>"
    for k, r in enumerate(sb.rollouts):
        n = int(batch["teacher_index"][k, 0]) + 1  # the logit predicting response token 0
        row = batch["teacher_tokens"][k]
        assert row[n: n + len(r.tokens)].tolist() == r.tokens.tolist()  # the student's tokens
        prompt = model.tokenizer.decode(row[:n].tolist(), skip_special=False)
        assert prompt.startswith(f"<|im_start|>system\n{SYSTEM}{end}")  # system kept (SDPO)
        assert prompt.count(head) == 1 and prompt.endswith("<|im_start|>assistant\n")
        user = prompt.split(head, 1)[1].split(end, 1)[0]
        # The user message takes exactly count_tokens(user) of the row's tokens: the budget,
        # counted on the text, bounds what the teacher sees.
        bare = model.encode_prompt(teaching.teacher_messages(Task().prompt(sb.problems[
            r.prompt_index]), ""))
        assert n == len(bare) + model.count_tokens(user)
        out.append(user)
    return out, batch


def block_items(text: str, header: str) -> list[str]:
    """The "- item" lines right under ``header`` (up to the blank line ending the block)."""
    lines = text.split(header + "\n", 1)[1].split("\n\n", 1)[0].split("\n")
    assert all(x.startswith("- ") for x in lines), lines
    return [x[2:] for x in lines]


# ----------------------------------------------------------------------------- order
def test_teacher_tokens_hold_every_item_in_method_order(model):
    cfg = run_config()
    mem, items = make_memory(cfg, model)
    sb = step_batch(cfg, model, ["pA", "pB"])
    users, batch = teacher_user_texts(cfg, model, mem, sb)
    budget = min(cfg.teacher_prompt.max_tokens, cfg.memory.context.max_tokens)
    assert batch["sd_mask"].tolist() == [1.0, 1.0]
    for pid, user in zip(["pA", "pB"], users, strict=True):
        own = items[pid]
        beh = sorted((user.index(behavior_line(n, i)), n, i) for n, i in BEHAVIORS)
        # Numbered in the order shown, "k. name: instruction" (METHOD.md 2.1).
        for k, (_, n, i) in enumerate(beh, 1):
            assert f"\n{k}. {behavior_line(n, i)}\n" in user
        marks = ([PROBLEMS[pid], STRATEGIES_HEADER, *own["strategies"], LESSONS_HEADER,
                  *own["lessons"], BEHAVIORS_HEADER]
                 + [behavior_line(n, i) for _, n, i in beh]
                 + [SOLUTION_HEADER, own["success"], FEEDBACK_HEADER, FEEDBACK, INSTRUCTION])
        pos = [user.find(m) for m in marks]
        assert -1 not in pos, [m for m, p in zip(marks, pos, strict=True) if p < 0]
        assert pos == sorted(pos) and len(set(pos)) == len(pos), list(zip(marks, pos))
        assert user.startswith(PROBLEMS[pid]) and user.rstrip().endswith(INSTRUCTION)
        assert block_items(user, STRATEGIES_HEADER) == own["strategies"]
        assert block_items(user, LESSONS_HEADER) == own["lessons"]
        for other, it in items.items():  # nothing of another problem
            if other != pid:
                for t in it["strategies"] + it["lessons"] + [it["success"]]:
                    assert t not in user, (pid, t)
        assert model.count_tokens(user) <= budget


# ----------------------------------------------------------------------------- budget
def shown_behaviors(user: str) -> list[str]:
    """The behavior lines of a teacher text, in the order shown (retrieval rank)."""
    lines = [behavior_line(n, i) for n, i in BEHAVIORS if behavior_line(n, i) in user]
    return sorted(lines, key=user.index)


def part_levels(user: str, it: dict, behaviors: list[str]) -> dict[str, float]:
    """How much of each truncatable part the text keeps: 1 all, 0 none, in between a part.

    ``behaviors``: the behavior lines in the order the uncut text shows them. Checks on the
    way that a list keeps a prefix of its items (cut from the end: the newest strategy or
    lesson, the lowest-ranked behavior) and that a cut text is a prefix of the full text.
    """
    lists = {"strategies": it["strategies"], "lessons": it["lessons"], "behaviors": behaviors}
    out = {}
    for part, xs in lists.items():
        kept = [x in user for x in xs]
        assert kept == sorted(kept, reverse=True), (part, kept)  # cut from the end
        out[part] = sum(kept) / len(kept)
    for part, header, full in (("successful_attempt", SOLUTION_HEADER, it["success"]),
                               ("feedback", FEEDBACK_HEADER, FEEDBACK)):
        if header not in user:
            out[part] = 0.0
            continue
        shown = user.split(header, 1)[1].lstrip("\n").split("\n\n", 1)[0]
        assert shown and full.startswith(shown), (part, shown)
        out[part] = 1.0 if shown == full else 0.5
    return out


@pytest.mark.parametrize("order", [
    None,  # the default, as documented in memory/config.py and memory/context.py
    ["successful_attempt", "strategies", "feedback", "behaviors", "lessons"],
])
def test_tight_budget_cuts_in_the_configured_truncation_order(model, order):
    over = {"memory.context.truncation_order": order} if order else {}
    cfg = run_config(**over)
    order = list(cfg.memory.context.truncation_order)
    if over == {}:
        assert order == ["behaviors", "lessons", "strategies", "feedback", "successful_attempt"]
    mem, items = make_memory(cfg, model)
    sb = step_batch(cfg, model, ["pA"])
    it = items["pA"]

    def user_at(budget: int, run=cfg) -> str:
        (user,), _ = teacher_user_texts(
            run.with_values({"memory.context.max_tokens": budget}), model, mem, sb)
        return user

    whole = user_at(100_000)
    full = model.count_tokens(whole)
    beh = shown_behaviors(whole)
    assert len(beh) == len(BEHAVIORS)
    base = model.count_tokens(PROBLEMS["pA"] + prompts.TEACHER_INSTRUCTION)
    assert user_at(full) == whole
    assert all(v == 1.0 for v in part_levels(whole, it, beh).values())
    states = set()
    prev = None
    for budget in range(full, base - 1, -1):  # every budget from "all fits" to "nothing does"
        user = user_at(budget)
        assert model.count_tokens(user) <= budget
        lv = part_levels(user, it, beh)
        for i, early in enumerate(order):  # a part is cut only once every earlier one is gone
            for late in order[i + 1:]:
                if lv[late] < 1.0:
                    assert lv[early] == 0.0, (budget, early, late, lv)
        if prev is not None:  # a smaller budget never shows more
            assert all(lv[p] <= prev[p] for p in order), (budget, prev, lv)
        prev = lv
        states.add(tuple(lv[p] for p in order))
    # Each step of the order was reached: the first i parts gone, the rest whole.
    for i in range(len(order) + 1):
        assert (0.0,) * i + (1.0,) * (len(order) - i) in states, (i, sorted(states))
    assert user_at(base) == PROBLEMS["pA"] + prompts.TEACHER_INSTRUCTION
    # teacher_prompt.max_tokens binds the same way when it is the smaller budget.
    tight = cfg.with_values({"teacher_prompt.max_tokens": full - 1})
    assert part_levels(user_at(100_000, tight), it, beh)[order[0]] < 1.0


# ----------------------------------------------------------------------------- controls
def test_random_other_problem_shows_another_problems_items_and_none_of_its_own(model):
    """Issue 35: the control has the form of the mode's context (the same sections with as
    many items, a remembered success only where the mode shows one) and other problems'
    content: none of the problem's own strategies, lessons or success."""
    pids = ["pA", "pB", "pC"]
    cfg = run_config(**{"memory.control_mode": "random_other_problem"})
    mem, items = make_memory(cfg, model, pids)
    real_cfg = run_config()
    real_mem, _ = make_memory(real_cfg, model, pids)
    sb = step_batch(cfg, model, pids)
    users, _ = teacher_user_texts(cfg, model, mem, sb)
    reals, _ = teacher_user_texts(real_cfg, model, real_mem, sb)
    others = lambda pid, key: [t for q in pids if q != pid for t in items[q][key]]  # noqa: E731
    for pid, user, real in zip(pids, users, reals, strict=True):
        own = items[pid]
        for t in own["strategies"] + own["lessons"] + [own["success"]]:
            assert t not in user, (pid, t)
        for header, key in ((STRATEGIES_HEADER, "strategies"), (LESSONS_HEADER, "lessons")):
            shown = block_items(user, header)
            assert len(shown) == len(block_items(real, header)) == 2, (pid, key)
            assert set(shown) <= set(others(pid, key)) and len(set(shown)) == 2
        succ = [r for r in pids if items[r]["success"] in user]
        assert len(succ) == 1 and succ[0] != pid, (pid, succ)
        assert own["success"] in real
        got = [behavior_line(n, i) for n, i in BEHAVIORS if behavior_line(n, i) in user]
        assert len(got) == len(BEHAVIORS)  # as many as the mode's top_k 5 shows: all 3
        # same sections, in the same order
        heads = [STRATEGIES_HEADER, LESSONS_HEADER, BEHAVIORS_HEADER, SOLUTION_HEADER,
                 FEEDBACK_HEADER, INSTRUCTION]
        assert [h in user for h in heads] == [h in real for h in heads]
    again, _ = teacher_user_texts(cfg, model, mem, sb)
    assert again == users  # deterministic per (control_seed, problem, update step)


def test_random_control_shows_no_remembered_success_where_the_mode_shows_none(model):
    """The old control showed another problem's success in 10-88% of rows while PMD showed
    a remembered success in none: a sibling's success (SDPO's signal, in both) or no
    remembered success of the problem leaves the control without one too."""
    pids = ["pA", "pB", "pC"]
    cfg = run_config(**{"memory.control_mode": "random_other_problem"})
    mem, items = make_memory(cfg, model, pids)
    del mem.experience.successes["pA"]  # the mode has no remembered success for pA
    sb = step_batch(cfg, model, ["pA"])
    (user,), batch = teacher_user_texts(cfg, model, mem, sb)
    assert SOLUTION_HEADER not in user
    assert not any(items[q]["success"] in user for q in pids)
    assert block_items(user, STRATEGIES_HEADER)  # the other parts are there


def test_inverted_lessons_swaps_strategies_and_lessons_under_the_headers(model):
    cfg = run_config(**{"memory.control_mode": "inverted_lessons"})
    mem, items = make_memory(cfg, model)
    sb = step_batch(cfg, model, ["pA"])
    (user,), _ = teacher_user_texts(cfg, model, mem, sb)
    own = items["pA"]
    # prompts.py: "inverted_lessons" shows the lessons (mistakes) under the strategies header
    # and vice versa; the headers keep their place in the METHOD order.
    assert block_items(user, STRATEGIES_HEADER) == own["lessons"]
    assert block_items(user, LESSONS_HEADER) == own["strategies"]
    marks = [PROBLEMS["pA"], STRATEGIES_HEADER, LESSONS_HEADER, BEHAVIORS_HEADER,
             SOLUTION_HEADER, own["success"], FEEDBACK_HEADER, FEEDBACK, INSTRUCTION]
    pos = [user.index(m) for m in marks]
    assert pos == sorted(pos)
    assert all(behavior_line(n, i) in user for n, i in BEHAVIORS)
    # The same memory without the control shows them the right way round (the memory holds
    # its own copy of the memory section: build.memory_config never writes into the run's).
    mem.config = mem.config.replace(control_mode="none")
    (plain,), _ = teacher_user_texts(cfg, model, mem, sb)
    assert block_items(plain, STRATEGIES_HEADER) == own["strategies"]
    assert block_items(plain, LESSONS_HEADER) == own["lessons"]


# ----------------------------------------------------------------------------- evaluation
EVAL_RUN = textwrap.dedent("""
    import json, sys
    import numpy as np
    from pmd_jax.loop import evaluate as evaluation
    from pmd_jax.loop import teaching
    from pmd_jax.config import apply_mode, config_errors, freeze
    from pmd_jax.config.modes import set_dotted
    from pmd_jax.config.cli import load_config_file
    from pmd_jax.sampling.jax_sampler import JaxSampler
    import pmd_jax.memory.memory as memory_module
    from tests.fakes import HashEmbedder
    from tests.loop.test_teacher_context import install_known, known_items

    run_dir, out_path = sys.argv[1], sys.argv[2]
    memory_module.shared_embedder = lambda cfg: HashEmbedder()
    cfg = load_config_file("configs/smollm2_sciq.py")
    over = {
        "mode": "pmd", "run_dir": run_dir, "resume": False, "model.random_init": "tiny-llama",
        "rollout.problems_per_step": 2, "rollout.n": 1, "rollout.max_tokens": 8,
        "rollout.max_prompt_tokens": 320, "task.max_eval_problems": 2, "eval.n": 1,
        # No training step: Trainer.run still evaluates (once, at the start), and a step
        # (train-step, rollout and reflection compiles) would triple the test's time.
        "eval.max_tokens": 8, "eval.seeds": (0, 1), "train.steps": 0,
        "train.eval_every": 0, "train.eval_at_start": True, "train.export_hf": False,
        "train.kl_initial_every": 0, "teacher_prompt.max_tokens": 768,
        "teacher_prompt.include_feedback": True, "distill.loss.topk": 8,
        "memory.insight.sampling.max_tokens": 8, "memory.behavior.min_problems": 1000,
    }
    if "structured_output" in cfg.memory:  # keep the run small: no grammar programs
        over["memory.structured_output"] = False
    with cfg.unlocked():
        for k, v in over.items():
            set_dotted(cfg, k, v)
    cfg = apply_mode(cfg)
    assert not config_errors(cfg), config_errors(cfg)

    from pmd_jax.loop.trainer import Trainer

    tr = Trainer(freeze(cfg))
    texts = {str(p.id): teaching.user_text(tr.task.prompt(p)) for p in tr.eval_problems}
    items = known_items(list(texts))
    install_known(tr.memory, texts, items)

    calls, evals, phase = [], [], []
    real_generate, real_evaluate = JaxSampler.generate, evaluation.evaluate

    def generate(self, prompts, params, **kw):
        calls.append(dict(phase=phase[-1] if phase else "train", n=params.n,
                          prompts=[list(map(int, p)) for p in prompts]))
        return real_generate(self, prompts, params, **kw)

    def evaluate(cfg, model, task, textgen, problems, out_dir, memory=None, **kw):
        s = memory.stats()
        mem_text = {str(p.id): memory.teacher_context(
            str(p.id), teaching.user_text(task.prompt(p))).render() for p in problems}
        evals.append(dict(stats=s, memory_conditioned=mem_text, calls_before=len(calls)))
        phase.append("eval")
        try:
            return real_evaluate(cfg, model, task, textgen, problems, out_dir, memory, **kw)
        finally:
            phase.pop()

    JaxSampler.generate = generate
    evaluation.evaluate = evaluate
    tr.run()
    free = {str(p.id): tr.model.encode_prompt(tr.task.prompt(p),
                                              teaching.response_prefix(tr.task, p))
            for p in tr.eval_problems}
    json.dump(dict(calls=calls, evals=evals, items=items, free=free,
                   seeds=list(cfg.eval.seeds)), open(out_path, "w"))
""")


from tests.tiny_runs import run_env  # noqa: E402 - real devices, the session's XLA cache


def test_evaluation_prompts_hold_no_memory_text(model, tmp_path):
    out = tmp_path / "captured.json"
    p = subprocess.run([sys.executable, "-c", EVAL_RUN, str(tmp_path / "run"), str(out)],
                       cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(out.read_text())
    items, free = got["items"], got["free"]
    forbidden = memory_texts(items) + list(TEACHER_HEADERS)

    # One evaluation (a run of 0 steps evaluates its weights once), and the memory held items
    # that a memory-conditioned prompt of the evaluated problems would show.
    assert len(got["evals"]) == 1
    for ev in got["evals"]:
        s = ev["stats"]
        assert s["strategies"] >= 4 and s["lessons"] >= 4 and s["behaviors"] == len(BEHAVIORS)
        for pid, text in ev["memory_conditioned"].items():
            assert all(t in text for t in items[pid]["strategies"] + items[pid]["lessons"])
            assert STRATEGIES_HEADER in text and BEHAVIORS_HEADER in text

    eval_calls = [c for c in got["calls"] if c["phase"] == "eval"]
    assert eval_calls
    prompts_sent = [pr for c in eval_calls for pr in c["prompts"]]
    # Every problem, every seed: one prompt each (eval.n samples per prompt).
    assert len(prompts_sent) == len(got["seeds"]) * len(free)
    assert all(c["n"] == 1 for c in eval_calls)
    free_prompts = sorted(free.values())
    for k in range(0, len(prompts_sent), len(free)):
        assert sorted(prompts_sent[k: k + len(free)]) == free_prompts
    for pr in prompts_sent:
        text = model.tokenizer.decode(pr, skip_special=False)
        for t in forbidden:
            assert t not in text, (t, text[-400:])
