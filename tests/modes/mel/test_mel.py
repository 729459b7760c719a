"""mode=mel (Meta-Experience Learning, pmd_jax/modes/mel): the lesson NLL against HF torch, the
replay filter and the reflection parsing on a scripted sampler, the loss identities, the
config, and a 2-step run of the real entry point."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from pmd_jax.config.sections import RolloutConfig, RunConfig, TeacherPromptConfig
from pmd_jax.distill import align
from pmd_jax.distill import batch as dbatch
from pmd_jax.distill import step as st
from pmd_jax.models import decoder
from pmd_jax.modes.mel import lessons as mel
from pmd_jax.modes.mel.config import MelConfig
from pmd_jax.sampling.base import Rollout, Rollouts, SamplingParams
from pmd_jax.sampling.seeds import derive_seed
from tests.distill.distill_common import TINY, small_distill_config
from tests.fakes import FakeModel, FakeSampler
from tests.tiny_runs import embedded_default, mode_knob_errors

ROOT = Path(__file__).resolve().parents[3]
GROUP = 2


# ----------------------------------------------------------------------------- train step
def _dcfg(loss: str, **kw):
    return small_distill_config(**{"loss__name": loss, "loss__chunk_size": 5,
                                   "loss__group_size": GROUP, **kw})


def _grpo_batch(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    sp = [r.integers(1, vocab, r.integers(2, 6)) for _ in range(4)]
    rs = [r.integers(1, vocab, r.integers(2, 7)) for _ in range(4)]
    db = align.build_distill_batch(sp, sp, rs, pad_id=0)
    return dbatch.make_batch(db, sampler_logp=np.full(db.responses.shape, -3.5, np.float32),
                             rewards=np.array([1.0, 0.0, 0.0, 1.0], np.float32))


def _lessons(vocab: int, seed: int = 1):
    r = np.random.default_rng(seed)
    prompts = [r.integers(1, vocab, n).tolist() for n in (3, 7, 5)]
    lessons = [r.integers(1, vocab, n).tolist() for n in (6, 2, 9)]
    return prompts, lessons


def _np(tree):
    return jax.tree.map(np.asarray, tree)


def test_lesson_nll_equals_hf_torch():
    """The lesson NLL function the train step differentiates (and whose value it reports as
    mel_lesson_nll: next test) equals a direct torch NLL of the same lesson tokens given the
    same prompts, HF Llama, within 1e-5."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.models.test_models_parity import make_hf

    with jax.default_matmul_precision("highest"):
        model, cfg, params = make_hf("llama")
        prompts, lessons = _lessons(cfg.vocab_size)
        rows = dbatch.make_lesson_rows(prompts, lessons, pad_id=0, rows=4)
        ts = st.TrainStep(cfg, _dcfg("mel"), donate=False)
        nll, m = jax.jit(ts.lesson_nll_fn)(params, rows)
    total, count = 0.0, 0
    with torch.no_grad():
        for p, les in zip(prompts, lessons, strict=True):
            ids = torch.tensor([p + les])
            logp = torch.log_softmax(model(input_ids=ids).logits.double(), dim=-1)[0]
            for t, tok in enumerate(les):
                total -= float(logp[len(p) - 1 + t, tok])
                count += 1
    ref = total / count
    assert abs(float(nll) - ref) < 1e-5, (float(nll), ref)
    assert float(m["mel_lesson_tokens"]) == count and float(m["mel_lesson_rows"]) == len(lessons)


