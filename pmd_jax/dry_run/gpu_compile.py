"""The dry run's GPU targets (8xH100, 8xH200) as the GPU compiler sees them, without a GPU.

Two paths; the report says which ran (``path``):

* ``xla_gpu_compile``: the CUDA PJRT plugin (``jax-cuda12-plugin`` + ``jax-cuda12-pjrt``, for
  compiling only: no driver, no CUDA libraries) builds compile-only GPU devices from a target
  description (``jax.experimental.topologies.get_topology_desc(platform="cuda",
  topology="1x1xN", target_config=<GpuTargetConfigProto text>)``), the real train step is
  lowered on a mesh of them and compiled by XLA:GPU for that target (sm_90, 132 SMs, ...):
  ``memory_analysis()`` and the optimized HLO are the GPU compiler's own. Autotuning needs a
  device, so GEMM tilings are XLA's defaults; the program's structure (fusions, custom calls,
  dtypes, buffers) is what a GPU run compiles. cuDNN need not be installed: JAX's cuDNN
  attention asks the cuDNN library for its version while tracing, so during the trace that
  question is answered with the target's version (:func:`gpu_tracing`).
* ``cuda_stablehlo``: no plugin here. The step is traced on ONE device (a mesh of the same
  axes, all of size 1) and lowered for platform ``cuda`` (``jit(...).trace(...).lower(
  lowering_platforms=("cuda",))``): the CUDA StableHLO, before XLA:GPU's passes, global
  shapes. It shows the cuDNN custom calls and their operands, ``chlo.top_k`` (XLA:GPU sorts
  when k > 16) and the ``dot_general`` dtypes; no GPU memory figure. (On a mesh of several
  devices JAX lowers cuDNN attention to a ``CustomSPMDPartitioning`` call whose body only
  XLA's partitioner produces, at compile time: the StableHLO would not show it.)

In both the step is traced as on a GPU: ``attention_impl="auto"`` picks with backend "gpu" and
the target's compute capability (:func:`gpu_tracing` answers
``pmd_jax.models.attend.backend_facts``), and JAX's caches are cleared around the trace so
neither the CPU compiles before nor after see a GPU trace.

Getting the plugin (about 190 MB of wheels, 480 MB installed; pip's default install pulls
no nvidia-* wheel, they are an extra): in a throwaway venv that sees this environment's
packages, so the system JAX never tries to start CUDA on import::

    python -m venv --system-site-packages /tmp/cudavenv
    /tmp/cudavenv/bin/pip install jax-cuda12-plugin==0.10.2   # = this jax's version
    JAX_PLATFORMS=cpu /tmp/cudavenv/bin/python -m pmd_jax.main --config=... --dry_run \\
        --config.dry_run.target=8xH100

or ``PMD_JAX_CUDA_PLUGIN_SITE=/tmp/cudavenv/lib/python3.11/site-packages`` with the system
python (appended to ``sys.path``, the plugin registered when the GPU report asks for it).
``PMD_JAX_DRY_RUN_GPU``: ``auto`` (default: compile when the plugin is there, else
StableHLO), ``stablehlo`` (lower only), ``off`` (no GPU report).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.experimental import topologies

from pmd_jax.dry_run import gpu_facts, gpu_report
from pmd_jax.dry_run import hardware as tg
from pmd_jax.models import attend
from pmd_jax.run.sharding import make_mesh

log = logging.getLogger("pmd_jax")
GiB = 1024**3
PLUGIN_SITE_ENV = "PMD_JAX_CUDA_PLUGIN_SITE"
MODE_ENV = "PMD_JAX_DRY_RUN_GPU"
MODES = ("auto", "stablehlo", "off")
COMPILE, STABLEHLO = "xla_gpu_compile", "cuda_stablehlo"


@dataclasses.dataclass(frozen=True)
class GpuModel:
    """What XLA:GPU needs to know of one GPU to compile for it (a GpuTargetConfigProto).
    Figures from NVIDIA's H100 / H200 SXM datasheets and the CUDA programming guide's table
    for compute capability 9.0 (shared memory per SM 228 KiB, 227 KiB per block opt-in,
    64 K registers, 2048 threads per SM); memory as the device reports it (H100 SXM: 81,008
    MiB; H200 SXM: 143,771 MiB), not the 80 / 141 GB of the verdict (``hardware.py``)."""

    device: str  # the CUDA device name (device_kind of the compile-only devices)
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    bandwidth_bytes_per_s: int
    l2_bytes: int
    clock_ghz: float
    cudnn: tuple[int, int, int]  # the cuDNN the program is compiled against (jax wants >= 9.8)

    @property
    def cudnn_int(self) -> int:
        """As ``cudnnGetVersion()`` returns it (9.8.0 -> 90800)."""
        a, b, c = self.cudnn
        return a * 10000 + b * 100 + c


_H100 = GpuModel("NVIDIA H100 80GB HBM3", (9, 0), 132, 84_942_979_072, 3_350_000_000_000,
                 50 * 1024**2, 1.98, (9, 8, 0))
GPU_MODELS: dict[str, GpuModel] = {
    "8xH100": _H100,
    "8xH200": dataclasses.replace(_H100, device="NVIDIA H200", memory_bytes=150_754_820_096,
                                  bandwidth_bytes_per_s=4_800_000_000_000),
}


def target_config_text(m: GpuModel) -> str:
    """The ``stream_executor.GpuTargetConfigProto`` text format for ``m``."""
    major, minor = m.compute_capability
    info = {
        "threads_per_block_limit": 1024, "threads_per_warp": 32,
        "shared_memory_per_block": 48 * 1024, "shared_memory_per_core": 228 * 1024,
        "threads_per_core_limit": 2048, "core_count": m.sm_count, "fpus_per_core": 128,
        "block_dim_limit_x": 2**31 - 1, "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
        "memory_bandwidth": m.bandwidth_bytes_per_s, "l2_cache_size": m.l2_bytes,
        "clock_rate_ghz": m.clock_ghz, "device_memory_size": m.memory_bytes,
        "shared_memory_per_block_optin": 227 * 1024,
        "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
    }
    lines = ["gpu_device_info {"]
    lines += [f"  {k}: {v}" for k, v in info.items()]
    lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}", "}",
              'platform_name: "CUDA"',
              "dnn_version_info {{ major: {} minor: {} patch: {} }}".format(*m.cudnn),
              f'device_description_str: "{m.device}"']
    return "\n".join(lines) + "\n"


def gpu_mode() -> str:
    mode = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r} is not one of {MODES}")
    return mode


def plugin_missing() -> str | None:
    """None when the CUDA PJRT plugin can be imported, else why not (with how to get it)."""
    site = os.environ.get(PLUGIN_SITE_ENV, "")
    if site and site not in sys.path:
        sys.path.append(site)
    try:
        found = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return ("the CUDA PJRT plugin is not installed (jax_plugins.xla_cuda12: pip install "
            "jax-cuda12-plugin==<jax's version> in a venv with --system-site-packages, or "
            f"{PLUGIN_SITE_ENV}=<its site-packages>; see pmd_jax/dry_run/gpu_compile.py)")


def compile_only_devices(m: GpuModel, n: int) -> list[Any]:
    """``n`` compile-only CUDA devices of model ``m`` (one host), from the plugin's topology."""

    def topo() -> Any:
        return topologies.get_topology_desc(platform="cuda", topology=f"1x1x{n}",
                                            target_config=target_config_text(m))

    try:
        return list(topo().devices)
    except NotImplementedError:
        _register_late()
        return list(topo().devices)


