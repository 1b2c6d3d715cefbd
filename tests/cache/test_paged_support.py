"""Which model-built masks the pages can serve: on full and chunked leaves one sequence per pass hands
the model exactly mlx-lm's keys; a rotating cache's key order is mlx-lm's own, so those are refused."""

from __future__ import annotations

from mlxpaged.cache.layout import KVLeaf, ModelLayout
from mlxpaged.cache.paged_support import serial_reason, unsupported_reasons


def _layout(*leaves: KVLeaf, batch_error: str | None = None) -> ModelLayout:
    return ModelLayout(
        "tiny", leaves, tuple(leaf.path for leaf in leaves), 32, 16, len(leaves), batch_error=batch_error
    )


def _leaf(i: int, kind: str, span: int | None, *consumers: str) -> KVLeaf:
    return KVLeaf((i,), kind, span, 2, 8, 8, "float32", consumers=consumers or ("sdpa",))


def test_model_built_masks_on_full_and_chunked_leaves_run_one_sequence_per_pass():
    layout = _layout(
        _leaf(0, "chunked", 8, "sdpa-masked"), _leaf(1, "full", None, "sdpa-masked"), _leaf(2, "full", None)
    )
    assert unsupported_reasons(layout) == []
    assert serial_reason(layout) == "layer 0, layer 1 attend with a mask the model builds from one sequence's positions"


def test_a_model_built_mask_over_a_rotating_window_is_refused_naming_the_layer():
    layout = _layout(_leaf(0, "full", None), _leaf(1, "window", 8, "sdpa-masked"))
    reasons = unsupported_reasons(layout)
    assert [r.label for r in reasons] == ["model-built mask"]
    assert reasons[0].text.startswith("layer 1 (window 8 attention")


def test_plain_layouts_batch_and_a_failing_batched_forward_does_not():
    assert serial_reason(_layout(_leaf(0, "full", None), _leaf(1, "window", 4))) is None
    reason = serial_reason(_layout(_leaf(0, "full", None), batch_error="TypeError: only integer scalar arrays"))
    assert reason == (
        "its forward fails on a batch of sequences at different offsets (TypeError: only integer scalar arrays)"
    )
