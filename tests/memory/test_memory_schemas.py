"""The memory's structured-output schemas: their bounds, validation, prompts, params and counts.

Fast: no policy model (scripted replies) and a hashing embedder instead of a sentence model.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from pmd_jax.memory import MemoryConfig, ProceduralMemory, RolloutRecord, default_memory_config
from pmd_jax.memory.calls import BEHAVIOR_CALLS, CALL_COUNTS, generate_first, zero_counts
from pmd_jax.memory.config import freeze_memory_config
from pmd_jax.memory.schemas import (
    CALLS,
    call_schema,
    call_token_bounds,
    evolution_schema,
    extraction_schema,
    reflection_schema,
    reply_token_bound,
    schema_param,
    summary_schema,
    validate,
)
from pmd_jax.sampling.base import SamplingParams, TextGenerator, TextReply
from tests.fakes import FakeSampler, HashEmbedder

ROOT = Path(__file__).resolve().parents[2]
SENTENCE = "Check the units of every quantity and compare each option with the passage. "


def load_run_config(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def text(n: int) -> str:
    """English-like text of exactly ``n`` characters."""
    return (SENTENCE * (n // len(SENTENCE) + 1))[:n]


def full_reply(call: str, mcfg) -> dict:
    """A reply that fills every upper bound of the call's schema."""
    i, b = mcfg.insight, mcfg.behavior
    if call == "reflection":
        items = [text(i.max_item_chars) for _ in range(i.max_items_per_reflection)]
        return {"strategies": items, "lessons": list(items)}
    if call == "summary":
        return {"summary": text(b.max_summary_chars)}
    if call == "extraction":
        return {"behaviors": [{"name": text(b.max_name_chars),
                               "instruction": text(b.max_instruction_chars)}
                              for _ in range(b.max_behaviors)]}
    return {"actions": [{"action": "update", "name": text(b.max_name_chars),
                         "instruction": text(b.max_instruction_chars)}
                        for _ in range(b.max_actions)]}


def small_reply(call: str) -> dict:
    """A short well-formed reply of each call (valid under the default bounds)."""
    return {
        "reflection": {"strategies": ["Recall the definition first."],
                       "lessons": ["Do not skip the passage."]},
        "summary": {"summary": "Cell biology questions."},
        "extraction": {"behaviors": [{"name": f"behavior_{k}", "instruction": "Define terms."}
                                     for k in ("a", "b", "c")]},
        "evolution": {"actions": [
            {"action": "new", "name": "behavior_units", "instruction": "Track the units."},
            {"action": "remove", "name": "behavior_old"}]},
    }[call]


# ------------------------------------------------------------------- the schemas --
@pytest.mark.parametrize("call", CALLS)
def test_schema_is_valid_json_schema_and_bounded_by_the_config(call):
    jsonschema = pytest.importorskip("jsonschema")
    cfg = default_memory_config()
    schema = call_schema(call, cfg)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert "pattern" not in json.dumps(schema)  # only features both grammar engines support
    assert json.loads(schema_param(schema)) == schema
    # Key order is kept (the grammar engines emit keys in this order).
    assert list(json.loads(schema_param(reflection_schema(cfg.insight)))["properties"]) == [
        "strategies", "lessons"]
    ok = small_reply(call)
    assert validate(ok, schema) == [] and jsonschema.validate(ok, schema) is None
    assert validate(full_reply(call, cfg), schema) == []


def test_schema_bounds_come_from_the_config():
    cfg = default_memory_config()
    cfg.insight.max_items_per_reflection, cfg.insight.max_item_chars = 3, 160
    s = reflection_schema(cfg.insight)
    for key in ("strategies", "lessons"):
        arr = s["properties"][key]
        # 0 by default (issue 35): a reflection with nothing to say may write no item
        assert (arr["minItems"], arr["maxItems"]) == (0, 3)
    cfg.insight.min_items_per_reflection = 1
    arr = reflection_schema(cfg.insight)["properties"]["strategies"]
    assert (arr["minItems"], arr["maxItems"]) == (1, 3)
    for key in ("strategies", "lessons"):
        arr = s["properties"][key]
        assert (arr["items"]["minLength"], arr["items"]["maxLength"]) == (8, 160)
    assert s["required"] == ["strategies", "lessons"] and s["additionalProperties"] is False
    b = cfg.behavior
    arr = extraction_schema(b)["properties"]["behaviors"]
    assert (arr["minItems"], arr["maxItems"]) == (3, 8)
    item = arr["items"]
    assert item["required"] == ["name", "instruction"] and item["additionalProperties"] is False
    assert item["properties"]["instruction"]["maxLength"] == b.max_instruction_chars
    acts = evolution_schema(b)["properties"]["actions"]
    assert acts["maxItems"] == b.max_actions
    write, remove = acts["items"]["anyOf"]
    assert write["properties"]["action"]["enum"] == ["new", "update"]
    assert remove["properties"]["action"]["const"] == "remove"
    assert remove["required"] == ["action", "name"]
    assert summary_schema(b)["properties"]["summary"]["maxLength"] == b.max_summary_chars