def test_nll_weight_zero_is_grpo_and_no_lessons_give_zero_nll():
    """nll_weight=0: the loss and the update are GRPO's; no kept lessons (filler rows only):
    NLL 0, no NaN, GRPO's update; with lessons and weight 1 the loss is GRPO + NLL. (Gradient
    accumulation with lesson rows: the end-to-end run below uses train.microbatch_rows.)"""
    params = decoder.init_params(TINY, jax.random.PRNGKey(0))
    batch = _grpo_batch(TINY.vocab_size)
    prompts, lessons = _lessons(TINY.vocab_size)
    rows = dbatch.make_lesson_rows(prompts, lessons, pad_id=0, rows=4)
    empty = dbatch.make_lesson_rows([], [], pad_id=0, rows=4)
    assert {k: v.shape for k, v in rows.items()} == {k: v.shape for k, v in empty.items()}
    grpo = st.TrainStep(TINY, _dcfg("grpo"), donate=False)
    s_ref, m_ref = grpo.step(grpo.init(params), batch)
    one = st.TrainStep(TINY, _dcfg("mel"), donate=False, lesson_nll_weight=1.0)
    for weight, lesson_rows in ((0.0, rows), (1.0, empty)):
        ts = one if weight else st.TrainStep(TINY, _dcfg("mel"), donate=False,
                                             lesson_nll_weight=weight)
        s, m = ts.step(ts.init(params), {**batch, **lesson_rows})
        assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["mel_lesson_nll"]))
        assert float(m["loss"]) == float(m_ref["loss"])
        assert float(m["grpo_loss"]) == float(m_ref["loss"])
        if lesson_rows is empty:
            assert float(m["mel_lesson_nll"]) == 0.0 and float(m["mel_lesson_tokens"]) == 0
        else:
            assert float(m["mel_lesson_nll"]) > 0
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                     _np(s.params), _np(s_ref.params))
    # with weight 1 and real lessons the loss is GRPO + NLL (the NLL of the function the
    # step differentiates, checked against HF above), and the update differs
    s, m = one.step(one.init(params), {**batch, **rows})
    nll, _ = jax.jit(one.lesson_nll_fn)(params, rows)
    assert float(m["mel_lesson_nll"]) == pytest.approx(float(nll), rel=1e-6)
    assert float(m["loss"]) == pytest.approx(float(m["grpo_loss"]) + float(m["mel_lesson_nll"]),
                                             rel=1e-6)
    assert not np.allclose(np.asarray(s.params["embed"]), np.asarray(s_ref.params["embed"]))


def test_check_batch_wants_the_lesson_rows():
    batch = _grpo_batch(TINY.vocab_size)
    with pytest.raises(dbatch.BatchError, match="missing.*lesson_tokens"):
        dbatch.check_batch(batch, "mel")
    with pytest.raises(dbatch.BatchError, match="unknown arrays.*lesson"):
        dbatch.check_batch({**batch, **dbatch.make_lesson_rows([], [], pad_id=0, rows=1)},
                           "grpo")
    bad = dbatch.make_lesson_rows([[1, 2]], [[3]], pad_id=0, rows=2)
    bad["lesson_mask"] = bad["lesson_mask"][:, :1]
    with pytest.raises(dbatch.BatchError, match="lesson_mask has shape"):
        dbatch.check_batch({**batch, **bad}, "mel")


# ----------------------------------------------------------------------------- host side
class ScriptedSampler(FakeSampler):
    """FakeSampler whose replies are scripted: reflections (requests with a JSON schema) in
    order, replays by the lesson their prompt holds (``n`` texts each)."""

    def __init__(self, reflections: list[str], replays: dict[str, list[str]]) -> None:
        super().__init__()
        self.reflections = list(reflections)
        self.replays = replays
        self.prompts: list[list[str]] = []

    def generate(self, prompts, params: SamplingParams, *, progress=None) -> Rollouts:
        self.params.append(params)
        texts = [FakeModel().decode(p) for p in prompts]
        self.prompts.append(texts)
        items = []
        for i, text in enumerate(texts):
            if params.json_schema is not None:
                replies = [self.reflections.pop(0)]
            else:
                replies = next(v for k, v in self.replays.items() if k in text)
            assert len(replies) == params.n
            for s, r in enumerate(replies):
                toks = np.asarray(FakeModel().tokenizer.encode(r), np.int32)
                items.append(Rollout(i, s, toks, np.zeros(len(toks), np.float32), "stop"))
        return Rollouts(items)


class FakeTask:
    def prompt(self, p) -> list[dict[str, str]]:
        return [{"role": "user", "content": p.text}]

    def verify_batch(self, problems, texts, split):
        return [types.SimpleNamespace(reward=1.0 if "RIGHT" in t else 0.0, feedback="")
                for t in texts]


