#!/usr/bin/env bash
# Run pmd_jax on GPU hosts: install what the config needs, start the vLLM server when the
# config samples with vLLM, then the trainer. One host:
#   bash launch/gpu.sh configs/smollm2_sciq.py
#   TRAIN_GPUS=0,1,2,3 VLLM_GPUS=4,5,6,7 bash launch/gpu.sh configs/qwen3.py
# Several hosts (run the same command on every host, same coordinator and process count):
#   COORDINATOR=10.0.0.1:12345 NUM_PROCESSES=4 PROCESS_ID=<0..3> \
#     bash launch/gpu.sh configs/qwen3.py --config.rollout.sampler=jax
#   bash launch/gpu.sh --print CONFIG ...   # print every command, run none of them
#
# Env: TRAIN_GPUS (CUDA_VISIBLE_DEVICES of the trainer), VLLM_GPUS (of the vLLM server);
#      COORDINATOR, NUM_PROCESSES, PROCESS_ID (several hosts: exported as PMD_COORDINATOR,
#      PMD_NUM_PROCESSES, PMD_PROCESS_ID, which pmd_jax/run/distributed.py reads);
#      PMD_VLLM_VENV (default "system": vllm installed here from the `vllm` extra; or a venv
#      made by launch/setup_vllm_venv.sh); VLLM_START_TIMEOUT (seconds, default 1800);
#      PMD_TORCH_INDEX_URL (an index serving the torch build you want for the embedder);
#      PYTHON (default python3, must be 3.11); PMD_XLA_GPU_FLAGS=0 (the trainer without the
#      XLA GPU flags of launch/xla_gpu_flags.sh, which go before any XLA_FLAGS of yours).
#
# rollout.sampler=vllm: the server is started here (launch/vllm_server.sh, on VLLM_GPUS,
# serving model.source at rollout.vllm_url's port) when rollout.vllm_url is a loopback URL;
# otherwise the server must already run at that URL. Refused (exit 2): vLLM with several
# processes (NUM_PROCESSES > 1: the vLLM sampler runs with one JAX process only, see
# pmd_jax/config.py), and vLLM without disjoint TRAIN_GPUS / VLLM_GPUS (JAX takes 90% of the
# memory of every GPU it sees). The server outlives the trainer: stop it by the pid printed.
set -euo pipefail

PRINT=0
if [[ "${1:-}" == "--print" ]]; then
  PRINT=1
  shift
fi
CONFIG=${1:?usage: gpu.sh [--print] CONFIG [--config.key=value ...]}
shift
cd "$(dirname "$0")/.."
die() { echo "gpu.sh: $*" >&2; exit 2; }
PY=${PYTHON:-python3}

# shellcheck source=launch/common.sh
source launch/common.sh
NEEDS=$("$PY" -m pmd_jax.launch_needs "$CONFIG" "$@") \
  || die "cannot read the config's needs (pmd_jax and its dependencies must import with $PY)"
eval "$NEEDS"

ENV=()
if [[ -n "${COORDINATOR:-}" ]]; then
  [[ "${NUM_PROCESSES:-}" =~ ^[0-9]+$ ]] || die "COORDINATOR is set: set NUM_PROCESSES too"
  [[ "${PROCESS_ID:-}" =~ ^[0-9]+$ ]] || die "COORDINATOR is set: set PROCESS_ID (0..NUM_PROCESSES-1)"
  ((PROCESS_ID < NUM_PROCESSES)) || die "PROCESS_ID=$PROCESS_ID must be < NUM_PROCESSES=$NUM_PROCESSES"
  ENV+=(PMD_COORDINATOR="$COORDINATOR" PMD_NUM_PROCESSES="$NUM_PROCESSES"
    PMD_PROCESS_ID="$PROCESS_ID")
fi
ENV+=(XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}")
if [[ -n "${TRAIN_GPUS:-}" ]]; then ENV+=(CUDA_VISIBLE_DEVICES="$TRAIN_GPUS"); fi
# the XLA GPU flags of our runs (launch/xla_gpu_flags.sh; PMD_XLA_GPU_FLAGS=0: none added)
# shellcheck source=launch/xla_gpu_flags.sh
source launch/xla_gpu_flags.sh
xla_flags=$(pmd_xla_gpu_flags)
if [[ -n "$xla_flags" ]]; then ENV+=(XLA_FLAGS="$xla_flags"); fi