BAD = {
    "reflection": [
        {"strategies": ["Recall the definition first."]},  # missing key
        {"strategies": ["x" * 301], "lessons": ["Do not skip the passage."]},  # over-long
        {"strategies": ["Recall the definition first."] * 9, "lessons": ["Do not skip it."]},
        {"strategies": [], "lessons": ["Do not skip the passage."]},  # too few
        {"strategies": "Recall the definition.", "lessons": ["Do not skip it."]},  # wrong type
        {"strategies": [17], "lessons": ["Do not skip the passage."]},
        {"strategies": ["short"], "lessons": ["Do not skip the passage."]},  # under minLength
        {"strategies": ["Recall it."], "lessons": ["Do not skip it."], "extra": 1},
        ["not", "an", "object"],
    ],
    "summary": [{"summary": "x" * 601}, {"summary": 3}, {}, {"summary": "ok"},
                {"summary": "Cell biology.", "more": ""}],
    "extraction": [
        {"behaviors": [{"name": "behavior_a", "instruction": "Define terms."}] * 2},  # too few
        {"behaviors": [{"name": "behavior_a", "instruction": "Define terms."}] * 9},  # too many
        {"behaviors": [{"name": "behavior_a", "instruction": "x" * 301}] * 3},
        {"behaviors": [{"name": "b" * 81, "instruction": "Define terms."}] * 3},
        {"behaviors": [{"name": "behavior_a"}] * 3},
        {"behaviors": ["behavior_a", "behavior_b", "behavior_c"]},
        {"behaviors": [{"name": "behavior_a", "instruction": "Define terms.", "x": 1}] * 3},
    ],
    "evolution": [
        {"actions": [{"action": "zap", "name": "behavior_a", "instruction": "Do it now."}]},
        {"actions": [{"action": "new", "name": "behavior_a"}]},  # new without instruction
        {"actions": [{"action": "remove", "name": "behavior_a", "instruction": "Do it."}]},
        {"actions": [{"action": "remove", "name": "behavior_a"}] * 9},
        {"actions": [{"action": "update", "name": "b" * 81, "instruction": "Do it now."}]},
        {"actions": {"action": "remove", "name": "behavior_a"}},
    ],
}


@pytest.mark.parametrize("call", CALLS)
def test_schema_rejects_too_many_too_long_wrong_typed(call):
    jsonschema = pytest.importorskip("jsonschema")
    cfg = default_memory_config()
    cfg.insight.min_items_per_reflection = 1  # so that an empty list is too few
    schema = call_schema(call, cfg)
    v = jsonschema.Draft202012Validator(schema)
    for bad in BAD[call]:
        assert validate(bad, schema), bad
        assert not v.is_valid(bad), bad