def _cfg(max_context: int = 0, **mel_kw) -> RunConfig:
    return RunConfig().replace(
        mode="mel", rollout=RolloutConfig(n=2, max_tokens=32, max_context=max_context),
        teacher_prompt=TeacherPromptConfig(success_threshold=1.0),
        mel=MelConfig(**{"replays": 2, **mel_kw}))


def _sb(rewards: list[list[float]]) -> types.SimpleNamespace:
    b = len(rewards)
    problems = [types.SimpleNamespace(id=i, text=f"problem number {i}") for i in range(b)]
    texts = [f"attempt {j} of problem {i}: the area is twice the side"
             for i in range(b) for j in range(GROUP)]
    return types.SimpleNamespace(problems=problems, rewards=np.asarray(rewards), texts=texts,
                                 step=3, messages=[[{"role": "user", "content": p.text}]
                                                   for p in problems])


def _reflection(lesson: str, quote: str = "is twice the side") -> str:
    return json.dumps({"split_point": quote, "critique": "the area is the square of the side",
                       "lesson": lesson})


LESSON_A = "Square the side length to get the area of a square."
LESSON_B = "Check units before comparing two physical quantities."


def test_replay_filter_keeps_and_drops_as_the_sampler_dictates():
    sampler = ScriptedSampler(
        [_reflection(LESSON_A), _reflection(LESSON_B)],
        {LESSON_A: ["wrong", "RIGHT answer"], LESSON_B: ["wrong", "still wrong"]})
    out = mel.run_step(_cfg(), FakeModel(), FakeTask(), sampler,
                       _sb([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]))
    assert [x.text for x in out.kept] == [LESSON_A]
    assert [(x.problem_index, x.right, x.wrong) for x in out.lessons] == [(0, 0, 1), (1, 1, 0)]
    s = out.stats
    assert set(mel.STAT_KEYS) <= set(s)
    assert (s["mel_problems_mixed"], s["mel_pairs"], s["mel_reflections"]) == (2, 2, 2)
    assert (s["mel_lessons_kept"], s["mel_lessons_dropped"], s["mel_malformed"]) == (1, 1, 0)
    assert (s["mel_replays"], s["mel_replays_correct"]) == (4, 1)
    assert s["mel_replay_tokens"] == sum(len(t) for t in
                                         ("wrong", "RIGHT answer", "wrong", "still wrong"))
    assert s["mel_reflect_tokens"] == len(_reflection(LESSON_A)) + len(_reflection(LESSON_B))
    assert s["mel_generated_tokens"] == s["mel_reflect_tokens"] + s["mel_replay_tokens"]
    refl, replay = sampler.params
    assert json.loads(refl.json_schema)["required"] == ["split_point", "critique", "lesson"]
    # the reflection's seed: the recipe of sampling/seeds.py on (run seed, the knob's, step)
    cfg = _cfg()
    want = derive_seed("mel.reflection", cfg.seed, cfg.mel.reflection.seed, 3)
    assert refl.seed == want and replay.seed == derive_seed("mel.replay", cfg.seed, 3)
    assert replay.n == 2 and replay.json_schema is None
    # the reflection shows the pair; the replay prompt holds the problem and the lesson
    assert "attempt 0 of problem 0" in sampler.prompts[0][0]
    assert "attempt 1 of problem 0" in sampler.prompts[0][0]
    assert sampler.prompts[1][0].startswith("problem number 0") and LESSON_A in \
        sampler.prompts[1][0]
    # the kept lesson's NLL row: the problem's prompt, then the lesson's tokens
    rows = mel.lesson_rows(_cfg(), FakeModel(), FakeTask(), _sb([[1.0, 0.0]] * 2), out.kept, 2)
    assert rows["lesson_tokens"].shape[0] == 2
    n = int(rows["lesson_mask"][0].sum())
    assert "".join(map(chr, rows["lesson_targets"][0, :n])) == LESSON_A
    assert rows["lesson_mask"][1].sum() == 0


