"""The traceable twins of mlx-vlm code `mx.compile` cannot trace (vision/compile_fixes.py): equal values, and a
compiled function that lays out one computed array twice, as GLM-4V's layers do, builds."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.vision import compile_fixes

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models import rope_utils


@pytest.mark.parametrize(
    ("section", "width"), [([2, 1, 1], 8), ([8, 12, 12], 64), ([16, 24, 24], 128), ([2, 1, 1], 10)]
)
def test_the_sectioned_layout_by_slices_equals_mlx_vlms(section, width):
    compile_fixes.install()
    values = mx.random.normal((3, 2, 5, width))
    want = compile_fixes.replaced["_section_frequency_layout"](values, section)  # mlx-vlm's own (mx.split)
    got = compile_fixes.section_frequency_layout(values, section)
    np.testing.assert_array_equal(np.array(got), np.array(want))


def _split_layout(values, section):
    """mlx-vlm's own layout, uncompiled."""
    compile_fixes.install()
    return compile_fixes.replaced["_section_frequency_layout"](values, section)


def computed_twice(layout):
    """A rotary table computed inside the function as GLM-4V's is, laid out twice (two layers' attention)."""
    inv = mx.array([1.0, 0.5, 0.25, 0.125])

    def forward(positions):
        expanded = mx.broadcast_to(inv[None, None, :, None], (3, positions.shape[1], 4, 1))
        freqs = (expanded @ positions[:, :, None, :].astype(mx.float32)).transpose(0, 1, 3, 2)
        cos = mx.cos(mx.concatenate((freqs, freqs), axis=-1)) * 1.0
        return layout(cos, [2, 1, 1]), layout(cos, [2, 1, 1])

    return forward


POSITIONS = mx.broadcast_to(mx.arange(3)[None, None], (3, 1, 3))


def test_a_compiled_pass_laying_out_one_computed_table_twice_builds_with_the_twin():
    got = mx.compile(computed_twice(compile_fixes.section_frequency_layout))(POSITIONS)
    want = computed_twice(_split_layout)(POSITIONS)  # eager: mlx-vlm's own runs
    np.testing.assert_array_equal(np.array(got[0]), np.array(want[0]))


def test_installing_puts_the_twin_in_mlx_vlms_module():
    compile_fixes.install()
    assert rope_utils._section_frequency_layout is compile_fixes.section_frequency_layout


def test_mlx_cannot_compile_mlx_vlms_own_layout_twice():
    """The evidence for the twin (MLX 0.32): when this passes, MLX traces mx.split twice again and the twin can go."""
    with pytest.raises(IndexError):
        mx.eval(mx.compile(computed_twice(_split_layout))(POSITIONS))