def _mutate(rng: random.Random, value):
    """A random edit of a JSON value: a string grown or emptied, an item added or dropped,
    a key removed or added, a value of another type."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        k = rng.choice(list(value))
        out = dict(value)
        r = rng.random()
        if r < 0.15:
            del out[k]
        elif r < 0.25:
            out["extra"] = "x"
        else:
            out[k] = _mutate(rng, value[k])
        return out
    if isinstance(value, list) and rng.random() < 0.7:
        out = list(value)
        r = rng.random()
        if r < 0.3 and out:
            out.pop(rng.randrange(len(out)))
        elif r < 0.6 and out:
            out.extend([rng.choice(out)] * rng.randint(1, 8))
        elif out:
            i = rng.randrange(len(out))
            out[i] = _mutate(rng, out[i])
        return out
    if isinstance(value, str) and rng.random() < 0.8:
        return rng.choice(["", "ab", value * rng.randint(2, 40), "remove", "new", "update"])
    return rng.choice([None, 3, 2.5, True, "s", [], {}])


@pytest.mark.parametrize("call", CALLS)
def test_validator_agrees_with_jsonschema(call):
    """Our subset validator and the jsonschema package agree on 300 edited replies."""
    jsonschema = pytest.importorskip("jsonschema")
    cfg = default_memory_config()
    schema = call_schema(call, cfg)
    v = jsonschema.Draft202012Validator(schema)
    rng = random.Random(call)
    seen = {True: 0, False: 0}
    for _ in range(300):
        obj = small_reply(call)
        for _ in range(rng.randint(1, 3)):
            obj = _mutate(rng, obj)
        ours = not validate(obj, schema)
        assert ours == v.is_valid(obj), obj
        seen[ours] += 1
    assert seen[True] and seen[False]  # both outcomes were exercised


def test_validate_refuses_keywords_outside_its_subset():
    with pytest.raises(ValueError, match="pattern"):
        validate("x", {"type": "string", "pattern": "^x$"})


def test_llguidance_compiles_each_schema_and_follows_it():
    """The JAX sampler's grammar engine takes the schemas and emits keys in schema order."""
    llg = pytest.importorskip("llguidance")

    class ByteTokenizer:  # one token per byte, plus EOS
        eos_token_id = 256
        bos_token_id = None
        tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        special_token_ids = [256]

        def __call__(self, s):
            return list(s if isinstance(s, bytes) else s.encode())

    tok = llg.LLTokenizer(llg.TokenizerWrapper(ByteTokenizer()))
    # As sampling/grammar.py compiles schemas: fixed separators, no free whitespace.
    opts = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    cfg = load_run_config("smollm2_sciq").memory

    def accepts(grammar: str, obj) -> bool:
        m = llg.LLMatcher(tok, grammar)
        data = list(json.dumps(obj).encode())
        return m.try_consume_tokens(data) == len(data) and m.is_accepting()

    for call in CALLS:
        g = llg.LLMatcher.grammar_from_json_schema(schema_param(call_schema(call, cfg)),
                                                   defaults=opts)
        assert llg.LLMatcher.validate_grammar(g, tok) == "", call
        assert accepts(g, small_reply(call)), call
        assert accepts(g, full_reply(call, cfg)), call
        for bad in BAD[call]:
            if validate(bad, call_schema(call, cfg)):
                assert not accepts(g, bad), (call, bad)
    g = llg.LLMatcher.grammar_from_json_schema(
        schema_param(reflection_schema(cfg.insight)), defaults=opts)
    swapped = {"lessons": ["Do not skip the passage."],
               "strategies": ["Recall the definition first."]}
    assert not accepts(g, swapped)  # keys come in the schema's order


# ----------------------------------------------------------------- token budgets --
@pytest.mark.parametrize("name", ["default", "smollm2_sciq", "smollm2_mbpp"])
def test_token_budgets_cover_the_worst_case_reply(name):
    mcfg = default_memory_config() if name == "default" else load_run_config(name).memory
    bounds = call_token_bounds(mcfg)
    budget = {"reflection": mcfg.insight.sampling.max_tokens}
    budget |= dict.fromkeys(BEHAVIOR_CALLS, mcfg.behavior.sampling.max_tokens)
    for call in CALLS:
        assert budget[call] >= bounds[call] + 1, (call, budget[call], bounds[call])  # + stop


def test_token_bound_holds_for_smollm2s_tokenizer():
    """A reply filling every bound takes no more SmolLM2 tokens than reply_token_bound."""
    pytest.importorskip("gguf")
    from pmd_jax.models import assets

    try:
        path = assets.smollm2_gguf_path()
    except assets.AssetError as e:
        pytest.skip(str(e))
    from pmd_jax.models import gguf_io

    tok = gguf_io.tokenizer_from_gguf(gguf_io.metadata(gguf_io.open_gguf(path)))
    for mcfg in (default_memory_config(), load_run_config("smollm2_sciq").memory):
        for call in CALLS:
            reply = json.dumps(full_reply(call, mcfg))  # ", " and ": " as the grammar emits
            n = len(tok.encode(reply))
            bound = reply_token_bound(call_schema(call, mcfg))
            assert n <= bound, (call, n, bound)
            assert n >= bound // 4, (call, n, bound)  # a bound, but not a wildly loose one


def test_reply_token_bound_counts():
    s = {"type": "string", "maxLength": 9}
    assert reply_token_bound(s) == 3 + 2
    arr = {"type": "array", "items": s, "maxItems": 2}
    assert reply_token_bound(arr) == 2 + 2 * 5 + 2
    obj = {"type": "object", "properties": {"a": arr}}
    assert reply_token_bound(obj) == 2 + len('"a"') + 2 + reply_token_bound(arr)
    with pytest.raises(ValueError, match="unbounded"):
        reply_token_bound({"type": "string"})