def test_malformed_and_unquoted_reflections_are_counted_and_skipped():
    replies = ["not json at all",
               json.dumps({"split_point": "is twice", "critique": "x"}),  # no lesson
               _reflection(LESSON_A, quote="a sentence the wrong attempt never wrote"),
               _reflection("short")]  # lesson below lesson_min_chars: schema error
    for keep_unquoted in (False, True):
        sampler = ScriptedSampler(list(replies), {LESSON_A: ["RIGHT", "RIGHT"]})
        out = mel.run_step(_cfg(keep_unquoted=keep_unquoted), FakeModel(), FakeTask(), sampler,
                           _sb([[1.0, 0.0]] * 4))
        s = out.stats
        assert (s["mel_reflections"], s["mel_malformed"], s["mel_quote_missing"]) == (4, 3, 1)
        assert (s["mel_json_error"], s["mel_schema_error"]) == (1, 2)
        if keep_unquoted:  # replayed, and kept: a replay is right
            assert [x.text for x in out.kept] == [LESSON_A] and s["mel_replays"] == 2
        else:  # dropped without a replay
            assert out.kept == [] and s["mel_replays"] == 0 and len(sampler.params) == 1
            assert s["mel_lessons_dropped"] == 1
        assert s["mel_reflections"] == (s["mel_malformed"] + s["mel_lessons_kept"]
                                         + s["mel_lessons_dropped"])


def test_prompts_past_the_context_are_counted_and_skipped():
    sb = _sb([[1.0, 0.0]])
    sampler = ScriptedSampler([], {})
    out = mel.run_step(_cfg(max_context=700), FakeModel(), FakeTask(), sampler, sb)
    assert out.stats["mel_reflect_too_long"] == 1 and out.stats["mel_reflections"] == 0
    assert sampler.params == []  # nothing generated
    sampler = ScriptedSampler([_reflection(LESSON_A)], {})
    out = mel.run_step(_cfg(max_context=2000, replay_max_tokens=1950), FakeModel(), FakeTask(),
                       sampler, sb)
    s = out.stats
    assert (s["mel_reflections"], s["mel_replay_too_long"], s["mel_replays"]) == (1, 1, 0)
    assert (s["mel_lessons_kept"], s["mel_lessons_dropped"]) == (0, 1)
    assert len(sampler.params) == 1  # the reflection only


def test_pairs_and_caps():
    rewards = np.array([[1, 0, 1, 0], [1, 1, 1, 1], [0, 1, 0, 0]], np.float64)
    pairs, found, mixed = mel.find_pairs(rewards, 1.0, per_problem=0)
    assert (found, mixed) == (4 + 3, 2) and len(pairs) == 7
    assert pairs[:2] == [(0, 0, 1), (0, 2, 3)]
    assert mel.find_pairs(rewards, 1.0, per_problem=1)[0] == [(0, 0, 1), (2, 1, 0)]
    assert mel.find_pairs(rewards, 1.0, per_problem=0, max_pairs=3)[0] == pairs[:3]
    assert mel.quote_in("twice  the\nside", "the area is twice the side")
    assert not mel.quote_in("  ", "anything")


# ----------------------------------------------------------------------------- config
def test_mode_mel_validates_with_the_embedded_default(tmp_path):
    from pmd_jax.config import apply_mode, freeze
    from pmd_jax.config.validate import config_errors

    c = embedded_default()
    c.mode, c.run_dir = "mel", str(tmp_path / "run")
    apply_mode(c)
    assert c.distill.loss.name == "mel"
    assert config_errors(c) == []
    f = freeze(c)
    assert f.mode == "mel" and f.mel == MelConfig()


@pytest.mark.parametrize("key,value,match", [
    ("nll_weight", -1.0, "mel.nll_weight"),
    ("replays", -2, "mel.replays"),
    ("max_pairs", -1, "mel.max_pairs"),
    ("lesson_min_chars", 500, "mel.lesson_min_chars=500 exceeds mel.lesson_max_chars"),
    ("replay_temperature", -0.5, "mel.replay_temperature"),
    ("reflection.max_tokens", 50, "mel.reflection.max_tokens=50 is below"),
    ("reflection.top_p", 0.0, "mel.reflection.top_p"),
])
def test_bad_mel_knobs_fail_naming_the_knob(tmp_path, key, value, match):
    errs = mode_knob_errors(tmp_path, "mel", key, value)
    assert len(errs) == 1 and match in errs[0], errs


