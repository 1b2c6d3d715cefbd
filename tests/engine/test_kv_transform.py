"""4-bit pages' K/V coordinates (cache/kv_transform.py, runner/kv_calibration.py): exact in full precision, the
quantized paths against a float64 oracle that maps the stored numbers back itself, the engine against mlx-lm's
own caches round-tripping K/V through the same coordinates, and the disk tier's fingerprint."""

from __future__ import annotations

import dataclasses

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache.cache_view import paged_views
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.cache.kv_transform import KVTransform, rope_pairs_equal
from mlxpaged.engine import build
from mlxpaged.kernels.attention import eager_sdpa, paged_attention
from mlxpaged.loading.probe import probe_layout
from mlxpaged.runner.kv_calibration import calibrate_kv_transform
from mlxpaged.runner.prompt_scoring import token_logprobs
from mlxpaged.runner.routing import route_paged_attention
from tests.archs.quantized_reference import assert_greedy_matches
from tests.engine.test_disk_tier_engine import disk_engine
from tests.engine.test_engine import GREEDY, tiny_engine, tokenizer  # noqa: F401
from tests.msl.quantized_oracle import dequantize64
from tests.tiny_models import random_tokens, tiny_llama

import mlx.core as mx
import numpy as np
import pytest

PROMPTS = [random_tokens(n, seed=s) for s, n in enumerate((40, 11, 23))]
KVH, HEADS, D = 2, 4, 64


def hadamard64(n: int = D) -> np.ndarray:
    """The oracle's own Sylvester construction (Kronecker powers of the 2x2 one)."""
    h = np.array([[1.0]])
    for _ in range(int(np.log2(n))):
        h = np.kron(h, np.array([[1.0, 1.0], [1.0, -1.0]]))
    return h / np.sqrt(n)