def test_memory_warns_when_a_budget_is_below_the_worst_case(caplog):
    cfg = small_config(**{"insight.sampling.max_tokens": 64})
    with caplog.at_level(logging.WARNING, logger="pmd_jax.memory.memory"):
        ProceduralMemory(cfg, embedder=HashEmbedder())
    assert any("reflection calls: max_tokens=64" in r.message for r in caplog.records)


# ---------------------------------------------------------- the memory's calls --
def small_config(**kw):
    c = default_memory_config()
    c.insight.dedup = "exact"
    c.behavior.min_problems = 4
    c.behavior.every_n_steps = 1
    c.behavior.num_clusters = 2
    c.behavior.summary_mode = "policy"
    c.stop_token_ids = [7, 9]
    for k, v in kw.items():
        node = c
        *path, last = k.split(".")
        for p in path:
            node = node[p]
        node[last] = v
    return freeze_memory_config(c)


def call_kind(conv) -> str:
    user = conv[-1]["content"]
    if '"strategies"' in user:
        return "reflection"
    if '"actions"' in user:
        return "evolution"
    if '"behaviors"' in user:
        return "extraction"
    return "summary"


class Recorder:
    """A TextGenerator stand-in: records each call's params; replies come from ``script``,
    a function (kind, conversation) -> (text, finish_reason)."""

    def __init__(self, script) -> None:
        self.script = script
        self.calls: list[tuple[str, SamplingParams, list]] = []

    def generate_replies(self, conversations, params):
        out = []
        for conv in conversations:
            kind = call_kind(conv)
            self.calls.append((kind, params, conv))
            t, reason = self.script(kind, conv)
            out.append([TextReply(t, reason)])
        return out

    def params_of(self, kind: str) -> list[SamplingParams]:
        return [p for k, p, _ in self.calls if k == kind]

    def prompts_of(self, kind: str) -> list[str]:
        return [c[-1]["content"] for k, _, c in self.calls if k == kind]


def default_script(kind, conv):
    return json.dumps(small_reply(kind)), "stop"


PROBLEMS = {f"p{i}": f"Question {i}: which organelle does task {i} in a cell?"
            for i in range(4)}


def recs(step, problems=PROBLEMS, rewards=(1.0, 0.0)):
    return [RolloutRecord(pid, q, step, j, f"{pid} attempt {j}", r, "" if r else "Wrong.")
            for pid, q in problems.items() for j, r in enumerate(rewards)]


@pytest.mark.parametrize("structured", [True, False])
def test_memory_sends_each_calls_schema_only_when_structured(structured):
    cfg = small_config(structured_output=structured)
    mem = ProceduralMemory(cfg, embedder=HashEmbedder())
    gen = Recorder(default_script)
    mem.update(0, recs(0), gen)  # reflections, summaries, extraction
    mem.update(1, recs(1), gen)  # reflections, summaries, evolution
    for call in CALLS:
        params = gen.params_of(call)
        assert params, call
        want = schema_param(call_schema(call, cfg)) if structured else None
        assert all(p.json_schema == want for p in params), call
        assert all(p.stop_token_ids == (7, 9) for p in params), call
        sampling = cfg.insight.sampling if call == "reflection" else cfg.behavior.sampling
        assert all(p.max_tokens == sampling.max_tokens for p in params), call
    assert mem.behaviors.behaviors and mem.insights.problems()


def test_prompts_state_the_schema_bounds():
    cfg = small_config(**{"insight.max_items_per_reflection": 3, "insight.max_item_chars": 160,
                          "behavior.max_name_chars": 40, "behavior.max_instruction_chars": 140,
                          "behavior.max_actions": 6, "behavior.max_summary_chars": 300})
    mem = ProceduralMemory(cfg, embedder=HashEmbedder())
    gen = Recorder(default_script)
    mem.update(0, recs(0), gen)
    mem.update(1, recs(1), gen)
    refl = gen.prompts_of("reflection")[0]
    assert "Write at most 3 items in each list" in refl  # min_items_per_reflection 0
    assert "one sentence of 8 to 160 characters" in refl
    assert '{"strategies": ["..."], "lessons": ["..."]}' in refl
    assert "1 to 300 characters" not in refl
    assert "(8 to 300 characters)" in gen.prompts_of("summary")[0]
    ext = gen.prompts_of("extraction")[0]
    assert "Extract 3 to 8 reusable behaviors" in ext
    assert "a name (3 to 40 characters" in ext and "an instruction (8 to 140 characters)" in ext
    evo = gen.prompts_of("evolution")[0]
    assert "Decide on at most 6 actions" in evo
    assert "Names are 3 to 40 characters, instructions 8 to 140 characters" in evo
    cfg = cfg.with_values({"behavior.min_behaviors": 4, "behavior.max_behaviors": 4})
    mem2 = ProceduralMemory(cfg, embedder=HashEmbedder())
    gen2 = Recorder(default_script)
    mem2.update(0, recs(0), gen2)
    assert "Extract exactly 4 reusable behaviors" in gen2.prompts_of("extraction")[0]


