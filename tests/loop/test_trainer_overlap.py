"""rollout.overlap: step k+1's rollouts are sampled in a background thread while step k's
memory update and train step run (tiny random Llama, real SciQ data, real entry point).

Checked: the config rules; staleness 0 at the first step and exactly 1 after it, with the
weights version each batch was sampled with; the first step bitwise equal to the run without
overlap (nothing is stale yet) and the same problems drawn at every step (the data cursor is
exact); the logged trainer/sampler log-prob mismatch; a SIGKILL after the first checkpoint
and a restart ending bitwise equal to the uninterrupted overlap run (the checkpoint carries
the already-sampled next batch: its stale weights are not in the checkpoint to resample it).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from pmd_jax.config import ConfigError, apply_mode, base_config, validate_config
from tests.loop.test_trainer import kill9_and_resume
from tests.tiny_runs import run_once
from tests.tiny_runs import train_records as _train_records

OVERLAP = ("--config.rollout.overlap=True",)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory) -> Path:
    return run_once(tmp_path_factory, "clean")  # the same run as test_trainer.py's


@pytest.fixture(scope="module")
def overlap_run(tmp_path_factory) -> Path:
    return run_once(tmp_path_factory, "overlap", *OVERLAP)


def test_overlap_config_rules():
    c = apply_mode(base_config())
    assert c.rollout.overlap is False
    with c.unlocked():
        c.rollout.overlap = True
        c.rollout.max_tokens = 1024  # 2048 + 8192 would not fit SmolLM2's 8192 positions
    validate_config(c)  # the default keeps the truncated IS correction on
    with c.unlocked():
        c.distill.loss.rollout_is_threshold = None
    with pytest.raises(ConfigError, match="rollout.overlap=True .*rollout_is_threshold"):
        validate_config(c)
    with c.unlocked():
        c.rollout.overlap = False
    validate_config(c)  # only overlap requires the correction


def _problems_by_step(run_dir: Path) -> dict[int, list[str]]:
    out: dict[int, list[str]] = defaultdict(list)
    for line in (run_dir / "memory.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("level") == "experience":
            out[int(r["step"])].append(str(r["problem_id"]))
    return {k: sorted(v) for k, v in out.items()}


def test_overlap_staleness_and_first_step(clean_run: Path, overlap_run: Path):
    off, on = _train_records(clean_run), _train_records(overlap_run)
    assert [r["step"] for r in on] == [0, 1, 2]
    assert [r["rollout_staleness"] for r in off] == [0, 0, 0]
    assert [r["rollout_staleness"] for r in on] == [0, 1, 1]
    # step k + 1 was sampled with the weights published after step k - 1
    assert [r["rollout_weights_version"] for r in on] == [0, 0, 1]
    assert [r["rollout_weights_version"] for r in off] == [0, 1, 2]
    for r in on:  # the mismatch and the truncated-IS clip fraction are logged every step
        assert "logp_mismatch_mean" in r and "rollout_is_clip_frac" in r, r
        assert "time_prefetch_wait" in r and "time_rollout_generate" in r, r
    # From the second step the rollouts come from the previous weights: the trainer/sampler
    # log-prob mismatch is the policy change of one step, far above the numerical noise.
    for a, b in zip(off[1:], on[1:], strict=True):
        assert b["logp_mismatch_mean"] > 100 * max(a["logp_mismatch_mean"], 1e-7), (a, b)
    # The first step has nothing stale: bitwise the same as without overlap.
    for k, v in off[0].items():
        if not k.startswith(("time", "rss_")):  # timings, the wall-clock stamp, host memory
            assert on[0][k] == v, (k, v, on[0][k])
    # Same problems at every step (overlap draws step k + 1's problems early, in order).
    probs_off, probs_on = _problems_by_step(clean_run), _problems_by_step(overlap_run)
    assert probs_off and probs_on == probs_off


# ~75 s: the default run keeps the non-overlap kill -9 test (test_trainer.py) and the overlap
# staleness test; this one runs with -m slow.
@pytest.mark.slow
def test_overlap_kill9_resume_is_bitwise_identical(overlap_run: Path, tmp_path: Path):
    kill9_and_resume(overlap_run, tmp_path / "killed", *OVERLAP)
