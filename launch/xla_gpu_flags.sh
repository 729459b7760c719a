# shellcheck shell=bash
# XLA flags for our GPU runs, sourced by launch/gpu.sh (the trainer's XLA_FLAGS) and read by
# benchmarks/bench_train_step.py (its GPU child; `--ablate` measures the step with and without
# them). One list, so the benchmark measures what a launched run gets.
#
# Chosen as MaxText's and NVIDIA JAX-Toolbox's GPU scripts set them, keeping those that act
# on one GPU or on our data/FSDP-parallel step, each checked to exist in jaxlib 0.10.2 (XLA
# aborts on an unknown flag; XLA:CPU parses the same list, so the CPU tests check it):
#   latency_hiding_scheduler      schedule async work (collectives, the host offload of the
#                                 *_offloaded remat policies) to overlap compute
#   while_loop_double_buffering   the scanned layer loop unrolled by two, so the next layer's
#                                 async work (FSDP weight all-gathers, offload copies) overlaps
#                                 this layer's compute
#   triton_gemm=false             GEMMs from cuBLAS/cuBLASLt, not Triton (shorter autotuning;
#                                 MaxText's and JAX-Toolbox's choice)
#   highest_priority_async_stream collectives on a high-priority stream
# Left at XLA's defaults: command buffers (CUDA graphs; a step of ~1 s launches few enough
# kernels that graphs save little), the collective combine thresholds (tune per mesh).
#
# Env: PMD_XLA_GPU_FLAGS=0 leaves XLA_FLAGS as it is; flags already in XLA_FLAGS come after
# ours and so win (XLA reads the last value of a flag).

PMD_XLA_GPU_FLAG_LIST=(
  --xla_gpu_enable_latency_hiding_scheduler=true
  --xla_gpu_enable_while_loop_double_buffering=true
  --xla_gpu_enable_triton_gemm=false
  --xla_gpu_enable_highest_priority_async_stream=true
)

# XLA_FLAGS with our flags first (the caller's own XLA_FLAGS after them); unchanged with
# PMD_XLA_GPU_FLAGS=0.
pmd_xla_gpu_flags() {
  if [[ "${PMD_XLA_GPU_FLAGS:-1}" == 0 ]]; then
    printf '%s\n' "${XLA_FLAGS:-}"
    return
  fi
  local out="${PMD_XLA_GPU_FLAG_LIST[*]}"
  if [[ -n "${XLA_FLAGS:-}" ]]; then out="$out $XLA_FLAGS"; fi
  printf '%s\n' "$out"
}
