"""The episode road (pmd_jax/episode.py): one constructor of SamplingParams, one seed recipe,
generate -> decode with the response prefix -> verify -> counts, and the contract that no
other code of the package builds a SamplingParams or imports upward from it."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import numpy as np
import pytest

from pmd_jax import episode
from pmd_jax.sampling.seeds import derive_seed
from tests.fakes import FakeModel, FakeSampler

PKG = Path(episode.__file__).resolve().parent


class PrefixTask:
    """Problems are ``(id, answer)``; a response is right when it contains the answer; every
    problem's response starts with ``"<" + id + ">"``."""

    def __init__(self) -> None:
        self.graded: list[tuple[list, list, str]] = []

    def response_prefix(self, problem) -> str:
        return f"<{problem.id}>"

    def verify_batch(self, problems, texts, split):
        self.graded.append((list(problems), list(texts), split))
        return [types.SimpleNamespace(reward=float(p.answer in t), ok=True)
                for p, t in zip(problems, texts, strict=True)]


def _problem(pid: str, answer: str):
    return types.SimpleNamespace(id=pid, answer=answer)


def test_sampling_params_reads_the_section_and_derives_the_seed():
    sec = types.SimpleNamespace(temperature=0.7, top_p=0.9, top_k=5, max_tokens=33)
    sp = episode.sampling_params(sec, n=3, stop_token_ids=[2, 7], purpose="verify",
                                 seed_parts=(1, 2, 3))
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.max_tokens) == (3, 0.7, 0.9, 5, 33)
    assert sp.stop_token_ids == (2, 7) and sp.json_schema is None
    assert sp.seed == derive_seed("verify", 1, 2, 3) != derive_seed("verify", 1, 2, 4)
    # overrides win (0.0 too: only None falls back), a section without top_k samples with 0
    ev = types.SimpleNamespace(temperature=0.6, top_p=1.0, max_tokens=8)
    sp = episode.sampling_params(ev, n=1, stop_token_ids=(), purpose="eval", seed_parts=(4,),
                                 temperature=0.0, max_tokens=None)
    assert (sp.temperature, sp.top_k, sp.max_tokens) == (0.0, 0, 8)
    with pytest.raises(TypeError, match="unknown override"):
        episode.sampling_params(ev, n=1, stop_token_ids=(), purpose="eval", seed_parts=(4,),
                                seed=3)


def test_rollout_params_follow_the_rollout_section_and_the_run_seed():
    cfg = types.SimpleNamespace(seed=11, rollout=types.SimpleNamespace(
        temperature=1.0, top_p=0.95, top_k=0, max_tokens=64))
    model = types.SimpleNamespace(stop_token_ids=[0])
    sp = episode.rollout_params(cfg, model, 4, "rollout", 9)
    assert sp.seed == derive_seed("rollout", 11, 9) and sp.n == 4 and sp.max_tokens == 64
    assert episode.rollout_params(cfg, model, 4, "rollout", 9, max_tokens=5).max_tokens == 5


def test_attempt_generates_decodes_with_the_prefix_verifies_and_counts():
    task, sampler, model = PrefixTask(), FakeSampler(), FakeModel()
    probs = [_problem("a", "<a"), _problem("b", "zz")]
    prompts = [model.encode_prompt([{"role": "user", "content": "q1"}], "<a>"),
               model.encode_prompt([{"role": "user", "content": "question2"}], "<b>")]
    sp = episode.sampling_params(types.SimpleNamespace(temperature=1.0, top_p=1.0,
                                                       max_tokens=4),
                                 n=3, stop_token_ids=(), purpose="probe.x", seed_parts=(0,))
    att = episode.attempt(sampler, model, task, probs, prompts, sp, split="hidden")
    assert sampler.params == [sp]
    # FakeSampler answers prompt[:2] + [sample index]; the text starts with the prefix
    assert att.texts[0] == "<a>" + "q1" + chr(0) and att.texts[3].startswith("<b>qu")
    (graded_probs, graded_texts, split), = task.graded
    assert split == "hidden" and graded_texts == att.texts
    assert [p.id for p in graded_probs] == ["a"] * 3 + ["b"] * 3
    assert att.solved(0.5) == [True] * 3 + [False] * 3
    assert att.sequences == 6 and att.generated_tokens == 18
    assert att.prompt_tokens == sum(len(p) for p in prompts)
    grid = att.grid(2, 3, att.solved(0.5), bool)
    np.testing.assert_array_equal(grid, [[True] * 3, [False] * 3])
    # explicit prefixes are used as given; no prompts: no generate call
    att2 = episode.attempt(sampler, model, task, probs[:1], prompts[:1], sp, prefixes=["#"])
    assert att2.texts[0].startswith("#q1")
    empty = episode.attempt(sampler, model, task, [], [], sp)
    assert empty.sequences == 0 and len(sampler.params) == 2
    with pytest.raises(ValueError, match="2 problems but 1 prompts"):
        episode.attempt(sampler, model, task, probs, prompts[:1], sp)


def _calls_named(tree: ast.AST, name: str) -> list[int]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            called = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
            if called == name:
                out.append(node.lineno)
    return out


def test_no_other_code_builds_sampling_params():
    """The road's constructor is the only place a SamplingParams is made (sampling/ defines
    the class and may copy one, e.g. ``dataclasses.replace``, but builds none)."""
    found = {}
    for f in sorted(PKG.rglob("*.py")):
        if f == Path(episode.__file__).resolve():
            continue
        lines = _calls_named(ast.parse(f.read_text()), "SamplingParams")
        if lines:
            found[str(f.relative_to(PKG))] = lines
    assert not found, f"SamplingParams built outside pmd_jax/episode.py: {found}"


def test_the_road_sits_below_the_loop_the_modes_and_evaluation():
    tree = ast.parse(Path(episode.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    ours = {m for m in imported if m and m.startswith("pmd_jax")}
    assert ours <= {"pmd_jax.sampling.base", "pmd_jax.sampling.seeds"}, ours
