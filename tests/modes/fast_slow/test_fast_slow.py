"""mode=fast_slow (pmd_jax/modes/fast_slow, issue 18 item 1): the context in the rollout, update and
deployed-evaluation prompts (and not in grpo's), the Pareto front, the seeded draw, the pool's
state round trip, the config, and one short run of the real entry point."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest

from pmd_jax.config.sections import RolloutConfig, RunConfig
from pmd_jax.loop.rollout import ProblemStream, StepBatch
from pmd_jax.modes import ModeRuntime
from pmd_jax.modes.fast_slow import pareto_front
from pmd_jax.modes.fast_slow import pool as fsp
from pmd_jax.modes.fast_slow.config import FastSlowConfig
from pmd_jax.modes.fast_slow.contexts import render_memory, with_context
from pmd_jax.modes.fast_slow.mode import FastSlowRuntime
from pmd_jax.sampling.base import Rollout, Rollouts, SamplingParams, TextGenerator
from tests.fakes import CharTokenizer, FakeModel, FakeSampler
from tests.tiny_runs import embedded_default, mode_knob_errors

ROOT = Path(__file__).resolve().parents[3]


# ----------------------------------------------------------------------------- fakes
class FakeTask:
    name = "fake"

    def prompt(self, p) -> list[dict[str, str]]:
        return [{"role": "system", "content": "You answer."}, {"role": "user", "content": p.text}]

    def verify_batch(self, problems, texts, split):
        return [types.SimpleNamespace(reward=1.0 if "RIGHT" in t else 0.0, feedback="fb")
                for t in texts]


class ScriptedSampler(FakeSampler):
    """Replies by what the prompt holds: a rewrite request gets ``rewrite``; a validation
    prompt gets "RIGHT" iff it holds a context listed in ``right`` for that problem."""

    def __init__(self, rewrite: str, right: dict[str, set[str]]) -> None:
        super().__init__()
        self.rewrite, self.right = rewrite, right
        self.prompts: list[list[str]] = []

    def generate(self, prompts, params: SamplingParams, *, progress=None) -> Rollouts:
        self.params.append(params)
        texts = [FakeModel().decode(p) for p in prompts]
        self.prompts.append(texts)
        items = []
        for i, text in enumerate(texts):
            for s in range(params.n):
                if "Current guidance:" in text:
                    reply = self.rewrite
                else:
                    ok = any(c in text for pid, cs in self.right.items() if pid in text
                             for c in cs)
                    reply = "RIGHT" if ok else "no"
                toks = np.asarray(CharTokenizer().encode(reply), np.int32)
                items.append(Rollout(i, s, toks, np.zeros(len(toks), np.float32), "stop"))
        return Rollouts(items)


def _problems(n: int) -> list[types.SimpleNamespace]:
    return [types.SimpleNamespace(id=f"p{i}", text=f"problem p{i}?") for i in range(n)]


def _cfg(mode: str = "fast_slow", **fs) -> RunConfig:
    return RunConfig().replace(
        mode=mode, seed=3,
        rollout=RolloutConfig(n=2, problems_per_step=3, max_prompt_tokens=400, max_tokens=8),
        fast_slow=FastSlowConfig(**{"val_size": 2, "max_context_tokens": 120, **fs}))


def _pool(cfg: RunConfig, texts: list[str]) -> fsp.ContextPool:
    pool = fsp.ContextPool(cfg, FakeModel(), FakeTask(), _problems(2))
    pool.candidates = [fsp.Candidate(i, t, "seed", -1) for i, t in enumerate(texts)]
    pool.next_id = len(texts)
    return pool


CONTEXTS = ["CTX-ALPHA check units", "CTX-BETA read twice", "CTX-GAMMA eliminate options"]


# ----------------------------------------------------------------------------- prompts
def _rollout_and_update(mode: str):
    """The rollout phase's own draw (rollout prompts) and teaching.build_train_batch
    (update)."""
    from pmd_jax.loop import teaching
    from pmd_jax.loop.rollout import RolloutPhase

    cfg = _cfg(mode)
    pool = _pool(cfg, CONTEXTS) if mode == "fast_slow" else None
    rt = FastSlowRuntime(pool) if pool is not None else ModeRuntime()
    phase = RolloutPhase(cfg, FakeModel(), FakeTask(), None, ProblemStream(_problems(6), seed=0),
                         rt.student_messages)
    drawn = phase.draw(5)
    g = cfg.rollout.n
    rollouts = Rollouts([Rollout(i, s, np.asarray([65 + s], np.int32),
                                 np.zeros(1, np.float32), "stop")
                         for i in range(len(drawn.problems)) for s in range(g)])
    sb = StepBatch(drawn.problems, drawn.prompts, rollouts, ["A", "B"] * len(drawn.problems),
                   np.zeros((len(drawn.problems), g)), [], step=5, messages=drawn.messages)
    batch, _ = teaching.build_train_batch(cfg, FakeModel(), FakeTask(), None, sb)
    return pool, drawn, batch


def test_rollout_update_and_deployed_prompts_carry_the_drawn_context_grpo_none():
    from pmd_jax.loop.evaluate import make_generate_fn

    pool, drawn, batch = _rollout_and_update("fast_slow")
    _, g_drawn, g_batch = _rollout_and_update("grpo")
    dec = FakeModel().decode
    assert [p.id for p in drawn.problems] == [p.id for p in g_drawn.problems]  # same problems
    used = set()
    for i, prompt in enumerate(drawn.prompts):
        text = pool.candidates[pool.draws[5][i]].text
        used.add(text)
        assert text in dec(prompt)  # the rollout's prompt
        assert dec(prompt).startswith("You answer.\n\nGuidance:\n" + text)
        for s in range(2):  # the update's student prompt: the same tokens
            row = batch["student_tokens"][2 * i + s]
            assert dec(row[: len(prompt)].tolist()) == dec(prompt)
    for i, prompt in enumerate(g_drawn.prompts):
        assert not any(c in dec(prompt) for c in CONTEXTS)
        assert not any(c in dec(g_batch["student_tokens"][2 * i].tolist()) for c in CONTEXTS)
    assert len(used) >= 2  # the draws differ between problems (seeded, see below)
    # the deployed evaluation: the pool's best context in the prompt; memory-free without it
    pool.candidates[1].scores, pool.candidates[0].scores = [1.0, 1.0], [0.0, 1.0]
    best = FastSlowRuntime(pool).eval_context()
    assert best == CONTEXTS[1]
    sampler = types.SimpleNamespace(seen=[])

    def generate(prompts, params, *, progress=None):
        sampler.seen.extend(dec(p) for p in prompts)
        return Rollouts([Rollout(i, 0, np.asarray([66], np.int32), np.zeros(1, np.float32),
                                 "stop") for i in range(len(prompts))])

    sampler.generate = generate
    for ctx in (best, None):
        sampler.seen.clear()
        make_generate_fn(_cfg(), FakeModel(), TextGenerator(sampler, None, dec), context=ctx)(
            [FakeTask().prompt(p) for p in _problems(2)], 1, 0)
        assert len(sampler.seen) == 2
        assert all((CONTEXTS[1] in t) == (ctx is not None) for t in sampler.seen)


def test_with_context_appends_to_the_system_message_or_adds_one():
    msgs = [{"role": "user", "content": "q"}]
    assert with_context(msgs, "C") == [{"role": "system", "content": "Guidance:\nC"}, *msgs]
    assert with_context(msgs, "") == msgs
    out = with_context(FakeTask().prompt(_problems(1)[0]), "C")
    assert out[0]["content"] == "You answer.\n\nGuidance:\nC" and out[1]["content"] == \
        "problem p0?"


# ----------------------------------------------------------------------------- Pareto front
def test_pareto_front_drops_the_dominated_keeps_the_rest():
    # c1 >= c0 everywhere and better once: c0 dropped; c2 best on problem 2: kept
    keep, front = pareto_front([[1, 0, 0], [1, 1, 0], [0, 0, 1]], cap=4)
    assert keep == [1, 2] and front == 2
    # a candidate dominated on every problem (strictly) goes; incomparable ones stay
    keep, _ = pareto_front([[0.5, 0.5], [1.0, 0.0], [0.0, 1.0], [0.2, 0.2]], cap=4)
    assert keep == [0, 1, 2]


def test_pareto_front_ties_and_cap():
    # identical scores: the first (the older pool member) is kept, the copy dropped
    keep, front = pareto_front([[1, 0], [1, 0], [0, 1]], cap=4)
    assert keep == [0, 2] and front == 2
    # equal on one problem, better on another: dominated
    assert pareto_front([[1, 1], [1, 0]], cap=4)[0] == [0]
    # 4 incomparable candidates, cap 2: most problems won first, then mean, then older
    scores = [[1, 0, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1], [0.5, 0.5, 0.5, 0.5]]
    keep, front = pareto_front(scores, cap=2)
    # c1 wins 2 problems; c0 and c2 win 1 (mean .25 each: the older c0); c3 wins none
    assert front == 4 and keep == [0, 1]
    keep, _ = pareto_front([[1, 0], [0, 1], [0.6, 0.6]], cap=1)
    assert keep == [0]  # c0 and c1 win 1 problem (same mean: the older), c2 none
    keep, _ = pareto_front([[1, 0, 0], [0, 1, 0.5], [0.6, 0.6, 0.6]], cap=2)
    assert keep == [1, 2]  # each wins one problem: the higher means, c2 (.6) and c1 (.5)
    with pytest.raises(ValueError):
        pareto_front([[1.0]], cap=0)


# ----------------------------------------------------------------------------- draw, state
def test_draw_is_seeded_and_the_pool_survives_a_state_dict_round_trip():
    a, b = _pool(_cfg(), CONTEXTS), _pool(_cfg(), CONTEXTS)
    da = [a.draw(s, i).cid for s in range(4) for i in range(5)]
    assert da == [b.draw(s, i).cid for s in range(4) for i in range(5)]
    assert len(set(da)) == 3
    other = _pool(RunConfig().replace(mode="fast_slow", seed=4,
                                      fast_slow=FastSlowConfig(val_size=2)), CONTEXTS)
    assert da != [other.draw(s, i).cid for s in range(4) for i in range(5)]
    a.candidates[0].scores = [0.0, 1.0]
    import pickle

    state = pickle.loads(pickle.dumps(a.state_dict()))  # as the checkpoint slot stores it
    c = fsp.ContextPool(_cfg(), FakeModel(), FakeTask(), _problems(2))
    c.load_state_dict(state)
    assert c.state_dict() == a.state_dict()
    assert [x.text for x in c.candidates] == CONTEXTS and c.candidates[0].scores == [0.0, 1.0]
    assert [c.draw(9, i).cid for i in range(5)] == [a.draw(9, i).cid for i in range(5)]
    d = fsp.ContextPool(_cfg(), FakeModel(), FakeTask(), _problems(3)[1:])
    with pytest.raises(ValueError, match="validation problems differ"):
        d.load_state_dict(state)


# ----------------------------------------------------------------------------- update
def _memory():
    ins = {f"i{k}": types.SimpleNamespace(docid=f"i{k}", kind=kind, text=text, last_step=2,
                                          support=1)
           for k, (kind, text) in enumerate([("strategy", "MEM-STRAT use the passage"),
                                             ("lesson", "MEM-LESSON do not guess")])}
    beh = {"b0": types.SimpleNamespace(name="MEM-BEHAV", instruction="eliminate options",
                                       created_step=1)}
    lv = types.SimpleNamespace(enabled=True)
    return types.SimpleNamespace(
        extra_tokens=(), level=lambda name: lv,
        insights=types.SimpleNamespace(items=ins), behaviors=types.SimpleNamespace(behaviors=beh))


def test_render_memory_holds_the_insight_and_behavior_levels():
    text = render_memory(_memory(), np.random.default_rng(0), 8, len, 400)
    for s in ("MEM-STRAT", "MEM-LESSON", "MEM-BEHAV: eliminate options", "Mistakes to avoid"):
        assert s in text
    assert len(render_memory(_memory(), np.random.default_rng(0), 8, len, 40)) <= 40


def test_update_scores_new_candidates_and_keeps_the_front():
    cfg = _cfg(pool_size=2)
    pool = fsp.ContextPool(cfg, FakeModel(), FakeTask(), _problems(2))
    seed = pool.candidates[0].text
    # p0 is solved with the memory's rendering, p1 with the rewrite; the seed solves none
    sampler = ScriptedSampler("REWRITE-CTX think first", {"p0": {"MEM-"}, "p1": {"REWRITE"}})
    tg = TextGenerator(sampler, FakeModel().encode_chat, FakeModel().decode)
    probs = _problems(2)
    for i in range(2):
        pool.draw(0, i)
    rollouts = Rollouts([Rollout(i, s, np.asarray([65], np.int32), np.zeros(1, np.float32),
                                 "stop") for i in range(2) for s in range(2)])
    sb = StepBatch(probs, [[1]] * 2, rollouts, ["RIGHT", "no", "no", "no"],
                   np.array([[1.0, 0.0], [0.0, 0.0]]),
                   FakeTask().verify_batch(probs, ["RIGHT", "no", "no", "no"], "train"), step=0,
                   messages=[FakeTask().prompt(p) for p in probs])
    st = pool.update(0, sb, _memory(), tg)
    assert set(st) == set(fsp.STAT_KEYS)
    assert st["fast_slow_candidates"] == 2 and st["fast_slow_candidates_scored"] == 3
    assert st["fast_slow_front_size"] == 2 and st["fast_slow_pool_size"] == 2
    assert [c.source for c in pool.candidates] == ["memory", "rewrite"]
    assert seed not in [c.text for c in pool.candidates]  # dominated on every problem
    assert pool.candidates[0].scores == [1.0, 0.0] and pool.candidates[1].scores == [0.0, 1.0]
    assert st["fast_slow_best_val_reward"] == 0.5
    assert st["fast_slow_rewrite_tokens"] == len("REWRITE-CTX think first")
    assert st["fast_slow_val_tokens"] == 3 * 2 * len("no") - 2 * (len("no") - len("RIGHT"))
    assert st["fast_slow_generated_tokens"] == (st["fast_slow_rewrite_tokens"]
                                                + st["fast_slow_val_tokens"])
    rewrite_prompt = sampler.prompts[0][0]
    assert seed in rewrite_prompt and "problem p0?" in rewrite_prompt and "Reward: 1" in \
        rewrite_prompt and "Feedback: fb" in rewrite_prompt
    assert st["fast_slow_rewrite_too_long"] == 0
    # a rewrite prompt past the sampler's context: fewer attempts, then skipped and counted
    small = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_context=400))
    pool3 = fsp.ContextPool(small, FakeModel(), FakeTask(), _problems(2))
    st3 = pool3.update(0, sb, _memory(), tg)
    assert st3["fast_slow_rewrite_too_long"] == 1 and st3["fast_slow_rewrite_tokens"] == 0
    assert st3["fast_slow_candidates"] == 1  # the memory's rendering alone
    # update_every=2: the step after does not change the pool
    pool2 = fsp.ContextPool(_cfg(update_every=2), FakeModel(), FakeTask(), _problems(2))
    st2 = pool2.update(0, sb, _memory(), tg)
    assert st2["fast_slow_updated"] == 0 and st2["fast_slow_candidates"] == 0


def test_validation_problems_skip_evaluation_problems_and_are_held_out():
    cfg = _cfg(val_size=3)
    train = _problems(8)
    ev = [types.SimpleNamespace(id="e", text=train[0].text)]
    val = fsp.validation_problems(cfg, FakeModel(), FakeTask(), train, ev)
    assert len(val) == 3 and train[0] not in val
    pool = fsp.ContextPool(cfg, FakeModel(), FakeTask(), val)
    items = FastSlowRuntime(pool).train_items(train)
    assert len(items) == 5 and not set(map(id, items)) & set(map(id, val))
    assert ModeRuntime().train_items(train) is train  # every other mode
    with pytest.raises(ValueError, match="fast_slow.val_size=9"):
        fsp.validation_problems(_cfg(val_size=9), FakeModel(), FakeTask(), train, ev)


# ----------------------------------------------------------------------------- config
def test_mode_fast_slow_validates_with_the_embedded_default(tmp_path):
    from pmd_jax.config import MEMORY_MODES, MODES, apply_mode, freeze
    from pmd_jax.config.validate import config_errors

    assert "fast_slow" in MODES and "fast_slow" in MEMORY_MODES
    c = embedded_default()
    c.mode, c.run_dir = "fast_slow", str(tmp_path / "run")
    apply_mode(c)
    assert c.distill.loss.name == "grpo"
    assert config_errors(c) == []
    f = freeze(c)
    assert f.mode == "fast_slow" and f.fast_slow == FastSlowConfig()


@pytest.mark.parametrize("key,value,match", [
    ("pool_size", 0, "fast_slow.pool_size"),
    ("val_size", -1, "fast_slow.val_size"),
    ("update_every", 0, "fast_slow.update_every"),
    ("rewrite_candidates", -1, "fast_slow.rewrite_candidates"),
    ("seed_context", " ", "fast_slow.seed_context"),
    ("rewrite.top_p", 0.0, "fast_slow.rewrite.top_p"),
    ("max_context_tokens", 384, "fast_slow.max_context_tokens=384 must be below"),
    ("val_max_tokens", 100, "fast_slow.val_max_tokens=100 exceeds"),
])
def test_bad_fast_slow_knobs_fail_naming_the_knob(tmp_path, key, value, match):
    errs = mode_knob_errors(tmp_path, "fast_slow", key, value)
    assert len(errs) == 1 and match in errs[0], errs


def test_no_candidates_and_no_groups_fail(tmp_path):
    from pmd_jax.config import apply_mode
    from pmd_jax.config.validate import config_errors

    c = embedded_default()
    c.mode, c.run_dir = "fast_slow", str(tmp_path / "run")
    c.fast_slow.memory_candidates = c.fast_slow.rewrite_candidates = 0
    c.rollout.n = 1
    apply_mode(c)
    errs = config_errors(c)
    assert any("memory_candidates + fast_slow.rewrite_candidates" in e for e in errs)
    assert any("mode=fast_slow with rollout.n=1" in e for e in errs)


def test_fast_slow_is_single_process(tmp_path, monkeypatch):
    from pmd_jax.config import apply_mode
    from pmd_jax.config.validate import config_errors

    monkeypatch.setenv("PMD_COORDINATOR", "10.0.0.1:1234")
    monkeypatch.setenv("PMD_NUM_PROCESSES", "2")
    c = embedded_default()
    c.mode, c.run_dir = "fast_slow", str(tmp_path / "run")
    apply_mode(c)
    assert any("mode=fast_slow runs in a single JAX process only" in e
               for e in config_errors(c))


def test_config_listing_shows_the_fast_slow_knobs(capsys):
    from pmd_jax.config.__main__ import main

    assert main(["x", "fast_slow"]) == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(FastSlowConfig):
        assert f"fast_slow.{f.name}" in out


# ----------------------------------------------------------------------------- end to end
FS_FLAGS = ["--config.mode=fast_slow", "--config.train.steps=1",
            "--config.train.eval_every=1", "--config.fast_slow.val_size=2",
            "--config.fast_slow.max_context_tokens=48", "--config.fast_slow.pool_size=2",
            "--config.fast_slow.rewrite.max_tokens=24", "--config.fast_slow.rewrite_rollouts=2"]


def _records(run_dir: Path, kind: str) -> list[dict]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return [r.get("values", r) for r in recs if r["kind"] == kind]


def _run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    from tests.tiny_runs import cmd, env

    p = subprocess.run(cmd(run_dir, *FS_FLAGS, *extra), cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def _check_step(r: dict) -> None:
    for k in fsp.STAT_KEYS:
        assert k in r, k
    assert r["fast_slow_updated"] == 1 and r["fast_slow_candidates_scored"] >= 1
    assert 1 <= r["fast_slow_pool_size"] <= 2
    assert r["fast_slow_val_tokens"] > 0 and r["fast_slow_rewrite_tokens"] > 0


def test_one_step_fast_slow_run_logs_the_pool_and_the_deployed_accuracy(tmp_path):
    """The real entry point (python -m pmd_jax.main) on the tiny random model: one step with a
    pool update (a rewrite by the policy, validation scoring of the seed and the new context), a
    checkpoint holding the pool, the evaluation with and without the deployed context."""
    run_dir = tmp_path / "fast_slow"
    _run(run_dir)
    (r,) = _records(run_dir, "train")
    _check_step(r)
    # a fresh pool's seed context is scored with the new candidates
    assert r["fast_slow_candidates_scored"] == (r["fast_slow_candidates"]
                                                - r["fast_slow_duplicates"] + 1)
    ev = _records(run_dir, "eval")
    assert ev and "accuracy_deployed" in ev[-1] and "accuracy" in ev[-1]
    assert (run_dir / "eval" / "step_000001" / "deployed_context.txt").read_text().strip()
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["mode"] == "fast_slow" and cfg["distill"]["loss"]["name"] == "grpo"
    assert list((run_dir / "checkpoints").glob("*/mode_state"))  # the pool


@pytest.mark.slow  # ~60 s for 2 steps + ~35 s for the resumed third, on 2 loaded cores
def test_a_resumed_fast_slow_run_continues_with_the_checkpoints_pool(tmp_path):
    """Two steps, then the same run resumed for a third: the third step's update scores only
    its new candidates (the restored pool kept its scores; a fresh pool's seed would be scored
    again), and both runs log the pool and the deployed accuracy."""
    run_dir = tmp_path / "fast_slow"
    _run(run_dir, "--config.train.steps=2", "--config.train.eval_every=2")
    assert [_check_step(r) for r in _records(run_dir, "train")] == [None, None]
    p = _run(run_dir, "--config.train.steps=3", "--config.train.eval_every=3")
    assert "resumed from checkpoint at step 2" in p.stderr
    r = [x for x in _records(run_dir, "train") if x.get("step", 2) == 2][-1]
    _check_step(r)
    assert r["fast_slow_candidates_scored"] == (r["fast_slow_candidates"]
                                                - r["fast_slow_duplicates"])
    assert "accuracy_deployed" in _records(run_dir, "eval")[-1]


def test_the_run_checkpoint_stores_and_restores_the_pool(tmp_path):
    """The trainer's checkpoint (RunCheckpointer) keeps the mode runtime's state (its
    mode_state slot; fast_slow: the pool): the pool saved with a step comes back with it (a
    resumed run continues with the same pool); other modes save none."""
    import jax
    import jax.numpy as jnp

    from pmd_jax.run.checkpoint import RunCheckpointer

    pool = _pool(_cfg(), CONTEXTS)
    pool.candidates[2].scores = [1.0, 0.5]
    pool.draw(4, 0)
    bundle = types.SimpleNamespace(
        state={"w": jnp.arange(3, dtype=jnp.float32)},
        step_fn=types.SimpleNamespace(abstract_state=lambda: {
            "w": jax.ShapeDtypeStruct((3,), jnp.float32,
                                      sharding=jax.sharding.SingleDeviceSharding(
                                          jax.devices()[0]))}))
    extras = {"data_cursor": {"epoch": 0, "position": 2}, "memory": None, "prefetch": None}
    ck = RunCheckpointer(tmp_path / "a", keep=2)
    ck.save(5, bundle, {**extras, "mode_state": FastSlowRuntime(pool).state_dict()})
    ck.wait()
    _, got = RunCheckpointer(tmp_path / "a", keep=2).restore_latest(bundle)
    back = fsp.ContextPool(_cfg(), FakeModel(), FakeTask(), _problems(2))
    FastSlowRuntime(back).load_state_dict(got["mode_state"])
    assert back.state_dict() == pool.state_dict() and back.draws == {4: {0: pool.draws[4][0]}}
    ck = RunCheckpointer(tmp_path / "b", keep=2)
    ck.save(5, bundle, {**extras, "mode_state": ModeRuntime().state_dict()})
    ck.wait()
    assert RunCheckpointer(tmp_path / "b", keep=2).restore_latest(bundle)[1]["mode_state"] is None
