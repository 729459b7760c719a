"""The check before use (issue 35; memory/verify.py, teaching.check_memory).

A memory holding known items (tests/loop/test_teacher_context.py's fixtures: SmolLM2's tokenizer,
a hash embedder, items written at step 0, the step batch at step 1 and all its rollouts
failed) meets a scripted sampler: it reads each replay prompt and answers right or wrong
depending on which memory item the prompt holds, so an item's effect is known by construction.
The teacher prompts are those ``teaching.build_train_batch`` (the trainer's function) builds.
"""

from __future__ import annotations

import numpy as np
import pytest

from pmd_jax.loop import teaching
from pmd_jax.memory.verify import (
    EvidenceStore,
    Proposal,
    check_before_use,
    paired_effect,
    wilson_bounds,
)
from pmd_jax.sampling.base import Rollout, Rollouts
from tests.loop.test_teacher_context import (
    LESSONS_HEADER,
    STRATEGIES_HEADER,
    Task,
    _hash_embedder,  # noqa: F401  (autouse fixture: the hash embedder, no MiniLM)
    make_memory,
    model,  # noqa: F401  (fixture)
    run_config,
    step_batch,
    teacher_user_texts,
)

RIGHT, WRONG, NOT_AN_ANSWER = "carbon dioxide", "helium", "???"


class GradedTask(Task):
    """Task with a verifier: right iff the reply names carbon dioxide; ``ok`` (an option was
    named) unless it is ``???``."""

    def verify_batch(self, problems, texts, split):
        from types import SimpleNamespace

        return [SimpleNamespace(reward=float(RIGHT in t), ok=NOT_AN_ANSWER not in t,
                                feedback="") for t in texts]


class ScriptedSampler:
    """Answers each replay prompt by rule: an item text in ``effects`` decides every sample
    ("right" / "wrong" / "invalid"); a prompt with no such item (the baseline) is right for
    sample 0 only. Records every call."""

    def __init__(self, tokenizer, effects: dict[str, str], baseline_right: bool = True):
        self.tok = tokenizer
        self.effects = dict(effects)
        self.baseline_right = baseline_right
        self.calls: list[tuple[int, int]] = []  # (prompts, n) per generate call
        self.prompt_tokens = 0
        self.generated_tokens = 0

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params.n))
        out = []
        for i, ids in enumerate(prompts):
            self.prompt_tokens += len(ids)
            text = self.tok.decode(list(ids), skip_special=False)
            rule = next((v for k, v in self.effects.items() if k in text), None)
            for j in range(params.n):
                if rule == "right" or (rule is None and j == 0 and self.baseline_right):
                    ans = f"The answer is {RIGHT}."
                elif rule == "invalid":
                    ans = NOT_AN_ANSWER
                else:
                    ans = f"The answer is {WRONG}."
                toks = np.asarray(self.tok.encode(ans), np.int32)
                self.generated_tokens += len(toks)
                out.append(Rollout(i, j, toks, np.zeros(len(toks), np.float32), "stop"))
        return Rollouts(out, 0)


def verified_config(**over):
    """pmd_verified at a per-test level (z 1.645, 8 pairs at most), so that one test of 4
    pairs can admit and the mechanics show in a few steps; the default level is
    test_the_default_level_is_bonferroni_over_a_steps_tests's."""
    return run_config(n=2, **{"mode": "pmd_verified", "teacher_prompt.include_feedback": False,
                              "memory.verify.z": 1.645, "memory.verify.max_pairs": 8, **over})


def build(cfg, model, mem, sb, sampler):  # noqa: F811
    return teaching.build_train_batch(cfg, model, GradedTask(), mem, sb, sampler=sampler)


# ----------------------------------------------------------------------------- statistics
def test_wilson_and_paired_effect_against_direct_formulas():
    # Wilson (1927) score interval, written out for k=3, n=3, z=1.645
    z, k, n = 1.645, 3, 3
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    assert wilson_bounds(k, n, z) == pytest.approx((centre - half, min(1.0, centre + half)))
    # 3 wins of 4 pairs, no loss: discordant share 3/4 times (2 lo - 1)
    est, lo, hi = paired_effect(3, 0, 4, z)
    w_lo, w_hi = wilson_bounds(3, 3, z)
    assert (est, lo, hi) == pytest.approx((0.75, 0.75 * (2 * w_lo - 1), 0.75 * (2 * w_hi - 1)))
    assert lo > 0  # 3 wins and no loss admit at z = 1.645
    assert paired_effect(2, 0, 4, z)[1] < 0  # 2 wins do not
    assert paired_effect(0, 0, 4, z) == (0.0, 0.0, 0.0)  # ties alone: no evidence either way


