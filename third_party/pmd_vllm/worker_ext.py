"""vLLM worker extension: load a committed weight version from a tensorstore weight store.

Start the server with ``--worker-extension-cls pmd_vllm.worker_ext.TensorstoreWeightLoader``
(``third_party`` on ``PYTHONPATH``; see ``launch/vllm_server.sh``). vLLM mixes this class
into its worker, so its methods are callable through ``collective_rpc``; over HTTP that is
``POST /collective_rpc`` (only served when ``VLLM_SERVER_DEV_MODE=1``) with
``{"method": "pmd_load_weights", "args": [store_url, version, timeout_s]}`` (vLLM passes
only strings). Afterwards the client calls ``POST /reset_prefix_cache``: the prefix cache
lives in the scheduler, not in the worker, and cached KV blocks were computed with the old
weights.

The store format is defined by ``pmd_jax/sampling/weight_store.py``; that module needs only
numpy and tensorstore, and is loaded here from its file (found next to this package in the
repository, or at ``$PMD_WEIGHT_STORE_PY``) so that importing it never imports jax or the
rest of ``pmd_jax``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

_MODULE_NAME = "pmd_weight_store"


def load_weight_store_module() -> ModuleType:
    """The ``pmd_jax.sampling.weight_store`` module, imported from its file (no jax)."""
    if _MODULE_NAME in sys.modules:
        return sys.modules[_MODULE_NAME]
    path = os.environ.get("PMD_WEIGHT_STORE_PY") or str(
        Path(__file__).resolve().parents[2] / "pmd_jax" / "sampling" / "weight_store.py"
    )
    if not os.path.isfile(path):
        raise ImportError(
            f"pmd_vllm: weight_store.py not found at {path!r}; set PMD_WEIGHT_STORE_PY to "
            "the path of pmd_jax/sampling/weight_store.py"
        )
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_MODULE_NAME]
        raise
    return module


def to_torch(array: Any) -> Any:
    """numpy -> torch CPU tensor without a copy; bfloat16 (ml_dtypes) goes through uint16."""
    import numpy as np
    import torch

    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


class TensorstoreWeightLoader:
    """Mixed into the vLLM worker: every method name is prefixed ``pmd_`` to avoid clashes."""

    def pmd_load_weights(
        self, store_url: str, version: str, timeout_s: str = "120"
    ) -> dict[str, Any]:
        """Read committed ``version`` (``"latest"`` for the newest) and load it in place.

        All arrays are read and checksum-verified before any weight is touched, so a
        damaged or missing version raises without changing the served model.
        """
        ws = load_weight_store_module()
        t0 = time.perf_counter()
        store = ws.WeightStore(store_url, timeout_s=float(timeout_s), gc_on_publish=False)
        want = None if version in ("latest", "", "None") else int(version)
        arrays, manifest = store.read(want)
        t_read = time.perf_counter() - t0
        t1 = time.perf_counter()
        weights = [(name, to_torch(arr)) for name, arr in arrays.items()]
        reload = getattr(self, "reload_weights", None)
        if reload is not None:
            # vLLM's in-place reload: model.load_weights inside the layerwise-reload
            # bracket, so weights repacked for kernels after loading are rebuilt too.
            reload(weights_iterator=iter(weights), is_checkpoint_format=True)
        else:
            self.get_model().load_weights(iter(weights))  # type: ignore[attr-defined]
        t_load = time.perf_counter() - t1
        self.pmd_weights_version_ = manifest.version
        return {
            "version": manifest.version,
            "step": manifest.step,
            "num_arrays": len(arrays),
            "bytes": int(sum(a.nbytes for a in arrays.values())),
            "read_s": t_read,
            "load_s": t_load,
        }

    def pmd_weights_version(self) -> dict[str, Any]:
        """The version last loaded through ``pmd_load_weights`` (None: the startup weights)."""
        return {"version": getattr(self, "pmd_weights_version_", None)}
