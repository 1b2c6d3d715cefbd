#!/usr/bin/env bash
# Issue 38 part 5 (the GPU levers) on a lent GPU, in one device call after the kit's call 1 (../shared/gpu/README.md):
#   MLXPAGED_COMMIT=<sha> bash .gpu/p2/run.sh bash docs/design/scripts/issue38_gpu_levers.sh [STEP ...]
# With no STEP: batch_default batch_record batch_compiled twin_check batch_kernel (9 minutes by the limits, within
# one call; not run yet); then, in another call if device time is left: skewed nographs twin_micro. Each step has
# its own limit and writes under $OUT, so a call cut short brings back what ran. `bench gpu` prints every lever set
# (decode attention, MLX_USE_CUDA_GRAPHS, MLXPAGED_RECORD_THREAD, MLXPAGED_COMPILE_BATCH), beside mlx-lm.
set -u
OUT=${OUT:-/tmp/gpu/out}
M=${MODELS:-/tmp/models}
BENCH="python3 -m mlxpaged_app.cli bench"
run_step() {
  local name=$1
  case $1 in
    # The CUDA twin through the engine's own self-check (NVRTC compile + every variant against the reference).
    twin_check) limit=60; set -- env MLXPAGED_ATTENTION=kernel python3 -c "import mlxpaged, mlx.core as mx; from mlxpaged.kernels import attention as a; print(a.prepare_attention(mx.bfloat16, 64, 16, 32, 32).status())" ;;
    twin_micro) limit=90; set -- python3 docs/design/scripts/issue38_cuda_kernel.py ;;
    batch_kernel) limit=120; set -- env MLXPAGED_ATTENTION=kernel $BENCH gpu --model $M/1.7b --parts batch --tokens 128 --runs 2 --concurrency 16,64 ;;
    batch_default) limit=120; set -- $BENCH gpu --model $M/1.7b --parts batch --tokens 128 --runs 2 --concurrency 16,64 ;;
    # The pass queued ahead recorded on a thread of its own while Python builds the next (runner/recorder.py).
    batch_record) limit=120; set -- env MLXPAGED_RECORD_THREAD=1 $BENCH gpu --model $M/1.7b --parts decode,batch --tokens 128 --runs 2 --concurrency 16,64 ;;
    # Decode passes of up to 64 rows compiled at bucketed batch sizes (runner/decode_pass.py), built ahead on the pools.
    batch_compiled) limit=120; set -- env MLXPAGED_COMPILE_BATCH=64 $BENCH gpu --model $M/1.7b --parts batch --tokens 128 --runs 2 --concurrency 16,64 ;;
    skewed) limit=150; set -- $BENCH batch --model $M/1.7b --lengths skewed --tokens 128 --runs 1 ;;
    skewed_kernel) limit=150; set -- env MLXPAGED_ATTENTION=kernel $BENCH batch --model $M/1.7b --lengths skewed --tokens 128 --runs 1 ;;
    # The engine's own process without CUDA graphs: decode, batch and the cold / cached prefill (cuDNN builds a
    # graph per call then: recheck the 8k cached follow-up).
    nographs) limit=150; set -- env MLX_USE_CUDA_GRAPHS=0 $BENCH gpu --model $M/1.7b --parts decode,batch,ttft --tokens 128 --runs 2 --concurrency 16,64 --sizes 8192 ;;
    native) limit=60; set -- python3 .gpu/p2/native_mlx_lm.py $M/1.7b ;;
    *) echo "unknown step $1"; return 2 ;;
  esac
  echo "=== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
}
ALL="batch_default batch_record batch_compiled twin_check batch_kernel"
for name in ${*:-$ALL}; do run_step "$name"; done
