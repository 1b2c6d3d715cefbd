"""The load-time ragged-batch check: a model that reads positions off its keys is caught and run serially."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.loading.probe import probe_layout
from mlxpaged.runner.batch_check import batch_mismatch
from mlxpaged.runner.routing import route_paged_attention
from tests.archs.harness import build
from tests.tiny_models import tiny_llama

import mlx.core as mx


def check(model) -> str | None:
    route_paged_attention()
    return batch_mismatch(model, probe_layout(model), mx.float32, 8)


def test_a_plain_model_is_exact_in_a_ragged_batch():
    assert check(tiny_llama()) is None


def test_a_model_taking_rope_offsets_from_the_key_count_is_not():
    # afm7's KV-reuse layers rope queries at keys.shape[2] - L: padded page gathers shift them.
    assert "logits differ by" in check(build("afm7"))
