#!/usr/bin/env bash
# Issue 37's figures on a lent GPU need mlx-vlm and Pillow beside the GPU kit's wheels (../shared/gpu/README.md),
# which leave no room for them in the kit's two calls (64 MiB each, the checkout included): this fills .gpu/p3
# (git-ignored, ~11 MiB) for a third call on the same warm machine. Run in the project's root after the kit's
# prepare.sh:
#   bash docs/design/scripts/issue37_gpu_vision_prepare.sh
# Then, after the kit's call 1, on the same warm machine: call 2 carries [".gpu/p2"] and installs the kit
# (`bash .gpu/p2/run.sh true`); call 3 carries [".gpu/p3"] and runs
#   bash .gpu/p2/run.sh bash docs/design/scripts/issue37_gpu_vision.sh
# The GPU machine's own Python already has what mlx-lm needs (transformers, tokenizers, numpy: the kit relies on
# them); mlx-vlm's other requirements (opencv, datasets, the audio and server parts) are not imported by the
# checkpoint, processor and generate paths the bench uses, so they are left out (--no-deps).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
[ -d .gpu/p2 ] || { echo "run ../shared/gpu/prepare.sh first"; exit 1; }
MLX_VLM=${MLX_VLM_VERSION:-$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('mlx-vlm'))")}
rm -rf .gpu/p3; mkdir -p .gpu/p3
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/p3 "mlx-vlm==$MLX_VLM" pillow
du -sh .gpu/p3