VALID = json.dumps({"strategies": ["Recall the definition of each term first."],
                    "lessons": ["Do not answer before reading the passage."]})
MALFORMED = '{"strategies": ["Recall the definition", "lessons": [}'
VIOLATING = json.dumps({"strategies": ["Compare each option with the passage."],
                        "lessons": ["x" * 301]})  # over-long lesson: dropped, strategy kept
TRUNCATED = '{"strategies": ["Check the units of every quan'


def test_counts_for_valid_malformed_violating_and_truncated_replies():
    replies = {"p0": (VALID, "stop"), "p1": (MALFORMED, "stop"), "p2": (VIOLATING, "stop"),
               "p3": (TRUNCATED, "length")}

    def script(kind, conv):
        if kind != "reflection":
            return default_script(kind, conv)
        pid = next(p for p, q in PROBLEMS.items() if q in conv[-1]["content"])
        return replies[pid]

    mem = ProceduralMemory(small_config(**{"levels.behavior": False}), embedder=HashEmbedder())
    st = mem.update(0, recs(0), Recorder(script))
    c = st.counts
    assert {k: c[k] for k in CALL_COUNTS} == dict(
        reflections=4, parsed=1, json_error=2, schema_error=1, truncated=1)
    assert c["overlong_item"] == 1
    assert mem.insights.texts("p0", "strategy") == ["Recall the definition of each term first."]
    assert mem.insights.texts("p2", "strategy") == ["Compare each option with the passage."]
    assert mem.insights.texts("p2", "lesson") == []
    assert not mem.insights.texts("p1", "strategy") and not mem.insights.texts("p3", "lesson")
    # The behavior level was off: its counts are there, at zero.
    assert all(c[f"behavior/{k}"] == 0 for k in CALL_COUNTS)


def test_behavior_round_counts_per_call_type():
    def extraction_two(kind, conv):  # two behaviors where the schema wants 3 to 8
        if kind == "extraction":
            obj = {"behaviors": [{"name": "behavior_a", "instruction": "Define terms first."},
                                 {"name": "behavior_b", "instruction": "Check the units."}]}
            return json.dumps(obj), "stop"
        return default_script(kind, conv)

    mem = ProceduralMemory(small_config(), embedder=HashEmbedder())
    st = mem.update(0, recs(0), Recorder(extraction_two))
    c = st.counts
    k = c["behavior/clusters"]
    assert k >= 1
    assert c["behavior/summary/reflections"] == c["behavior/summary/parsed"] == k
    assert c["behavior/extraction/reflections"] == c["behavior/extraction/schema_error"] == k
    assert c["behavior/extraction/parsed"] == 0 and c["behavior/too_few_behaviors"] == k
    assert c["behavior/reflections"] == 2 * k and c["behavior/parsed"] == k
    assert c["behavior/schema_error"] == k
    assert {b.name for b in mem.behaviors.behaviors.values()} == {"behavior_a", "behavior_b"}

    def evolution_cut(kind, conv):
        if kind == "evolution":
            return '{"actions": [{"action": "new", "name": "behavior_c", "instr', "length"
        return default_script(kind, conv)

    st = mem.update(1, recs(1), Recorder(evolution_cut))
    c = st.counts
    k = c["behavior/clusters"]
    assert c["behavior/evolution/reflections"] == c["behavior/evolution/truncated"] == k
    assert c["behavior/evolution/json_error"] == k and c["behavior/truncated"] == k
    assert c["behavior/extraction/reflections"] == 0
    # Every reply is exactly one of parsed / json_error / schema_error.
    for prefix in ["", "behavior/"] + [f"behavior/{t}/" for t in BEHAVIOR_CALLS]:
        assert c[f"{prefix}reflections"] == sum(
            c[f"{prefix}{k}"] for k in ("parsed", "json_error", "schema_error")), prefix


