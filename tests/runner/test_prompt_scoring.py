"""Per-token log-probabilities through paged prefill passes (runner/prompt_scoring.py) against mlx-lm's own
forward: full precision over one contiguous pass, quantized pages against the quantized twin fed in the same
chunks; the KL between settings against the same two, in float64.

The twin takes the scoring pass's chunks because a quantizer turns float rounding into whole levels: OpenBLAS's
Haswell kernels round a matmul's row by how many rows share the call (issue 41), so K/V computed one token at a
time differ in their last bits from a 16-token chunk's, some elements round to the neighbouring level, and the
log-probs move by up to 1e-2 at 8 bits. Fed the same chunks, the twin quantizes the same numbers."""

from __future__ import annotations

import mlxpaged  # noqa: F401
from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.loading.probe import probe_layout
from mlxpaged.runner.kv_calibration import calibrate_kv_transform
from mlxpaged.runner.prompt_scoring import PageSetting, compare_scores, perplexity, token_logprobs
from tests.archs.quantized_reference import LAYER_ATTR, quantized_kv_caches
from tests.engine.test_engine import tokenizer  # noqa: F401
from tests.tiny_models import random_tokens, tiny_llama

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

TOKENS = random_tokens(45, seed=11)


CHUNK = 16  # the scoring passes' chunk in the quantized tests, and their twin's


def mlx_lm_logits(model, tokens: list[int], chunk: int | None = None, cache: list | None = None) -> mx.array:
    """The logits after each of tokens[:-1] from mlx-lm's model over `cache` (None: fresh caches), the whole text
    at once (chunk None) or `chunk` tokens a pass."""
    cache = make_prompt_cache(model) if cache is None else cache
    text = tokens[:-1]
    step = chunk or len(text)
    return mx.concatenate([model(mx.array([text[i : i + step]]), cache=cache)[0] for i in range(0, len(text), step)])


def mlx_lm_rows(model, tokens: list[int], chunk: int | None = None) -> np.ndarray:
    """Every position's log-softmax [len(tokens) - 1, vocab] (float64) from mlx-lm's model and caches, the whole
    text at once (chunk None) or `chunk` tokens a pass."""
    logits = mlx_lm_logits(model, tokens, chunk)
    rows = np.array(logits.astype(mx.float32), dtype=np.float64)
    top = rows.max(axis=1, keepdims=True)
    return rows - top - np.log(np.exp(rows - top).sum(axis=1, keepdims=True))


def mlx_lm_logprobs(model, tokens: list[int], chunk: int | None = None) -> np.ndarray:
    """log p(t[i + 1] | t[: i + 1]) from mlx-lm's model and caches, the whole text at once or `chunk` a pass."""
    rows = mlx_lm_rows(model, tokens, chunk)
    return rows[np.arange(len(tokens) - 1), tokens[1:]]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(head_dim=64)


def test_full_precision_scores_equal_mlx_lm_over_chunks(model):
    got = token_logprobs(model, probe_layout(model), TOKENS, mx.float32, None, block_size=8, chunk=7)
    want = mlx_lm_logprobs(model, TOKENS)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert perplexity(got) == pytest.approx(float(np.exp(-want.mean())), rel=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_scores_equal_the_quantized_twin(model, bits):
    quantization = KVQuantization(bits)
    got = token_logprobs(model, probe_layout(model), TOKENS, mx.float32, quantization, block_size=8, chunk=CHUNK)
    with quantized_kv_caches(bits, quantization.group_size):
        want = mlx_lm_logprobs(model, TOKENS, CHUNK)
    # The twin and the pages attend by different paths, float32 ulps apart: a K/V value that close to a rounding
    # boundary takes the neighbouring level on one side, and the positions after it move by ~1e-4-1e-3 (one of 44 at
    # 8 bits under OpenBLAS's SkylakeX kernels, 3.4e-4), against the quantization's own median effect of 0.055.
    diff = np.abs(got - want)
    assert np.median(diff) < 1e-5 and diff.max() < 1e-3, np.sort(diff)[-3:]
    full = mlx_lm_logprobs(model, TOKENS)
    assert np.abs(got - full).max() > 1e-2  # the quantization is really there, far beyond that


@pytest.mark.parametrize("bits", [8, 4])
def test_the_kl_from_full_precision_equals_float64_over_mlx_lm_and_the_twin(model, bits):
    layout = probe_layout(model)
    quantization = KVQuantization(bits)
    full, quantized = compare_scores(
        model, layout, TOKENS, mx.float32, [PageSetting(), PageSetting(quantization)], block_size=8, chunk=CHUNK
    )
    reference = mlx_lm_rows(model, TOKENS)
    with quantized_kv_caches(bits, quantization.group_size):
        twin = mlx_lm_rows(model, TOKENS, CHUNK)
    want = (np.exp(reference) * (reference - twin)).sum(axis=1)
    assert not full.kl.any()  # the reference against itself
    np.testing.assert_allclose(quantized.kl, want, atol=5e-5, rtol=0)  # KL(twin || full) misses by 4e-4 at 8 bits
    assert want.mean() > 1e-4  # there is a distance to measure
    full_alone = token_logprobs(model, layout, TOKENS, mx.float32, None, 8, CHUNK)
    np.testing.assert_allclose(full.logprobs, full_alone, atol=1e-6)
    quantized_alone = token_logprobs(model, layout, TOKENS, mx.float32, quantization, 8, CHUNK)
    np.testing.assert_allclose(quantized.logprobs, quantized_alone, atol=1e-6)  # side by side changes nothing


def test_models_it_cannot_score_are_refused():
    hybrid = tiny_llama(4, 0, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8)
    with pytest.raises(ValueError, match="full-attention models"):
        token_logprobs(hybrid, probe_layout(hybrid), TOKENS, mx.float32)


def test_4_bit_scores_in_calibrated_coordinates_equal_the_twin_in_them(model, tokenizer):
    """The engine's 4-bit coordinates (runner/kv_calibration.py): the twin round-trips K/V through the same ones."""
    layout = probe_layout(model)
    transform = calibrate_kv_transform(model, layout, tokenizer, mx.float32)
    quantization = KVQuantization(4)
    got = token_logprobs(model, layout, TOKENS, mx.float32, quantization, 8, CHUNK, transform=transform)
    with quantized_kv_caches(4, quantization.group_size, transform):
        cache = make_prompt_cache(model)
        for layer, c in enumerate(cache):
            setattr(c, LAYER_ATTR, layer)
        logits = mlx_lm_logits(model, TOKENS, CHUNK, cache)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = np.array(mx.take_along_axis(logprobs, mx.array(TOKENS[1:])[:, None], axis=1)[:, 0], dtype=np.float64)
    np.testing.assert_allclose(got, want, atol=1e-4)
    plain = token_logprobs(model, layout, TOKENS, mx.float32, quantization, 8, CHUNK)
    assert np.abs(got - plain).max() > 1e-4  # the coordinates change what 4 bits keep