def random_arrays(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    half = np.exp(rng.normal(0, 1, (KVH, D // 2)))
    scale = np.concatenate([half, half], axis=1)  # equal within RoPE's (i, i + D/2) pairs
    return scale, rng.normal(0, 2, (KVH, D)), rng.normal(0, 2, (KVH, D))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attend64(q, k, v, scale):
    """float64 attention, GQA query head i on KV head i // group, causal over the last len(q) positions."""
    group = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    s = np.einsum("hld,hkd->hlk", q, k) * scale
    n, lq = k.shape[1], q.shape[1]
    s = np.where(np.arange(n)[None, None, :] <= (n - lq + np.arange(lq))[None, :, None], s, -np.inf)
    return np.einsum("hlk,hkd->hld", softmax(s), v)


def test_the_coordinates_keep_every_score_gap_and_output():
    scale, kc, vc = random_arrays(0)
    t = KVTransform.from_arrays([(scale, kc, vc)])
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(HEADS, 5, D)), rng.normal(size=(KVH, 9, D)), rng.normal(size=(KVH, 9, D))
    as_mx = [mx.array(a.astype(np.float32))[None] for a in (q, k, v)]
    q2, k2, v2 = t.queries_in(0, as_mx[0]), t.keys_in(0, as_mx[1]), t.values_in(0, as_mx[2])
    h = hadamard64()
    # stored coordinates, as the oracle computes them
    assert np.allclose(np.array(k2[0]), (k * scale[:, None]) @ h - kc[:, None], atol=1e-4)
    assert np.allclose(np.array(v2[0]), v @ h - vc[:, None], atol=1e-4)
    assert np.allclose(np.array(t.keys_out(0, k2)[0]), k, atol=1e-4)
    assert np.allclose(np.array(t.values_out(0, v2)[0]), v, atol=1e-4)
    want = attend64(q, k, v, 0.125)
    stored = attend64(*(np.array(a[0], dtype=np.float64) for a in (q2, k2, v2)), 0.125)
    got = np.array(t.output_out(0, mx.array(stored.astype(np.float32))[None])[0])
    assert np.abs(got - want).max() < 1e-4
    assert np.abs(stored - want).max() > 0.1  # the stored coordinates do differ


@pytest.fixture(scope="module")
def model():
    return tiny_llama(3, seed=3, head_dim=D)


@pytest.fixture(scope="module")
def calibrated(model, tokenizer):
    return calibrate_kv_transform(model, probe_layout(model), tokenizer, mx.float32)


def test_calibration_balances_each_rope_pair_and_centers(calibrated, model):
    assert calibrated is not None and len(calibrated.layers) == len(model.layers)
    for layer in calibrated.layers:
        assert layer is not None
        scale = np.array(layer.key_scale)
        assert rope_pairs_equal(scale, traditional=False) and not np.allclose(scale, 1.0)
        assert np.abs(np.array(layer.key_center)).max() > 0 and np.abs(np.array(layer.value_center)).max() > 0


def test_full_precision_pages_in_the_coordinates_score_the_same(model, tokenizer, calibrated):
    """Forced on at full precision (no rounding), the coordinates change no log-probability."""
    layout = probe_layout(model)
    tokens = random_tokens(70, seed=9)
    plain = token_logprobs(model, layout, tokens, mx.float32, chunk=32)
    moved = token_logprobs(model, layout, tokens, mx.float32, chunk=32, transform=calibrated)
    assert np.abs(plain - moved).max() < 1e-4


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_full_precision_engine_in_the_coordinates_decodes_the_same(model, tokenizer, calibrated, monkeypatch, compiled):
    monkeypatch.setenv("MLXPAGED_COMPILE", compiled)
    scored = dataclasses.replace(GREEDY, logprobs=True)
    with tiny_engine(model, tokenizer) as engine:
        want = engine.generate(PROMPTS, scored)
    monkeypatch.setattr(build, "transform_for", lambda *args, **kwargs: calibrated)
    with tiny_engine(model, tokenizer) as engine:
        assert engine.kv.transform is calibrated and engine.kv.quantization is None
        got = engine.generate(PROMPTS, scored)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_quantized_pages_in_the_coordinates_against_a_float64_oracle():
    """4-bit pages in the coordinates: a prefill chunk (gathered K/V and in place), then a decode step on the
    pools, against float64 attention over the stored numbers mapped back by the oracle itself."""
    route_paged_attention()
    rng = np.random.default_rng(3)
    n = 21
    q, k, v = rng.normal(size=(HEADS, n + 1, D)), rng.normal(size=(KVH, n + 1, D)), rng.normal(size=(KVH, n + 1, D))
    k += rng.normal(0, 4, (KVH, 1, D))  # a common component, as real keys carry
    h = hadamard64()
    half = np.exp(rng.normal(0, 0.3, (KVH, D // 2)))
    scale = np.concatenate([half, half], axis=1)
    kc, vc = ((k * scale[:, None]) @ h).mean(axis=1), (v @ h).mean(axis=1)  # what calibration would find
    t = KVTransform.from_arrays([(scale, kc, vc)])
    kv = PagedKVCache(1, 8, 8, KVH, D, quantization=KVQuantization(4, 64), transform=t)
    f32 = [mx.array(a.astype(np.float32))[None] for a in (q, k, v)]
    table = list(range(8))
    (view,) = paged_views(kv, [[table]])
    mask = view.make_mask(n)
    keys, values = view.update_and_fetch(f32[1][:, :, :n], f32[2][:, :, :n])
    prefill = eager_sdpa(f32[0][:, :, :n], keys, values, 0.125, mask, None)  # the gathered K/V: model coordinates
    mx.eval(prefill, kv.pools)
    (view,) = paged_views(kv, [[table]], offsets=[n])
    view.update_and_fetch(f32[1][:, :, n:], f32[2][:, :, n:])
    step = t.output_out(
        0,
        paged_attention(
            t.queries_in(0, f32[0][:, :, n:]), kv.key_pool(0), kv.value_pool(0), mx.array([table]), [n + 1], 0.125
        ),
    )
    stored_k = dequantize64(kv.key_pool(0))[:3].transpose(1, 0, 2, 3).reshape(KVH, 24, D)[:, : n + 1]
    stored_v = dequantize64(kv.value_pool(0))[:3].transpose(1, 0, 2, 3).reshape(KVH, 24, D)[:, : n + 1]
    k64 = ((stored_k + kc[:, None]) @ h) / scale[:, None]
    v64 = (stored_v + vc[:, None]) @ h
    want = attend64(q, k64, v64, 0.125)
    assert np.abs(np.array(prefill[0]) - want[:, :n]).max() < 1e-4
    assert np.abs(np.array(step[0]) - want[:, n:]).max() < 1e-4
    unrounded = attend64(q, k, v, 0.125)
    assert 1e-3 < np.abs(want - unrounded).max() < 0.5  # 4-bit rounding shows, within its known error


def test_engine_on_4_bit_pages_equals_mlx_lm_over_the_same_coordinates(model, tokenizer):
    with tiny_engine(model, tokenizer, kv_bits=4) as engine:
        got = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
        transform = engine.kv.transform
    assert transform is not None
    assert_greedy_matches(got, model, PROMPTS, 4, group_size=64, transform=transform)


def test_the_disk_fingerprint_names_the_coordinates(model, tokenizer, tmp_path, monkeypatch):
    facts: list[dict] = []
    real = build.model_fingerprint
    monkeypatch.setattr(build, "model_fingerprint", lambda w, **f: facts.append(f) or real(w, **f))
    for setting in ("1", "0"):
        monkeypatch.setenv("MLXPAGED_KV_TRANSFORM", setting)
        with disk_engine(model, tokenizer, tmp_path / "model", tmp_path / "disk", kv_bits=4) as engine:
            digest = None if engine.kv.transform is None else engine.kv.transform.digest()
        assert facts[-1]["kv_transform"] == digest
    assert facts[0]["kv_transform"] is not None and facts[1]["kv_transform"] is None
    other = KVTransform.from_arrays([random_arrays(5)])
    assert other.digest() != KVTransform.from_arrays([random_arrays(6)]).digest()
