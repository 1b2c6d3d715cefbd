"""The 4-bit coordinates' centers put position 0, the attention sink, on the grid (runner/kv_calibration.py): the
shift against its definition, the spread gate, the probe's batched rows against each token alone, and on the real
model a first token the probe never saw stored far closer to exact than with plain mean centers."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache import group_fit
from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.loading.loader import chat_prompt
from mlxpaged.loading.probe import probe_layout
from mlxpaged.runner import kv_calibration
from mlxpaged.runner.kv_calibration import calibrate_kv_transform, first_position_rows, sink_shift
from tests.tiny_models import tiny_llama

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

FOUR_BIT = KVQuantization(4)


def rounded(x: np.ndarray, dtype: mx.Dtype = mx.float32) -> np.ndarray:
    return np.array(group_fit.round_trip(mx.array(x, dtype=dtype), FOUR_BIT).astype(mx.float32), np.float64)


def rows_near(typical: np.ndarray, spread: float, count: int = 12, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return typical[None] + rng.normal(0, spread, (count, *typical.shape))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_the_shifted_typical_row_is_stored_as_itself_and_close_rows_nearly_so(dtype):
    typical = np.random.default_rng(0).normal(0, 1.5, (3, 64))
    rows = rows_near(typical, 1e-3)
    shift = sink_shift(rows, FOUR_BIT, dtype)
    assert np.abs(shift).max() > 0.01  # the mean itself is far off the grid
    level = (typical.max(axis=-1) - typical.min(axis=-1)) / 15  # one 4-bit step per head
    assert np.all(np.abs(shift).max(axis=-1) <= level)  # under a level: the other rows' center barely moves
    stored = np.array(mx.array(rows.mean(axis=0) - shift, dtype=dtype).astype(mx.float32), np.float64)
    tolerance = 1e-5 if dtype == mx.float32 else 2e-3  # float16's own step at these magnitudes
    assert np.abs(rounded(stored, dtype) - stored).max() < tolerance
    before = np.sqrt(np.mean((rounded(rows, dtype) - rows) ** 2))
    after = np.sqrt(np.mean((rounded(rows - shift, dtype) - (rows - shift)) ** 2))
    assert after < before / 10


def test_rows_that_spread_get_no_shift():
    typical = np.random.default_rng(0).normal(0, 1.5, (3, 64))
    error = np.sqrt(np.mean((rounded(typical) - typical) ** 2))
    wide = rows_near(typical, 2 * kv_calibration.SINK_MAX_SPREAD * error)
    assert not np.any(sink_shift(wide, FOUR_BIT, mx.float32))
    narrow = rows_near(typical, 0.05 * kv_calibration.SINK_MAX_SPREAD * error)
    assert np.any(sink_shift(narrow, FOUR_BIT, mx.float32))


def test_the_probe_reads_each_first_token_as_a_sequence_of_its_own():
    model = tiny_llama(3, seed=3, head_dim=64)
    tokens = [5, 17, 200]
    rows = first_position_rows(model, probe_layout(model), tokens, mx.float32, 16)
    assert sorted(rows) == [0, 1, 2]
    for i, token in enumerate(tokens):
        caches = [KVCache() for _ in model.layers]
        model(mx.array([[token]]), cache=caches)
        for layer, cache in enumerate(caches):
            k, v = rows[layer]
            assert k.shape == v.shape == (len(tokens), cache.keys.shape[1], 64)
            assert np.abs(k[i] - np.array(cache.keys[0, :, 0])).max() < 1e-5
            assert np.abs(v[i] - np.array(cache.values[0, :, 0])).max() < 1e-5


@pytest.mark.slow
def test_on_the_real_model_first_tokens_the_probe_never_saw_are_stored_near_exact(default_loaded):
    """A word's first token and the chat template's: in the layers whose centers moved, position 0's keys round
    to under an eighth of their error with the plain mean centers and its values to under half (measured: keys
    0.04-0.08, values 0.12-0.36 of it; values spread more between first tokens)."""
    bound = {"keys": 1 / 8, "values": 1 / 2}
    model, tokenizer = default_loaded.model, default_loaded.tokenizer
    layout = probe_layout(model)
    moved = calibrate_kv_transform(model, layout, tokenizer, mx.float32)
    plain = calibrate_kv_transform(model, layout, tokenizer, mx.float32, quantization=None)
    assert moved is not None and plain is not None
    first = [tokenizer.encode("Naomi")[0], chat_prompt(tokenizer, [{"role": "user", "content": "hi"}])[0]]
    assert not {tokenizer.encode(word)[0] for word in kv_calibration.SINK_PROBE_WORDS} & set(first)
    rows = first_position_rows(model, layout, first, mx.float32, 16)
    moved_layers = {"keys": 0, "values": 0}
    for layer, (new, old) in enumerate(zip(moved.layers, plain.layers, strict=True)):
        assert new is not None and old is not None
        assert np.array_equal(np.array(new.key_scale), np.array(old.key_scale))
        k0, v0 = (mx.array(a.astype(np.float32))[:, :, None] for a in rows[layer])  # [N, kv_heads, 1, D]
        for name, centers, stored in (
            ("keys", (new.key_center, old.key_center), [t.keys_in(layer, k0) for t in (moved, plain)]),
            ("values", (new.value_center, old.value_center), [t.values_in(layer, v0) for t in (moved, plain)]),
        ):
            if np.array_equal(np.array(centers[0]), np.array(centers[1])):
                continue  # this layer's rows spread too much: its centers stay the means
            moved_layers[name] += 1
            new_error, plain_error = (np.sqrt(np.mean((rounded(x) - x) ** 2)) for x in map(np.array, stored))
            assert new_error < plain_error * bound[name], (layer, name, new_error, plain_error)
    assert min(moved_layers.values()) >= len(moved.layers) // 2  # SmolLM2-135M: every layer from 12 on
