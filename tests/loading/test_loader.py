"""The baseline (mlx-lm) generate path on the real embedded model."""

from __future__ import annotations

from mlxpaged.loading.loader import baseline_stream, chat_prompt

import pytest


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(default_loaded):
    prompt = chat_prompt(default_loaded.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    text = "".join(r.text for r in baseline_stream(default_loaded, prompt, max_tokens=20, temperature=0.0))
    assert "Paris" in text, text


def test_default_model_is_float32_on_cpu(default_loaded):
    from mlxpaged.platform import backend

    import mlx.core as mx

    if backend.is_gpu():
        pytest.skip("float16 on a GPU; this checks the CPU store")
    assert default_loaded.dtype == "float32"
    assert default_loaded.model.model.embed_tokens.weight.dtype == mx.float32
