#!/usr/bin/env bash
# Issue 50's train-step ablation on one GPU: bench_train_step.py --device gpu --ablate at the
# 8B-shape figure (Llama-3-8B cut to 8 layers, B=16, student 1,024 / teacher 1,536 tokens,
# response 512, bf16 compute), our side once per variant and torch + HF once, each in its own
# process; the table on stdout, the JSON and the whole log in RESULTS_DIR.
#
#   bash benchmarks/gpu_ablate.sh                     # every variant, within BUDGET seconds
#   bash benchmarks/gpu_ablate.sh --variants topk,attention --steps 5   # extra arguments
#   bash benchmarks/gpu_ablate.sh --dry               # the children's commands only
#
# Env: RESULTS_DIR (default benchmarks/results), BUDGET (seconds for the whole ablation,
# default 500: a child that would not fit is not started), PYTHON (default python3),
# WHEELS (a folder of wheels to install first, offline, into /tmp/site: for a GPU box without
# internet that lacks one of our pure-Python needs, e.g. ml-collections; fetch them elsewhere
# with `pip download --no-deps --only-binary=:all: ml-collections==1.1.0 -d WHEELS`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS_DIR=${RESULTS_DIR:-benchmarks/results}
mkdir -p "$RESULTS_DIR"
if [[ -n "${WHEELS:-}" ]] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c 'import jax, ml_collections, torch, transformers' || {
  echo "gpu_ablate.sh: $PY lacks jax, ml_collections, torch or transformers (see WHEELS above)" >&2
  exit 2
}
"$PY" -c 'import jax; assert jax.default_backend() == "gpu", jax.devices()' || {
  echo "gpu_ablate.sh: $PY's JAX sees no GPU" >&2
  exit 2
}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
"$PY" -c 'import jax, torch, transformers; print("jax", jax.__version__, "torch",
torch.__version__, "transformers", transformers.__version__)'
export PYTHONUNBUFFERED=1
"$PY" benchmarks/bench_train_step.py --device gpu --ablate --model llama3-8b --layers 8 \
  --batch 16 --student-len 1024 --teacher-len 1536 --response-len 512 --dtype bfloat16 \
  --steps 3 --budget "${BUDGET:-500}" --out "$RESULTS_DIR/bench_train_step_ablate_gpu.json" \
  "$@" 2>&1 | tee "$RESULTS_DIR/bench_train_step_ablate_gpu.log"