def test_mode_mel_needs_groups_and_its_loss(tmp_path):
    from pmd_jax.config import apply_mode
    from pmd_jax.config.validate import config_errors

    c = embedded_default()
    c.mode, c.run_dir, c.rollout.n = "mel", str(tmp_path / "run"), 1
    apply_mode(c)
    assert any("mode=mel with rollout.n=1" in e for e in config_errors(c))
    c = embedded_default()
    c.mode, c.run_dir = "grpo", str(tmp_path / "run")
    apply_mode(c)
    c.distill.loss.name = "mel"
    assert any("reads the lesson rows only mode=mel builds" in e for e in config_errors(c))


def test_config_listing_shows_the_mel_knobs(capsys):
    from pmd_jax.config.__main__ import main

    assert main(["x", "mel"]) == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(MelConfig):
        assert f"mel.{f.name}" in out


# ----------------------------------------------------------------------------- end to end
# The real entry point (pmd_jax.main.run) with the task's verifier patched: the tiny random
# model never answers right, so every even-numbered response of a verify call is made right
# (the others keep the real verifier's 0). Rollouts (n=2): rollout 0 of every problem is right,
# so every problem has a contrastive pair and the policy writes real schema-constrained
# reflections through the run's sampler; replays (mel.replays=2): the first sample of each
# lesson is right, so the replayed lessons are kept and reach the train step's NLL term
# (keep_unquoted: random text rarely quotes the wrong rollout).
_ENTRY = """
import pmd_jax.loop.trainer as t
_init = t.Trainer.__init__
def init(self, cfg):
    _init(self, cfg)
    real = self.task.verify_batch
    def verify_batch(problems, texts, split):
        out = real(problems, texts, split)
        for k, res in enumerate(out):
            if k % 2 == 0:
                res.reward = 1.0
        return out
    self.task.verify_batch = verify_batch
t.Trainer.__init__ = init
from pmd_jax.main import run
run()
"""


@pytest.mark.slow  # ~60 s on 2 loaded cores (a subprocess that compiles the loop)
def test_two_step_mel_run_logs_the_mel_metrics(tmp_path):
    import subprocess
    import sys

    from tests.tiny_runs import TINY as TINY_FLAGS
    from tests.tiny_runs import cache_flags
    from tests.tiny_runs import env as _env

    run_dir = tmp_path / "mel"
    cmd = [sys.executable, "-c", _ENTRY, "--config=configs/smollm2_sciq.py",
           f"--config.run_dir={run_dir}", *TINY_FLAGS, *cache_flags(), "--config.mode=mel",
           "--config.train.steps=2", "--config.mel.replays=2", "--config.mel.keep_unquoted=True",
           "--config.mel.split_point_max_chars=60", "--config.mel.critique_max_chars=60",
           "--config.mel.lesson_max_chars=90", "--config.mel.reflection.max_tokens=160",
           "--config.train.microbatch_rows=2"]  # 2 microbatches: the lessons stay whole
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    train = [r.get("values", r) for r in recs if r["kind"] == "train"]
    assert len(train) == 2
    for r in train:
        for k in (*mel.STAT_KEYS, "mel_lesson_nll", "mel_lesson_tokens", "grpo_loss"):
            assert k in r, k
        assert r["mel_pairs"] == 2 and r["mel_reflections"] == 2
        assert r["mel_reflect_tokens"] > 0
        assert r["mel_replays"] == 2 * r["mel_lessons_replayed"] and r["mel_replay_tokens"] > 0
        assert r["mel_lessons_kept"] == r["mel_lessons_replayed"] == r["mel_replays_correct"]
        assert r["mel_reflections"] == (r["mel_malformed"] + r["mel_lessons_kept"]
                                        + r["mel_lessons_dropped"])
        assert r["mel_lesson_rows"] == r["mel_lessons_kept"]
        if r["mel_lessons_kept"]:
            assert r["mel_lesson_nll"] > 0
            assert r["loss"] == pytest.approx(r["grpo_loss"] + r["mel_lesson_nll"], rel=1e-5)
    assert sum(r["mel_lessons_kept"] for r in train) > 0
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["mode"] == "mel" and cfg["distill"]["loss"]["name"] == "mel"
