"""A few mlx-lm architectures through the Embedder, one per way mlx-lm keeps the transformer body, against the
body called plainly (arch_sweep.py runs them all: `python -m tests.embedding.arch_sweep`)."""

from __future__ import annotations

from tests.embedding.arch_sweep import check_architecture

import pytest

# Body path -> an architecture that keeps it there; gemma3_text mixes sliding-window and full attention, qwen3_5
# has linear-attention state layers, mamba's body requires a cache.
EXACT = {
    "qwen3": "model",
    "gemma3_text": "model",
    "qwen3_5": "model",
    "gemma3": "language_model.model",
    "gpt_bigcode": "transformer",
    "mamba2": "backbone",
    "mamba": "backbone",
}


@pytest.mark.parametrize("module", sorted(EXACT))
def test_padded_and_chunked_passes_equal_the_plain_body(module):
    result = check_architecture(module)
    assert result["status"] == "exact", result
    assert result["body"] == EXACT[module]


def test_a_body_that_returns_logits_is_refused_with_the_reason():
    result = check_architecture("gpt_neox")  # mlx-lm's gpt_neox keeps its output projection inside `model`
    assert result["status"] == "refused"
    assert "model: returned shape [1, 1, 512], not hidden states" in result["reason"]
