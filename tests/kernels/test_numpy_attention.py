"""Prefill attention computed by NumPy (kernels/numpy_attention.py) against the NumPy float64 oracle,
and the dispatch that sends only big eager calls there."""

import mlxpaged  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest
from threadpoolctl import threadpool_info

from mlxpaged.kernels import attention, numpy_attention
from mlxpaged.kernels.numpy_attention import QUERY_BLOCK, attend_numpy, numpy_attention_applies
from tests.msl.oracle import attend as oracle_attend
from tests.msl.oracle import causal_oracle, max_error, quantize, random_sinks


def case(seed: int, batch: int, heads: int, kv_heads: int, length: int, keys: int, dim: int, v_dim: int | None = None,
         dtype: str = "float32"):
    rng = np.random.default_rng(seed)
    q, q64 = quantize(rng.standard_normal((batch, heads, length, dim)), dtype)
    k, k64 = quantize(rng.standard_normal((batch, kv_heads, keys, dim)), dtype)
    v, v64 = quantize(rng.standard_normal((batch, kv_heads, keys, v_dim or dim)), dtype)
    return rng, (q, k, v), (q64, k64, v64)


@pytest.mark.parametrize("length,keys", [(1, 1), (5, 5), (QUERY_BLOCK - 1, QUERY_BLOCK - 1), (QUERY_BLOCK, QUERY_BLOCK),
                                         (QUERY_BLOCK + 1, QUERY_BLOCK + 1), (200, 200), (130, 400), (8, 1000)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (8, 1, 96)])
def test_causal_across_query_blocks(length, keys, heads, kv_heads, head_dim):
    """Bottom-right causal: queries sit at the end of the keys (a chunk after a cached prefix)."""
    _, (q, k, v), (q64, k64, v64) = case(length * 1000 + keys + heads, 1, heads, kv_heads, length, keys, head_dim)
    out = attend_numpy(q, k, v, head_dim ** -0.5, "causal")
    expected = causal_oracle(q64[0], k64[0], v64[0], head_dim ** -0.5, query_offset=keys - length)
    assert max_error(out, expected[None]) < 1e-5


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "per_head", "none"])
def test_ragged_batch_masks(mask_kind):
    """A ragged batch's masks (cache_view._ragged_mask is boolean [B, 1, L, K]), additive and per-head ones."""
    batch, heads, kv_heads, length, keys = 3, 8, 2, 70, 137
    rng, (q, k, v), (q64, k64, v64) = case(3, batch, heads, kv_heads, length, keys, 64)
    allowed = rng.random((batch, heads if mask_kind == "per_head" else 1, length, keys)) > 0.3
    allowed[..., 0] = True  # every row sees a key
    if mask_kind == "none":
        allowed[:] = True
    mask = {"bool": mx.array(allowed), "per_head": mx.array(allowed), "none": None,
            "additive": mx.array(np.where(allowed, 0.0, -np.inf).astype(np.float32))}[mask_kind]
    out = attend_numpy(q, k, v, 0.125, mask)
    group = heads // kv_heads

    def one_head(b, h):
        kv = slice(h // group, h // group + 1)
        return oracle_attend(q64[b, h:h + 1], k64[b, kv], v64[b, kv], 0.125, allowed[b, h % allowed.shape[1]])[0]

    expected = np.stack([np.stack([one_head(b, h) for h in range(heads)]) for b in range(batch)])
    assert max_error(out, expected) < 1e-5


@pytest.mark.parametrize("mask", ["causal", None])
def test_sinks_and_value_width(mask):
    """gpt-oss sinks join each head's max and denominator; V may be narrower than K (latent attention)."""
    heads, kv_heads, length, keys = 8, 2, 90, 150
    rng, (q, k, v), (q64, k64, v64) = case(7, 1, heads, kv_heads, length, keys, 64, v_dim=32)
    sinks, sinks64 = random_sinks(rng, heads)
    out = attend_numpy(q, k, v, 0.125, mask, sinks)
    if mask == "causal":
        expected = causal_oracle(q64[0], k64[0], v64[0], 0.125, query_offset=keys - length, sinks64=sinks64)
    else:
        expected = oracle_attend(q64[0], k64[0], v64[0], 0.125, np.ones((length, keys), bool), sinks64)
    assert out.shape == (1, heads, length, 32)
    assert max_error(out, expected[None]) < 1e-5


def test_half_precision_inputs_keep_their_dtype():
    _, (q, k, v), (q64, k64, v64) = case(11, 1, 4, 2, 40, 40, 64, dtype="bfloat16")
    out = attend_numpy(q, k, v, 0.125, "causal")
    assert out.dtype == mx.bfloat16
    assert max_error(out, causal_oracle(q64[0], k64[0], v64[0], 0.125)[None]) < 1e-2


def test_the_call_leaves_blas_threads_as_it_found_them():
    before = [lib["num_threads"] for lib in threadpool_info()]
    _, (q, k, v), _ = case(1, 1, 9, 3, 300, 300, 64)
    attend_numpy(q, k, v, 0.125, "causal")
    assert [lib["num_threads"] for lib in threadpool_info()] == before


def test_which_calls_apply():
    q = mx.zeros((1, 9, 512, 64))
    assert numpy_attention_applies(q, mx.zeros((1, 3, 512, 64)), "causal")
    assert not numpy_attention_applies(q[:, :, :8], mx.zeros((1, 3, 8, 64)), "causal")  # too small for a sync
    assert not numpy_attention_applies(q, mx.zeros((1, 3, 100, 64)), "causal")  # queries no key would see
    assert not numpy_attention_applies(q, mx.zeros((1, 2, 512, 64)), None)  # 9 heads over 2 KV heads


def test_eager_sdpa_sends_big_calls_to_numpy_and_small_ones_to_mlx(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "attend_numpy", lambda *a, **kw: calls.append("numpy") or mx.zeros((1,)))
    monkeypatch.setattr(attention, "attend", lambda *a, **kw: calls.append("mlx") or mx.zeros((1,)))
    monkeypatch.setattr(attention, "resolved_backend", lambda: "cpu")
    big, small = mx.zeros((1, 9, 512, 64)), mx.zeros((1, 9, 4, 64))
    attention.eager_sdpa(big, mx.zeros((1, 3, 512, 64)), mx.zeros((1, 3, 512, 64)), 0.125, "causal")
    attention.eager_sdpa(small, mx.zeros((1, 3, 4, 64)), mx.zeros((1, 3, 4, 64)), 0.125, "causal")
    attention.sdpa(big, mx.zeros((1, 3, 512, 64)), mx.zeros((1, 3, 512, 64)), 0.125, "causal")  # compiled passes
    assert calls == ["numpy", "mlx", "mlx"]


def test_agrees_with_the_mlx_path_at_the_threshold(monkeypatch):
    """Just above MIN_SCORES both paths are in use in one engine; they must give the same numbers."""
    from mlxpaged.kernels.cpu_attention import attend

    length = -(-numpy_attention.MIN_SCORES // (9 * 256))
    _, (q, k, v), _ = case(5, 1, 9, 3, length, 256, 64)
    assert numpy_attention_applies(q, k, "causal")
    assert mx.allclose(attend_numpy(q, k, v, 0.125, "causal"), attend(q, k, v, 0.125, "causal"), atol=1e-5).item()
