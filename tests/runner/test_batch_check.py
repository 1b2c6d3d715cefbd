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


class PinnedLogits:
    """A model that sets some logits to `value` after its forward, as phi3small sets its reserved ids' to -inf."""

    def __init__(self, model, ids: list[int], value: float):
        self.inner, self.ids, self.value = model, mx.array(ids), value

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, inputs, cache=None):
        out = self.inner(inputs, cache=cache)
        out[..., self.ids] = self.value
        return out


def test_logits_pinned_to_minus_infinity_agree():
    assert check(PinnedLogits(tiny_llama(), [0, 5, 7], -float("inf"))) is None  # inf - inf is no difference


def test_nan_logits_never_agree():
    assert "not finite" in check(PinnedLogits(tiny_llama(), [3], float("nan")))