START_VLLM=0
if [[ "$PMD_SAMPLER" == "vllm" ]]; then
  if [[ -n "${COORDINATOR:-}" ]] && ((NUM_PROCESSES > 1)); then
    die "rollout.sampler='vllm' runs with one JAX process only, not NUM_PROCESSES=$NUM_PROCESSES" \
      "(every process would sample and reload weights on its own); pass" \
      "--config.rollout.sampler=jax for several hosts"
  fi
  if [[ "$PMD_VLLM_LOCAL" == 1 ]]; then
    [[ -n "${TRAIN_GPUS:-}" && -n "${VLLM_GPUS:-}" ]] || die "rollout.sampler='vllm' on this" \
      "host: set TRAIN_GPUS and VLLM_GPUS to disjoint GPU lists (e.g. TRAIN_GPUS=0,1,2,3" \
      "VLLM_GPUS=4,5,6,7); JAX takes most of the memory of every GPU it sees"
    IFS=, read -r -a tg <<<"$TRAIN_GPUS"
    for g in "${tg[@]}"; do
      [[ ",$VLLM_GPUS," != *",$g,"* ]] || die "GPU $g is in both TRAIN_GPUS and VLLM_GPUS"
    done
    START_VLLM=1
  else
    echo "rollout.vllm_url=$PMD_VLLM_URL is not on this host: expecting a running server there" \
      "(start it with launch/vllm_server.sh)" >&2
  fi
fi

if ((PRINT)); then
  echo "# gpu.sh --print: the commands it would run (none was run)"
  echo "# checked here: $PY is Python $("$PY" -c 'import platform; print(platform.python_version())') (3.11+)"
  echo "# run_dir: $PMD_RUN_DIR  sampler: $PMD_SAMPLER  mode: $PMD_MODE"
  echo "$(q "$PY" -c "import jax; assert jax.default_backend() == 'gpu'") 2>/dev/null" \
    "|| $(q "$PY" -m pip install -q "jax[cuda12]")"
elif ! "$PY" -c "import jax; assert jax.default_backend() == 'gpu'" 2>/dev/null; then
  echo "installing jax[cuda12] (no GPU backend found in this environment)"
  "$PY" -m pip install -q "jax[cuda12]"
fi
extras=()
if [[ -n "$PMD_EXTRAS" ]]; then IFS=, read -r -a extras <<<"$PMD_EXTRAS"; fi
VLLM_VENV=${PMD_VLLM_VENV:-system}
if ((START_VLLM)) && [[ "$VLLM_VENV" == system ]]; then extras+=(vllm); fi
editable=.
if ((${#extras[@]})); then editable=".[$(IFS=,; echo "${extras[*]}")]"; fi
if [[ "$PMD_MEMORY" == 1 ]]; then
  torch_index=()
  if [[ -n "${PMD_TORCH_INDEX_URL:-}" ]]; then
    torch_index=(--extra-index-url "$PMD_TORCH_INDEX_URL")
  fi
  run "$PY" -m pip install -q "torch==2.13.0" ${torch_index[@]+"${torch_index[@]}"}
fi
pkgs=()
if [[ "$PMD_RUN_DIR_REMOTE" == 1 ]]; then pkgs+=(gcsfs google-cloud-storage); fi
run "$PY" -m pip install -q ${pkgs[@]+"${pkgs[@]}"} -e "$editable"
if [[ -n "$PMD_ASSETS" ]]; then
  read -r -a assets <<<"$PMD_ASSETS"
  run "$PY" -m pip install -q --no-deps "${assets[@]}"
fi

if ((START_VLLM)); then
  if [[ ! -d "$PMD_MODEL_SOURCE" ]] && ((!PRINT)); then
    die "the vLLM server serves model.source=$PMD_MODEL_SOURCE: not a folder on this host"
  fi
  log=${VLLM_LOG:-vllm_server.log}
  vllm_env=(CUDA_VISIBLE_DEVICES="$VLLM_GPUS" PMD_VLLM_VENV="$VLLM_VENV"
    PMD_VLLM_HOST="$PMD_VLLM_HOST" PMD_VLLM_PORT="$PMD_VLLM_PORT")
  if ((PRINT)); then
    echo "$(q env "${vllm_env[@]}" nohup bash launch/vllm_server.sh "$PMD_MODEL_SOURCE") > $(q "$log") 2>&1 &"
  else
    env "${vllm_env[@]}" nohup bash launch/vllm_server.sh "$PMD_MODEL_SOURCE" >"$log" 2>&1 &
    echo "vLLM server: pid $!, log $log"
  fi
  # Wait until it answers /v1/models (the model is loaded).
  wait_cmd=("$PY" -m pmd_jax.launch_needs --wait "$PMD_VLLM_URL" "${VLLM_START_TIMEOUT:-1800}")
  run "${wait_cmd[@]}" || die "the vLLM server did not answer in time; see $log"
fi

if ((PRINT)); then
  run env "${ENV[@]}" "$PY" -m pmd_jax.main --config="$CONFIG" "$@"
else
  exec env "${ENV[@]}" "$PY" -m pmd_jax.main --config="$CONFIG" "$@"
fi
