#!/usr/bin/env bash
# Run pmd_jax on a Cloud TPU VM pod slice: create (or reuse) the slice, copy the code to every
# worker, install it, and start the same main on all workers (jax.distributed finds its peers
# through the TPU metadata, so no coordinator flags are needed on TPU).
#
#   TPU_NAME=pmd-v5p-64 ZONE=us-east5-a ACCEL=v5p-64 VERSION=v2-alpha-tpuv5 \
#     bash launch/tpu_pod.sh configs/olmo3.py --config.train.steps=300
#
# Needs: gcloud authenticated for the project; the checkpoint and data on a path every worker
# sees (gs:// via tensorstore, or copied with --data-dir).
set -euo pipefail
CONFIG=${1:?usage: tpu_pod.sh CONFIG [--config.key=value ...]}
shift
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
ACCEL=${ACCEL:-v5p-64}
VERSION=${VERSION:-v2-alpha-tpuv5}
PROJECT_FLAG=${PROJECT:+--project=$PROJECT}
REMOTE_DIR=${REMOTE_DIR:-pmd_jax}
RUN_DIR=${RUN_DIR:-gs://${BUCKET:-my-bucket}/pmd_runs/$(basename "$CONFIG" .py)}

if ! gcloud compute tpus tpu-vm describe "$TPU_NAME" --zone "$ZONE" $PROJECT_FLAG >/dev/null 2>&1; then
  echo "creating TPU slice $TPU_NAME ($ACCEL) in $ZONE"
  gcloud compute tpus tpu-vm create "$TPU_NAME" --zone "$ZONE" $PROJECT_FLAG \
    --accelerator-type "$ACCEL" --version "$VERSION"
else
  echo "reusing TPU slice $TPU_NAME"
fi

tarball=$(mktemp -t pmd_jax.XXXXXX.tar.gz)
git ls-files -z | tar --null -czf "$tarball" -T -
gcloud compute tpus tpu-vm scp "$tarball" "$TPU_NAME:~/pmd_jax.tar.gz" --zone "$ZONE" \
  $PROJECT_FLAG --worker=all
rm -f "$tarball"

gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" $PROJECT_FLAG --worker=all --command "
  set -e
  mkdir -p ~/$REMOTE_DIR && tar -xzf ~/pmd_jax.tar.gz -C ~/$REMOTE_DIR
  cd ~/$REMOTE_DIR
  python3 -m pip install -q 'jax[tpu]' -e . 
  PMD_DISTRIBUTED=auto nohup python3 -m pmd_jax.main --config=$CONFIG \
    --config.run_dir=$RUN_DIR $* > ~/pmd_main.log 2>&1 &
  echo started on \$(hostname)
"
echo "logs: gcloud compute tpus tpu-vm ssh $TPU_NAME --zone $ZONE --worker=0 --command 'tail -f ~/pmd_main.log'"