def _register_late() -> None:
    """jax looked for plugins before ``PMD_JAX_CUDA_PLUGIN_SITE`` was on ``sys.path``:
    register the CUDA plugin now, and give it what jax gives each plugin it discovers (the
    callbacks registered before discovery, e.g. custom partitioning's, which cuDNN
    attention on a mesh needs)."""
    # lazy: private jax internals, only on the simulated-GPU dry-run path
    from jax._src import xla_bridge as xb

    importlib.import_module("jax_plugins.xla_cuda12").initialize()
    factory = getattr(xb, "_backend_factories", {}).get("cuda")
    c_api = getattr(factory, "c_api", None)
    if c_api is not None:
        for callback in list(getattr(xb, "_plugin_callbacks", [])):
            callback(c_api=c_api)


@contextlib.contextmanager
def gpu_tracing(m: GpuModel) -> Iterator[None]:
    """Trace as on a GPU of model ``m``: the attention choice sees backend "gpu" and its
    compute capability; JAX's cuDNN attention, which asks the installed cuDNN for its version
    and the default backend for the compute capability while tracing, gets the target's. JAX's
    caches are cleared on entry and exit (no trace crosses the boundary)."""
    # lazy: private jax internals, only on the simulated-GPU dry-run path
    from jax._src.cudnn import fused_attention_stablehlo as fa

    cc = m.compute_capability
    cc_text = f"{cc[0]}.{cc[1]}"

    def at_least(capability: str) -> bool:
        return cc >= tuple(int(x) for x in capability.split("."))

    def equal(capability: str) -> bool:
        return cc == tuple(int(x) for x in capability.split("."))

    def cudnn_version() -> int:
        try:
            return int(real_version())
        except Exception:  # noqa: BLE001 - no cuDNN library here: the target's version
            return m.cudnn_int

    real_version = fa.check_cudnn_version
    patches: list[tuple[Any, str, Any]] = [
        (attend, "backend_facts", lambda: ("gpu", cc_text)),
        (fa, "check_cudnn_version", cudnn_version),
        (fa, "check_compute_capability", at_least),
        (fa, "is_cuda_compute_capability_equal", equal),
    ]
    missing = [f"{mod.__name__}.{name}" for mod, name, _ in patches if not hasattr(mod, name)]
    if missing:
        raise RuntimeError(f"the GPU dry run traces as on a GPU through {missing}, which this "
                           "version does not have (pmd_jax/dry_run/gpu_compile.py)")
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    jax.clear_caches()
    try:
        for mod, name, new in patches:
            setattr(mod, name, new)
        yield
    finally:
        for mod, name, old in saved:
            setattr(mod, name, old)
        jax.clear_caches()


