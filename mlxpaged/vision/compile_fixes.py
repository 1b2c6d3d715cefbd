"""mlx-vlm code that `mx.compile` cannot trace, replaced by equal code that it can.

MRoPE's sectioned layout (`mlx_vlm.models.rope_utils._section_frequency_layout`, GLM-4V's rotary embedding: every
layer lays out the shared cos / sin again) splits a computed array with `mx.split`; doing so twice in one compiled
function fails in MLX 0.32 with IndexError('_Map_base::at') (docs/design/scripts/issue37_mlx_split_compile.py
reproduces it with MLX alone), so the compiled decode pass of such a model could not be built. The replacement takes
the same sections by slicing: the same values, bit for bit (tests/vision/test_compile_fixes.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate, pairwise

import mlx.core as mx

_installed = False
replaced: dict[str, Callable] = {}  # mlx-vlm's own functions, by name, once `install` has put the twins in place


def section_frequency_layout(values: mx.array, mrope_section: Sequence[int]) -> mx.array:
    """mlx-vlm's `_section_frequency_layout` by slices: the last axis cut into the sections twice over (cos / sin
    halves), section i taken from plane i % 3 (time, rows, columns) of `values` [3, B, L, D], -> [B, 1, L, D]."""
    if len(mrope_section) != 3:
        raise ValueError("sectioned MRoPE expects exactly 3 sections")
    cuts = [0, *list(accumulate(list(mrope_section) * 2))[:-1], values.shape[-1]]  # mx.split's: the last to the end
    pieces = [values[i % 3][..., start:stop] for i, (start, stop) in enumerate(pairwise(cuts))]
    return mx.concatenate(pieces, axis=-1)[:, None, :, :]


def install() -> None:
    """Put the traceable twins in place of mlx-vlm's (once per process; a no-op without mlx-vlm's module)."""
    global _installed
    if _installed:
        return
    try:
        from mlx_vlm.models import rope_utils
    except ImportError:
        return
    if hasattr(rope_utils, "_section_frequency_layout"):
        replaced["_section_frequency_layout"] = rope_utils._section_frequency_layout
        rope_utils._section_frequency_layout = section_frequency_layout
    _installed = True
