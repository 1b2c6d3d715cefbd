#!/usr/bin/env bash
# Issue 21 on a lent GPU, in one device call (after the kit's call 1, ../shared/gpu/README.md):
#   bash .gpu/p2/run.sh bash docs/design/scripts/issue21_gpu_check.sh
# Every step has its own time limit and writes under $OUT, so a step that runs long costs only itself.
# Set MLXPAGED_COMMIT=<sha> in front: the copy on the GPU machine has no .git.
set -u
OUT=${OUT:-/tmp/gpu/out}
step() { local limit=$1 name=$2; shift 2; echo "=== $name ($(date +%T), limit ${limit}s)"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"; }
# Most telling first: a call cut short by the device's limit still brings back what ran.
step 60 correctness python3 docs/design/scripts/issue21_gpu_tokens.py /tmp/models/135m
step 80 bench_1.7b_decode python3 -m mlxpaged_app.cli bench gpu --model /tmp/models/1.7b --parts decode --tokens 128 --runs 3
step 110 bench_1.7b_ttft python3 -m mlxpaged_app.cli bench gpu --model /tmp/models/1.7b --parts ttft --sizes 2048,8192 --runs 1
step 150 bench_1.7b_batch python3 -m mlxpaged_app.cli bench gpu --model /tmp/models/1.7b --parts batch --tokens 128 --runs 2 \
     --concurrency 16,64
step 60 bench_135m_decode python3 -m mlxpaged_app.cli bench gpu --model /tmp/models/135m --parts decode --tokens 128 --runs 3
step 45 profile_135m python3 docs/design/scripts/issue21_gpu_profile.py /tmp/models/135m 256
step 60 native_mlx_lm python3 .gpu/p2/native_mlx_lm.py /tmp/models/1.7b