def test_the_default_level_is_bonferroni_over_a_steps_tests():
    """z: one-sided 5% over the max_items_per_step tests of a step; 7 wins and no loss admit
    (more than one test's 4 pairs), 6 do not; max_pairs leaves room for a third test."""
    from statistics import NormalDist

    v = run_config().memory.verify
    alpha = 0.05 / v.max_items_per_step
    assert v.z == pytest.approx(NormalDist().inv_cdf(1 - alpha), abs=0.005)
    assert paired_effect(7, 0, 8, v.z)[1] > 0 >= paired_effect(6, 0, 8, v.z)[1]
    assert paired_effect(6, 0, 6, v.z)[1] <= 0  # never on one test's pairs alone
    assert v.max_pairs >= 3 * v.replays


# ----------------------------------------------------------------------------- admission
def test_a_helpful_item_is_admitted_and_a_harmful_one_never_reaches_a_teacher(model):  # noqa: F811
    cfg = verified_config()
    mem, items = make_memory(cfg, model, ["pA"])
    good, bad = items["pA"]["strategies"][0], items["pA"]["lessons"][0]
    sampler = ScriptedSampler(model.tokenizer, {good: "right", bad: "wrong"})
    sb = step_batch(cfg, model, ["pA"])
    users, batch = teacher_user_texts_with(cfg, model, mem, sb, sampler)
    for user in users:
        assert good in user and bad not in user
        assert STRATEGIES_HEADER in user
        # items never tested (over the per-problem budget) are not shown either
        others = [t for t in items["pA"]["strategies"] + items["pA"]["lessons"]
                  if t not in (good, bad)]
        assert not any(t in user for t in others if not mem.evidence.visible(key_of(mem, t)))
    ev_good, ev_bad = mem.evidence.items[key_of(mem, good)], mem.evidence.items[key_of(mem, bad)]
    assert ev_good.status == "admitted" and (ev_good.wins, ev_good.losses) == (3, 0)
    assert ev_bad.status != "admitted" and (ev_bad.wins, ev_bad.losses) == (0, 1)
    assert batch["sd_mask"].tolist() == [1.0, 1.0]  # an admitted item: a memory signal
    # more evidence against the harmful item rejects it; it stays out of every context
    for step in (2, 3):
        sb = step_batch(cfg, model, ["pA"])
        sb.step = step
        users, _ = teacher_user_texts_with(cfg, model, mem, sb, sampler)
        assert all(bad not in u for u in users)
    assert mem.evidence.items[key_of(mem, bad)].status == "rejected"


def test_an_admitted_item_whose_evidence_turns_negative_is_retired(model):  # noqa: F811
    cfg = verified_config(**{"memory.verify.retest_every": 2})
    mem, items = make_memory(cfg, model, ["pA"])
    good = items["pA"]["strategies"][0]
    sampler = ScriptedSampler(model.tokenizer, {good: "right"})
    sb = step_batch(cfg, model, ["pA"])
    users, _ = teacher_user_texts_with(cfg, model, mem, sb, sampler)
    assert all(good in u for u in users)
    ev = mem.evidence.items[key_of(mem, good)]
    assert ev.status == "admitted"
    sampler.effects[good] = "wrong"  # the policy has moved: the item now hurts
    sb.step = 2  # not due yet (retest_every 2): shown, untested
    users, _ = teacher_user_texts_with(cfg, model, mem, sb, sampler)
    assert all(good in u for u in users) and ev.tests == 1
    for step in (3, 5):  # due at 3 (3 - 1 >= 2): losses pull the bound down
        sb.step = step
        users, _ = teacher_user_texts_with(cfg, model, mem, sb, sampler)
        if ev.status == "retired":
            break
    assert ev.status == "retired" and ev.losses > 0
    assert all(good not in u for u in users)
    sb.step = 20  # retired for good: never shown or tested again
    tests = ev.tests
    users, _ = teacher_user_texts_with(cfg, model, mem, sb, sampler)
    assert all(good not in u for u in users) and ev.tests == tests


