"""Issue 37: a random-weight SmolVLM-256M-Instruct-shaped checkpoint (its real shapes and processor settings,
tests/vision/tiny_vlm_dirs.py SMOLVLM_256M_*), for `mlxpaged bench vision` where no real checkpoint is on the machine.
Timings are real (the shapes are); the replies are noise (random weights), as with the GPU kit's text models.

    PYTHONPATH=. python docs/design/scripts/issue37_smolvlm_256m.py /tmp/smolvlm-256m-shape
    mlxpaged bench vision --model /tmp/smolvlm-256m-shape --tokens 32 --runs 3
"""

import sys
from pathlib import Path

from tests.vision.tiny_vlm_dirs import (
    SMOLVLM_256M_IMAGES,
    SMOLVLM_256M_TEXT,
    SMOLVLM_256M_VISION,
    write_smolvlm_dir,
)

out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/smolvlm-256m-shape")
write_smolvlm_dir(out, SMOLVLM_256M_TEXT, SMOLVLM_256M_VISION, SMOLVLM_256M_IMAGES, scale_factor=4, weight_scale=1.0)
print(f"wrote {out}: {sum(f.stat().st_size for f in out.iterdir()) / 1e6:.0f} MB")
