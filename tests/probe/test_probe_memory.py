"""The probe reads a memory as the memory shows it: a real ProceduralMemory's export, read
back, gives each problem the strategies, lessons, remembered success and retrieved behaviors
that the memory's own ``teacher_context`` gives it; the arms differ in one thing each."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from pmd_jax.memory import ProceduralMemory
from pmd_jax.memory.embedder import shared_embedder
from pmd_jax.memory.experience import MAX_PROBLEM_CHARS
from pmd_jax.memory.sanitize import sanitize_text
from pmd_jax.probe import arms as A
from pmd_jax.probe.memory_file import MemoryFileError, load_memory_file
from tests.memory.test_memory_levels import BIO, CODE, PHYS, Scripted, recs, small_config

PROBLEMS = ({f"bio{i}": q for i, q in enumerate(BIO)} | {f"code{i}": q for i, q in enumerate(CODE)}
            | {f"phys{i}": q for i, q in enumerate(PHYS)})


def _behaviors(conv):
    """Topic-specific behaviors, so that retrieval differs between problems."""
    text = conv[-1]["content"]
    topic = "code" if "function" in text else ("phys" if "force" in text or "SI" in text
                                               else "bio")
    return json.dumps({"behaviors": [
        {"name": f"behavior_{topic}_{k}", "instruction": f"A {topic} habit number {k}."}
        for k in range(3)]})


def _reflection(conv):
    text = conv[-1]["content"]
    pid = next(p for p, q in PROBLEMS.items() if q in text)
    return json.dumps({"strategies": [f"Strategy for {pid}: recall the key fact."],
                       "lessons": [f"Lesson for {pid}: read all options.",
                                   f"Second lesson for {pid}: check the question twice."]})


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    mem = ProceduralMemory(small_config(**{"behavior.num_clusters": 3, "behavior.top_k": 2}))
    gen = Scripted(reflection=_reflection, behaviors=_behaviors)
    for step in range(3):
        mem.update(step, recs(step, PROBLEMS, [1.0, 0.0] if step != 1 else [0.0, 0.0]), gen)
    path = tmp_path_factory.mktemp("mem") / "memory.jsonl"
    mem.export_jsonl(str(path))
    return mem, path


def _vectors(mem, pids):
    emb = shared_embedder(mem.config.embedder)
    texts = [sanitize_text(PROBLEMS[p][:MAX_PROBLEM_CHARS], 4000, mem.extra_tokens)
             for p in pids]
    return dict(zip(pids, emb.embed(texts, query=True), strict=True))


def test_export_read_back_is_what_the_memory_shows(memory):
    mem, path = memory
    pm = load_memory_file(path.parent)  # a run folder works too
    gz = path.parent / "memory.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert load_memory_file(gz) == pm.__class__(**{**pm.__dict__, "source": str(gz)})
    assert pm.bad_rows == 0 and not pm.keys_rebuilt
    assert len(pm.behaviors) == len(mem.behaviors.behaviors) >= 6
    vectors = _vectors(mem, sorted(PROBLEMS))
    for pid, vec in vectors.items():  # the memory's problem index holds the same vectors
        np.testing.assert_allclose(vec, mem.problems.vector(pid), atol=1e-5)
    ret = A.Retrieval(pm, vectors, mem.config.index, mem.config.behavior.top_k)
    for pid in PROBLEMS:
        ctx = mem.teacher_context(pid, PROBLEMS[pid])
        got = pm.insights[pid]
        assert [t for s, t in got if s == "strategies"] == ctx.strategies
        assert [t for s, t in got if s == "lessons"] == ctx.lessons
        assert ret.behaviors_for(vectors[pid]) == ctx.behaviors
        assert pm.successes[pid] == mem.experience.remembered_success(pid, None).response_text
    # topic retrieval is real: a code problem gets code behaviors
    assert all("code" in n for n, _ in ret.behaviors_for(vectors["code0"]))


def test_older_export_rebuilds_keys_and_bad_rows_are_counted(memory, tmp_path):
    mem, path = memory
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        r.pop("key_vector", None)
    old = tmp_path / "memory.jsonl"
    old.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n"
                   + json.dumps({"level": "insight", "kind": "opinion", "problem_id": "x",
                                 "text": "t"}) + "\n")
    pm = load_memory_file(old)
    assert pm.keys_rebuilt and pm.bad_rows == 2
    assert pm.summary()["behavior_keys"] == "rebuilt from cluster members"
    vectors = _vectors(mem, sorted(PROBLEMS))
    ret = A.Retrieval(pm, vectors, mem.config.index, 2)
    # rebuilt from the clusters' members: still the problem's own topic
    assert all("code" in n for n, _ in ret.behaviors_for(vectors["code1"]))


def test_missing_or_empty_memory_files_are_named(tmp_path):
    with pytest.raises(MemoryFileError, match="no memory file at"):
        load_memory_file(tmp_path / "nope.jsonl")
    empty = tmp_path / "memory.jsonl"
    empty.write_text("{oops\n")
    with pytest.raises(MemoryFileError, match="holds no memory item .1 malformed"):
        load_memory_file(empty)


def test_matched_items_count_per_section_and_closest_length():
    own = [("strategies", "x" * 10), ("lessons", "y" * 20), ("lessons", "z" * 20)]
    pool = {
        "a": [("strategies", "s" * 100), ("lessons", "l" * 100), ("lessons", "l" * 100)],
        "b": [("strategies", "s" * 12), ("lessons", "l" * 18), ("lessons", "l" * 25),
              ("lessons", "extra")],
        "c": [("strategies", "s" * 10), ("lessons", "l" * 50)],  # one lesson short
        "own": own,
    }
    got = A.matched_items(own, pool, {"own"}, ["a", "b", "c", "own"])
    assert got == [("strategies", "s" * 12), ("lessons", "l" * 18), ("lessons", "l" * 25)]
    assert A.matched_items(own, pool, {"own", "b"}, ["a", "b", "c"]) == pool["a"]
    assert A.matched_items(own, {"c": pool["c"]}, set(), ["c"]) is None


def test_arms_differ_in_one_thing(memory):
    mem, path = memory
    pm = load_memory_file(path)
    vectors = _vectors(mem, sorted(PROBLEMS))
    ret = A.Retrieval(pm, vectors, mem.config.index, 2)
    pids = ["bio0", "code1", "phys2"]
    rng = np.random.default_rng(0)
    arms = A.check_arms("train", A.TRAIN_ARMS)
    atts, diag = A.build_attempts("train", arms, pids, pm, ret, vectors,
                                  lambda p: "planted" if p != "code1" else None, rng)
    for i, pid in enumerate(pids):
        own, other = atts["own_insights"][i], atts["other_insights"][i]
        assert own.items == tuple(pm.insights[pid])
        assert [s for s, _ in other.items] == [s for s, _ in own.items]
        assert all(pid not in t for _, t in other.items)  # another problem's text
        ob, xb = atts["own_behaviors"][i], atts["other_behaviors"][i]
        assert len(ob.items) == len(xb.items) == 2
        assert atts["own_success"][i].successful_attempt == pm.successes[pid]
        assert atts["own_success"][i].items == ()
        assert atts["none"][i] == A.NONE
    assert atts["planted"][1] is None and atts["planted"][0].items == (("strategies",
                                                                         "planted"),)
    assert 0.0 <= diag["behavior_overlap_mean"] <= 1.0
    with pytest.raises(ValueError, match="unknown train arm"):
        A.check_arms("train", ["nearest_insights"])
    held, _ = A.build_attempts("heldout", A.check_arms("heldout", A.HELDOUT_ARMS), ["code3"],
                               pm, A.Retrieval(pm, {p: v for p, v in vectors.items()
                                                    if p != "code3"}, mem.config.index, 2),
                               vectors, lambda p: None, np.random.default_rng(1))
    near = held["nearest_insights"][0]
    assert near is not None and all("code" in t for _, t in near.items)  # nearest: code
    rnd = held["random_insights"][0]
    assert [s for s, _ in rnd.items] == [s for s, _ in near.items]
    assert held["planted"][0] is None


def test_planted_item_is_the_gold():
    from pmd_jax.tasks.base import Problem

    mcq = Problem(id="q", question="?", gold="B",
                  meta={"options": ["x", "water", "y"], "gold_index": 1, "gold_text": "water"})
    assert A.planted_item(object(), mcq) == 'The correct option is "water".'
    assert A.planted_item(object(), Problem(id="m", question="?", gold="4", meta={})) is None