def test_invalid_answers_reject_an_item_whatever_its_reward(model):  # noqa: F811
    store = EvidenceStore(run_config().memory.verify)
    # with the item: never right but never valid either; without: valid, never right
    moved = ""
    for step in range(3):
        moved = store.record("k", "insight", step, "p", [(False, False, False, True)] * 4)
        if moved:
            break
    assert moved == "rejected" and store.items["k"].format_losses >= 3


# ----------------------------------------------------------------------------- signals
def test_an_all_fail_group_with_only_unverified_items_gets_no_memory_signal(model):  # noqa: F811
    cfg = verified_config()
    mem, items = make_memory(cfg, model, ["pA"])
    del mem.experience.successes["pA"]  # no remembered success: memory items only
    # no item changes anything (all pending), and no replay succeeds: nothing to show
    sampler = ScriptedSampler(model.tokenizer, {}, baseline_right=False)
    sb = step_batch(cfg, model, ["pA"])
    users, batch = teacher_user_texts_with(cfg, model, mem, sb, sampler)
    assert batch["sd_mask"].tolist() == [0.0, 0.0]
    for user in users:
        assert STRATEGIES_HEADER not in user and LESSONS_HEADER not in user
    # PMD (unverified) gives the same rows a signal from the same items
    cfg_pmd = run_config(n=2, **{"teacher_prompt.include_feedback": False})
    mem2, _ = make_memory(cfg_pmd, model, ["pA"])
    del mem2.experience.successes["pA"]
    _, batch2 = teacher_user_texts(cfg_pmd, model, mem2, sb)
    assert batch2["sd_mask"].tolist() == [1.0, 1.0]


def test_a_row_whose_items_are_all_cut_by_the_budget_loses_its_signal(model):  # noqa: F811
    cfg = run_config(n=1, **{"teacher_prompt.include_feedback": False})
    mem, _ = make_memory(cfg, model, ["pA"])
    del mem.experience.successes["pA"]
    sb = step_batch(cfg, model, ["pA"])
    _, batch = teacher_user_texts(cfg, model, mem, sb)
    assert batch["sd_mask"].tolist() == [1.0]
    # a budget that holds the problem and the instruction only
    ctx = teaching.build_teacher_contexts(cfg, model, Task(), mem, sb)[0]
    bare = ctx.fit(model.count_tokens, 10_000)
    bare.strategies, bare.lessons, bare.behaviors = [], [], []
    cfg = cfg.with_values({"memory.context.max_tokens": model.count_tokens(bare.text())})
    users, batch = teacher_user_texts(cfg, model, mem, sb)
    assert STRATEGIES_HEADER not in users[0]
    assert batch["sd_mask"].tolist() == [0.0]


def test_no_teacher_sees_an_item_written_from_its_own_attempt(model):  # noqa: F811
    """Reflections run in the same step before the teacher batch: items written at the row's
    own step (from its own attempts) are not shown; those of earlier steps are."""
    cfg = run_config(n=1)
    mem, items = make_memory(cfg, model, ["pA"])
    sb = step_batch(cfg, model, ["pA"])
    sb.step = 0  # the items were written at step 0: this step's own reflection
    (user,), _ = teacher_user_texts(cfg, model, mem, sb)
    for t in items["pA"]["strategies"] + items["pA"]["lessons"]:
        assert t not in user
    assert "behavior_" not in user  # the behaviors of step 0's round too
    sb.step = 1
    (user,), _ = teacher_user_texts(cfg, model, mem, sb)
    assert all(t in user for t in items["pA"]["strategies"] + items["pA"]["lessons"])


# ----------------------------------------------------------------------------- costs
def test_the_cost_counters_equal_the_calls_made(model):  # noqa: F811
    cfg = verified_config(**{"memory.verify.max_items_per_problem": 3})
    mem, items = make_memory(cfg, model, ["pA", "pB"])
    sampler = ScriptedSampler(model.tokenizer, {})
    sb = step_batch(cfg, model, ["pA", "pB"])
    _, stats = build(cfg, model, mem, sb, sampler)
    r = cfg.memory.verify.replays
    # 2 problems x 3 items + their 2 baselines, in 1 + 3 calls of `replays` samples each
    assert sampler.calls == [(2, r)] * 4
    assert stats["verify_generate_calls"] == 4 and stats["verify_arms"] == 8
    assert stats["verify_items_tested"] == 6
    assert stats["verify_sequences"] == 8 * r
    assert stats["verify_generated_tokens"] == sampler.generated_tokens
    assert stats["verify_prompt_tokens"] == sampler.prompt_tokens
    assert stats["verify_token_forwards"] == sampler.prompt_tokens + sampler.generated_tokens
    # 4 strategies/lessons per problem + 3 behaviors
    assert stats["verify_items_proposed"] == 2 * 7