Build = Callable[[Any], tuple[Any, Any, dict[str, Any]]]


def gpu_step_report(target: str, shape: dict[str, int], build: Build, vocab: int,
                    num_layers: int, mode: str | None = None) -> dict[str, Any]:
    """The train step of ``build(mesh) -> (TrainStep, abstract state, abstract batch)`` on
    ``target``'s GPUs (mesh ``shape``): compiled by XLA:GPU without a device when the plugin
    is there (``mode`` auto), else lowered to CUDA StableHLO; the facts of the program
    (:mod:`pmd_jax.dry_run.gpu_facts`) and, when compiled, its memory."""

    t = tg.get_target(target)
    m = GPU_MODELS[t.name]
    mode = gpu_mode() if mode is None else mode
    why = plugin_missing() if mode == "auto" else f"{MODE_ENV}={mode}"
    path = COMPILE if why is None else STABLEHLO
    out: dict[str, Any] = {"path": path, "target": t.name, "device": m.device,
                           "compute_capability": "{}.{}".format(*m.compute_capability),
                           "cudnn": "{}.{}.{}".format(*m.cudnn)}
    if why:
        out["not_compiled_because"] = why
    t0 = time.perf_counter()
    if path == COMPILE:
        devices = compile_only_devices(m, t.chips)
    else:  # one device: JAX inlines the cuDNN call (on more, a CustomSPMDPartitioning call
        # that only XLA's partitioner expands, at compile time); shapes are global either way
        devices, shape = jax.devices()[:1], {k: 1 for k in shape}
    out["mesh"] = dict(shape)
    with gpu_tracing(m):
        mesh = make_mesh(shape, devices=devices)
        ts, state, batch = build(mesh)
        traced = ts._get_compiled(batch).trace(state, dict(batch))
        if path == COMPILE:
            compiled = traced.lower().compile()
            text = compiled.as_text()
            need = tg.memory_need(compiled.memory_analysis())
            v = tg.verdict(need["total"], t.hbm_bytes)
            out.update({**need, "fits": v.fits, "verdict": v.word,
                        "headroom": v.headroom_bytes,
                        "headroom_frac": round(v.headroom_frac, 4)})
            del compiled
        else:
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    vd = gpu_facts.vocab_dims(vocab, [mesh.shape.get("tensor", 1), mesh.size])
    facts = gpu_facts.read_facts(text, vd, num_layers)
    out["facts"] = gpu_report.summary(facts, vd)
    out["fact_lines"] = gpu_report.format_facts(facts, vd)
    out["program_chars"] = len(text)
    dump = os.environ.get("PMD_JAX_DRY_RUN_GPU_DUMP", "")
    if dump:  # the program text, for reading by hand
        with open(dump, "w") as f:
            f.write(text)
        out["program_file"] = dump
    return out


def format_gpu_report(g: dict[str, Any]) -> list[str]:
    t = tg.get_target(g["target"])

    def gib(b: float) -> str:
        return f"{b / GiB:.2f}"

    if g["path"] == COMPILE:
        lines = [
            f"GPU program: XLA:GPU COMPILE without a device ({g['path']}) for {t.name}: "
            f"compile-only {g['device']} devices (sm_{g['compute_capability'].replace('.', '')}"
            f", cuDNN {g['cudnn']}), {g['seconds']} s",
            f"  train step per device (XLA:GPU memory_analysis), GiB: args {gib(g['arguments'])}"
            f", outputs {gib(g['outputs'])}, aliased {gib(g['aliased'])}, temp "
            f"{gib(g['temporaries'])}, total {gib(g['total'])} of {gib(t.hbm_bytes)} HBM: "
            f"{g['verdict']} ({100 * g['headroom_frac']:.1f}% headroom)",
            "  no device: no autotuning (XLA's default GEMM tilings), sorts as XLA's fallback "
            "sort (no deviceless CUB data); facts read from the optimized HLO (per-device "
            "shapes):",
        ]
    else:
        lines = [
            f"GPU program: CUDA StableHLO ONLY ({g['path']}), lowered for platform 'cuda' on "
            "one device (global shapes; on a mesh JAX leaves cuDNN attention to XLA's "
            f"partitioner), not compiled: {g.get('not_compiled_because', '')}; no XLA:GPU "
            f"memory figure ({g['seconds']} s)",
            "  facts read from the StableHLO (XLA:GPU's rewrites not applied):",
        ]
    return lines + list(g["fact_lines"])
