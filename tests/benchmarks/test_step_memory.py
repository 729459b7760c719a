"""benchmarks/bench_step_memory.py on a tiny model: XLA's accounting of the step in one
program and in two (train.offload_optimizer_during_grads), from a real config file."""

from __future__ import annotations

from benchmarks import bench_step_memory as bsm


def test_two_programs_hold_less_than_one(capsys):
    assert bsm.main(["--config", "configs/smollm2_sciq.py", "--mode", "sdpo",
                     "--set", "model.random_init=tiny-llama", "--set", "train.microbatch_rows=4",
                     "--json"]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama" in out and "16 rows (microbatches of 4)" in out
    import json

    r = json.loads(out.strip().splitlines()[-1])
    one, grad, update = r["one_program"], r["two_programs"]["gradient"], \
        r["two_programs"]["update"]
    # the state is donated and aliased in the one program and in the update
    assert one["alias"] > 0 and update["alias"] > 0.99 * update["output"]
    # the gradient program reads params and teacher, not the moments: half the state's bytes
    assert abs(grad["argument"] - one["argument"] / 2) < 0.01 * one["argument"]
    # the update writes the clipped gradient over the gradient: fewer temporaries than the
    # one program's, which holds the gradient, its accumulator and the clipped copy
    assert update["temp"] < one["temp"]
    assert r["two_programs_resident_gib"] < r["one_program_resident_gib"]
    assert 0 < r["ratio_two_over_one"] < 1