def test_paired_arms_share_their_prompt_slot():
    """Slot k's problems are a prefix of the baseline's, so an item's arm sits at its
    problem's baseline position (the same sampling keys)."""
    store = EvidenceStore(run_config().memory.verify)
    props = [[Proposal(f"a{k}", "insight", "strategies", f"a{k}") for k in range(1)],
             [Proposal(f"b{k}", "insight", "strategies", f"b{k}") for k in range(3)],
             []]
    seen: list[list] = []

    def run_arms(arms):
        seen.append(list(arms))
        return [[(False, True)] * 4 for _ in arms]

    counts = check_before_use(store, 1, ["a", "b", "c"], props, run_arms)
    assert [a[0] for a in seen[0]] == [1, 0]  # baselines, most items first
    assert [[a[0] for a in call] for call in seen[1:]] == [[1, 0], [1], [1]]
    assert counts["tested"] == 4 and counts["calls"] == 4 and counts["arms"] == 6


# ----------------------------------------------------------------------------- helpers
def key_of(mem, text: str) -> str:
    from pmd_jax.memory.verify import evidence_key

    for d, it in mem.insights.items.items():
        if it.text == text:
            return evidence_key(d, text)
    raise KeyError(text)


def teacher_user_texts_with(cfg, model, mem, sb, sampler):  # noqa: F811
    """teacher_user_texts with the scripted sampler and the graded task."""
    return teacher_user_texts(cfg, model, mem, sb, task=GradedTask(), sampler=sampler)


def test_matched_sampling_sdpo_shows_an_extra_sample_success_to_an_all_fail_group(model):  # noqa: F811
    """sdpo_matched_sampling: the extra samples (student prompt, not trained on) give the
    all-fail group its demonstration; their cost is counted."""
    cfg = run_config(n=2, **{"mode": "sdpo_matched_sampling",
                             "teacher_prompt.include_feedback": False})
    k = cfg.teacher_prompt.extra_demo_samples
    sb = step_batch(cfg, model, ["pA", "pB"])
    sampler = ScriptedSampler(model.tokenizer, {})  # sample 0 of each prompt is right
    plain = run_config(n=2, **{"mode": "sdpo", "teacher_prompt.include_feedback": False})
    users, batch = teacher_user_texts(plain, model, None, sb)
    assert batch["sd_mask"].tolist() == [0.0] * 4  # SDPO: no success, no signal
    users, batch = teacher_user_texts(cfg, model, None, sb, task=GradedTask(), sampler=sampler)
    assert batch["sd_mask"].tolist() == [1.0] * 4
    assert all(f"The answer is {RIGHT}." in u for u in users)
    assert sampler.calls == [(2, k)]
    _, stats = build(cfg, model, None, sb, sampler)
    assert stats["extra_demo_sequences"] == 2 * k
    assert stats["extra_demo_found_fraction"] == 1.0


def test_evidence_survives_a_checkpoint_and_is_exported(model, tmp_path):  # noqa: F811
    """Each item's evidence is in the memory's state (so a resumed run keeps it), in
    memory.jsonl beside the item, and in memory.html with rejected items shown apart."""
    import json

    cfg = verified_config()
    mem, items = make_memory(cfg, model, ["pA"])
    good, bad = items["pA"]["strategies"][0], items["pA"]["lessons"][0]
    sampler = ScriptedSampler(model.tokenizer, {good: "right", bad: "wrong"})
    for step in (1, 2, 3):
        sb = step_batch(cfg, model, ["pA"])
        sb.step = step
        build(cfg, model, mem, sb, sampler)
    before = {k: v.to_json(mem.evidence.z) for k, v in mem.evidence.items.items()}
    assert before[key_of(mem, good)]["status"] == "admitted"
    assert before[key_of(mem, bad)]["status"] == "rejected"
    fresh, _ = make_memory(cfg, model, ["pA"])
    fresh.load_state_dict(mem.state_dict())
    assert {k: v.to_json(fresh.evidence.z) for k, v in fresh.evidence.items.items()} == before
    mem.export_jsonl(str(tmp_path / "memory.jsonl"))
    rows = [json.loads(x) for x in (tmp_path / "memory.jsonl").read_text().splitlines()]
    by_text = {r["text"]: r for r in rows if r.get("level") == "insight"}
    ev = by_text[good]["evidence"]
    assert ev["status"] == "admitted" and ev["low"] > 0 and ev["last_tested_step"] >= 1
    assert ev["pairs"] == cfg.memory.verify.replays * ev["tests"]
    assert by_text[bad]["evidence"]["status"] == "rejected"
    mem.export_html(str(tmp_path / "memory.html"))
    page = (tmp_path / "memory.html").read_text()
    admitted_at = page.index("Admitted (shown to the teacher)")
    rejected_at = page.index("Rejected or retired (never shown)")
    assert admitted_at < page.index(good, admitted_at) < rejected_at < page.index(bad,
                                                                                  rejected_at)


