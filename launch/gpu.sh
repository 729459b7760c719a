#!/usr/bin/env bash
# Run pmd_jax on GPU hosts. One host:
#   bash launch/gpu.sh configs/qwen3.py
# Several hosts (run the same command on every host, same coordinator and process count):
#   COORDINATOR=10.0.0.1:12345 NUM_PROCESSES=4 PROCESS_ID=<0..3> bash launch/gpu.sh configs/qwen3.py
# Rollouts come from a vLLM server (launch/vllm_server.sh) on the GPUs you leave to it;
# CUDA_VISIBLE_DEVICES splits them, e.g. TRAIN_GPUS=0,1,2,3 and the server on 4-7.
set -euo pipefail
CONFIG=${1:?usage: gpu.sh CONFIG [--config.key=value ...]}
shift
cd "$(dirname "$0")/.."
if ! python3 -c "import jax; assert jax.default_backend() == 'gpu'" 2>/dev/null; then
  echo "installing jax[cuda12] (no GPU backend found in this environment)"
  python3 -m pip install -q 'jax[cuda12]'
fi
python3 -m pip install -q -e . >/dev/null
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
[[ -n "${TRAIN_GPUS:-}" ]] && export CUDA_VISIBLE_DEVICES=$TRAIN_GPUS
if [[ -n "${COORDINATOR:-}" ]]; then
  export PMD_COORDINATOR=$COORDINATOR PMD_NUM_PROCESSES=${NUM_PROCESSES:?} \
    PMD_PROCESS_ID=${PROCESS_ID:?}
fi
exec python3 -m pmd_jax.main --config="$CONFIG" "$@"