def test_counts_are_zero_on_steps_without_calls():
    mem = ProceduralMemory(small_config(frozen_after_step=0), embedder=HashEmbedder())
    gen = Recorder(default_script)
    frozen = mem.update(1, recs(1), gen)
    assert frozen.frozen and not gen.calls
    assert {k: frozen.counts[k] for k in zero_counts()} == zero_counts()
    mem = ProceduralMemory(small_config(), embedder=HashEmbedder())
    empty = mem.update(0, [], gen)
    assert not gen.calls and all(empty.counts[k] == 0 for k in zero_counts())


def test_update_memory_logs_the_counts_every_step():
    """teaching.update_memory (the trainer's memory step, whose dict goes to metrics.jsonl)
    reports the five counts, insight and behavior, on every step, zeros included."""
    from pmd_jax.loop import teaching

    task = SimpleNamespace(prompt=lambda p: [{"role": "user", "content": p.text}],
                           gold_leak_strings=lambda p: [])
    problems = [SimpleNamespace(id=pid, text=q) for pid, q in PROBLEMS.items()]

    def batch(rewards):
        rollouts = [SimpleNamespace(prompt_index=i, sample_index=j)
                    for i in range(len(problems)) for j in range(len(rewards))]
        results = [SimpleNamespace(reward=r, feedback="") for _ in problems for r in rewards]
        return SimpleNamespace(rollouts=rollouts, texts=[f"answer {k}" for k in
                                                         range(len(rollouts))],
                               results=results, problems=problems,
                               messages=[task.prompt(p) for p in problems])

    mem = ProceduralMemory(small_config(**{"behavior.min_problems": 100}),
                           embedder=HashEmbedder())
    gen = Recorder(default_script)
    out = teaching.update_memory(None, mem, 0, batch([1.0, 0.0]), task, gen)
    for k in CALL_COUNTS:
        assert f"memory_{k}" in out and f"memory_behavior/{k}" in out
        for t in BEHAVIOR_CALLS:
            assert out[f"memory_behavior/{t}/{k}"] == 0.0
    assert out["memory_reflections"] == 4.0 and out["memory_parsed"] == 4.0
    empty = SimpleNamespace(rollouts=[], texts=[], results=[], problems=[], messages=[])
    out = teaching.update_memory(None, mem, 1, empty, task, gen)
    assert all(out[f"memory_{k}"] == 0.0 for k in CALL_COUNTS)


# ------------------------------------------------------------- TextGenerator --
def test_text_generator_replies_carry_finish_reasons():
    sampler = FakeSampler()
    tg = TextGenerator(sampler, lambda m: [ord(c) for c in m[0]["content"]],
                       lambda ids: "".join(chr(97 + (i % 26)) for i in ids))
    convs = [[{"role": "user", "content": "ab"}], [{"role": "user", "content": "cd"}]]
    params = SamplingParams(n=2, json_schema=schema_param(summary_schema(
        MemoryConfig().behavior)))
    replies = tg.generate_replies(convs, params)
    assert [[r.finish_reason for r in rs] for rs in replies] == [["stop", "length"]] * 2
    assert tg.generate_texts(convs, params) == [[r.text for r in rs] for rs in replies]
    assert sampler.params[0].json_schema == params.json_schema
    assert tg.generate_replies([], params) == []
    # each reply says how many tokens it took; generate_first counts all n replies' tokens
    ids = [len(r.text) for rs in replies for r in rs]
    assert [r.num_tokens for rs in replies for r in rs] == ids and min(ids) > 0
    c: Counter = Counter()
    generate_first(tg, convs, params, c)
    assert c["generated_tokens"] == sum(ids) and c["reflections"] == 2


def test_generate_first_handles_text_only_and_broken_generators():
    class TextsOnly:
        def generate_texts(self, conversations, params):
            return [["a"], None]  # the second reply is malformed; the third missing

    c: Counter = Counter()
    convs = [[{"role": "user", "content": str(i)}] for i in range(3)]
    assert generate_first(TextsOnly(), convs, SamplingParams(), c) == ["a", "", ""]
    assert c["reflections"] == 3 and c["missing_reply"] == 2 and c["truncated"] == 0
    c = Counter()
    assert generate_first(None, convs, SamplingParams(), c) == ["", "", ""]
    assert c["reflections"] == 3