def test_a_successful_replay_is_the_demonstration_of_a_group_without_one(model):  # noqa: F811
    """The check's replays are graded attempts at the problem: a row shown no success gets
    its problem's first successful replay (the baseline arm's), source "replay"; with the
    option off, none; a row with a sibling's success keeps it."""
    cfg = verified_config()
    mem, items = make_memory(cfg, model, ["pA"])
    del mem.experience.successes["pA"]
    sampler = ScriptedSampler(model.tokenizer, {})  # the baseline's sample 0 is right
    sb = step_batch(cfg, model, ["pA"])
    ctxs = teaching.build_teacher_contexts(cfg, model, GradedTask(), mem, sb, sampler)
    assert [c.successful_attempt_source for c in ctxs] == ["replay", "replay"]
    assert all(c.successful_attempt == f"The answer is {RIGHT}." for c in ctxs)
    users, batch = teacher_user_texts_with(cfg, model, mem, sb, sampler)
    assert batch["sd_mask"].tolist() == [1.0, 1.0]
    assert all(f"The answer is {RIGHT}." in u for u in users)
    off = verified_config(**{"memory.verify.replays_as_demonstrations": False})
    mem2, _ = make_memory(off, model, ["pA"])
    del mem2.experience.successes["pA"]
    ctxs = teaching.build_teacher_contexts(off, model, GradedTask(), mem2, sb, sampler)
    assert [c.successful_attempt for c in ctxs] == [None, None]
    # a sibling's success is kept: rollout 1 succeeded, so rollout 0 is shown it
    sb.rewards[0, 1] = 1.0
    sb.texts[1] = "Sibling: the answer is carbon dioxide."
    sb.step = 2  # (replays run where tests are due: the pending items are, at a later step)
    ctxs = teaching.build_teacher_contexts(cfg, model, GradedTask(), mem, sb, sampler)
    assert ctxs[0].successful_attempt_source == "sibling"
    assert ctxs[1].successful_attempt_source == "replay"  # (its own success is never shown)


@pytest.mark.parametrize("z, admitted", [(1.645, True), (2.64, False)])
def test_an_item_arms_success_is_shown_only_once_the_item_is_admitted(model, z, admitted):  # noqa: F811
    """The side door (issue 48): a replay from an item's arm carries what the item made the
    policy write. The baseline never succeeds here and the item's arm always does (4 wins, no
    loss): at z = 1.645 that admits the item, and its arm's success is the demonstration of
    the rows shown none; at z = 2.64 the item stays pending (it takes 7 wins), and no row is
    shown its arm's success: an item the check has not admitted reaches no teacher."""
    cfg = verified_config(**{"memory.verify.z": z})
    mem, items = make_memory(cfg, model, ["pA"])
    del mem.experience.successes["pA"]
    good = items["pA"]["strategies"][0]
    sampler = ScriptedSampler(model.tokenizer, {good: "right"}, baseline_right=False)
    sb = step_batch(cfg, model, ["pA"])
    ctxs = teaching.build_teacher_contexts(cfg, model, GradedTask(), mem, sb, sampler)
    ev = mem.evidence.items[key_of(mem, good)]
    assert (ev.wins, ev.losses) == (4, 0) and ev.visible is admitted
    want = ["replay", "replay"] if admitted else [None, None]
    assert [c.successful_attempt_source for c in ctxs] == want
    assert all((c.successful_attempt == f"The answer is {RIGHT}.") is admitted for c in ctxs)
