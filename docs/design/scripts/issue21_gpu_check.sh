#!/usr/bin/env bash
# Issue 21 on a lent GPU, in one device call (after the kit's call 1, ../shared/gpu/README.md):
#   MLXPAGED_COMMIT=<sha> bash .gpu/p2/run.sh bash docs/design/scripts/issue21_gpu_check.sh [STEP ...]
# With no STEP, every step in order (about 5 minutes on an H200); else only the steps named, e.g.
# `correctness decode_1.7b profile_batch16`. Every step has its own time limit and writes under $OUT, so a step
# that runs long costs only itself, and a call cut short by the device's limit still brings back what ran.
# MLXPAGED_COMMIT: the copy on the GPU machine has no .git.
set -u
OUT=${OUT:-/tmp/gpu/out}
M=${MODELS:-/tmp/models}
BENCH="python3 -m mlxpaged_app.cli bench gpu"
run_step() {
  local name=$1
  case $1 in
    correctness) limit=60; set -- python3 docs/design/scripts/issue21_gpu_tokens.py $M/135m ;;
    decode_1.7b) limit=80; set -- $BENCH --model $M/1.7b --parts decode --tokens 128 --runs 4 ;;
    decode_135m) limit=60; set -- $BENCH --model $M/135m --parts decode --tokens 128 --runs 4 ;;
    ttft_1.7b) limit=110; set -- $BENCH --model $M/1.7b --parts ttft --sizes 2048,8192 --runs 1 ;;
    ttft_1.7b_chunk8k) limit=80; set -- $BENCH --model $M/1.7b --parts ttft --sizes 8192 --runs 1 --max-batch-tokens 8192 ;;
    batch_1.7b) limit=150; set -- $BENCH --model $M/1.7b --parts batch --tokens 128 --runs 2 --concurrency 16,64 ;;
    profile_135m) limit=45; set -- python3 docs/design/scripts/issue21_gpu_profile.py $M/135m 256 ;;
    profile_batch16) limit=60; set -- python3 docs/design/scripts/issue21_gpu_profile.py $M/1.7b 64 16 ;;
    native) limit=60; set -- python3 .gpu/p2/native_mlx_lm.py $M/1.7b ;;
    encode_cost) limit=45; set -- python3 docs/design/scripts/issue21_encode_cost.py $M/1.7b ;;
    cached_parts) limit=60; set -- python3 docs/design/scripts/issue21_cached_host.py --model $M/1.7b --runs 2 ;;
    batch_host16) limit=60; set -- python3 docs/design/scripts/issue21_batch_host.py --model $M/1.7b --batch 16 --tokens 64 --runs 1 --no-mlx-lm --profile ;;
    step_cost) limit=210; set -- python3 docs/design/scripts/issue21_step_cost.py $M/1.7b sdpa_shapes plain engine ;;
    engine_nographs) limit=150; set -- env MLX_USE_CUDA_GRAPHS=0 $BENCH --model $M/1.7b --parts decode,batch --tokens 128 --runs 2 --concurrency 16,64 ;;
    kv_decode) limit=240; set -- python3 -m mlxpaged_app.cli bench kv --model $M/1.7b --parts decode --tokens 128 --runs 3 ;;
    plain_nographs) limit=60; set -- env MLX_USE_CUDA_GRAPHS=0 python3 docs/design/scripts/issue21_step_cost.py $M/1.7b plain ;;
    batch_host) limit=90; set -- python3 docs/design/scripts/issue21_batch_host.py --model $M/1.7b --batch 64 --tokens 128 --runs 1 ;;
    *) echo "unknown step $1"; return 2 ;;
  esac
  echo "=== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
}
ALL="correctness decode_1.7b ttft_1.7b batch_1.7b decode_135m ttft_1.7b_chunk8k profile_135m native"
for name in ${*:-$ALL}; do run_step "$name"; done
