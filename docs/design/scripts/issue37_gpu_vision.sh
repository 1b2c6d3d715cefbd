#!/usr/bin/env bash
# Issue 37's figures on a lent GPU (`mlxpaged bench vision`: cold time to first token, the same image's next turn, 8
# concurrent image requests, each beside mlx-vlm's own generate / batch_generate), on a random-weight SmolVLM-256M-
# Instruct shape (its real text model, SigLIP tower and processor settings: docs/design/scripts/issue37_smolvlm_256m.py;
# no real checkpoint can reach the machine). Third call of a warm machine (issue37_gpu_vision_prepare.sh says how):
#   bash .gpu/p2/run.sh bash docs/design/scripts/issue37_gpu_vision.sh
# Installs .gpu/p3's wheels into the kit's site once, writes the checkpoint in /tmp/models/smolvlm-256m-shape, then
# runs the bench under its own limit, the output under $OUT. Not run yet: no device has been lent since it was written.
set -u
OUT=${OUT:-/tmp/gpu/out}; SITE=${SITE:-/tmp/gpu/site}; mkdir -p "$OUT"
if [ ! -f "$SITE/.vision" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/p3/*.whl \
    || { echo "no .gpu/p3 wheels: carry .gpu/p3 in this call"; exit 2; }
  touch "$SITE/.vision"
fi
python3 -c "import mlx_vlm, PIL, transformers; print('mlx-vlm', mlx_vlm.__version__, 'transformers', transformers.__version__)" \
  2>&1 | tee "$OUT/vision_env.txt"
MODEL=/tmp/models/smolvlm-256m-shape
[ -f "$MODEL/model.safetensors" ] || timeout 120 python3 docs/design/scripts/issue37_smolvlm_256m.py "$MODEL" 2>&1 | tail -3
echo "=== bench vision ($(date +%T), limit ${VISION_LIMIT:-420}s)"
timeout "${VISION_LIMIT:-420}" python3 -m mlxpaged_app.cli bench vision --model "$MODEL" --tokens 64 --runs 3 2>&1 \
  | tee "$OUT/bench_vision.txt"
