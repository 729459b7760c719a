"""The metrics file on a resume (pmd_jax.run.metrics): the records a resumed run keeps, drops
and reads back, on a real metrics.jsonl. The end-to-end runs that restart at an evaluation's
step are tests/loop/test_trainer.py's (slow)."""

from __future__ import annotations

import json
from pathlib import Path

from pmd_jax.run.metrics import MetricsWriter, read_metrics


def _writer(tmp_path: Path, records: list[dict]) -> MetricsWriter:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return MetricsWriter(tmp_path, use_tensorboard=False)


def test_a_resume_at_an_evaluated_step_keeps_its_evaluation_and_drops_later_records(tmp_path):
    # checkpoint 1 committed; the run logged step 1's evaluation and died in step 1's training
    recs = [{"kind": "eval", "step": 0, "accuracy": 0.1}, {"kind": "train", "step": 0},
            {"kind": "eval", "step": 1, "accuracy": 0.2}, {"kind": "train", "step": 1},
            {"kind": "phase", "step": 2}]
    w = _writer(tmp_path, recs)
    # what the trainer does on resuming at step 1
    assert w.truncate_after(0, keep=("eval", 1)) == 2
    assert w.last("eval", 1) == {"kind": "eval", "step": 1, "accuracy": 0.2}
    w.write("train", 1, {"loss": 0.5})
    w.close()
    assert [(r["kind"], r["step"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        ("eval", 0), ("train", 0), ("eval", 1), ("train", 1)]


def test_a_resume_whose_evaluation_never_finished_finds_none(tmp_path):
    w = _writer(tmp_path, [{"kind": "eval", "step": 0}, {"kind": "train", "step": 0},
                           {"kind": "train", "step": 1}])
    assert w.truncate_after(0, keep=("eval", 1)) == 1
    assert w.last("eval", 1) is None  # so the trainer runs it before the next step
    assert w.last("train", 0) == {"kind": "train", "step": 0}


def test_last_is_the_latest_record_and_a_torn_line_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "eval", "step": 3, "v": 1}\n{"kind": "eval", "step": 3, "v": 2}\n'
                    '{"kind": "eval", "st')  # a crash mid-write
    w = MetricsWriter(tmp_path, use_tensorboard=False)
    assert w.last("eval", 3) == {"kind": "eval", "step": 3, "v": 2}
    assert w.truncate_after(-1) == 2  # a start from step 0 drops an earlier attempt's records
    assert read_metrics(path) == []
    w.close()
