"""The routing rule (runner/routing.py, design14 D4): a decode call reads the pools only when that is
provably mlx-lm's computation; every other call attends over the K/V the model passed, sinks included."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache.cache_view import paged_views
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.runner import routing
from mlxpaged.runner.decode_pass import DecodeView, _PassState
from tests.tiny_models import shuffled_blocks

import mlx.core as mx
import pytest

HEADS, KV_HEADS, DIM, BLOCK = 8, 2, 16, 8
SCALE = DIM**-0.5


@pytest.fixture
def calls(monkeypatch):
    """Which attention each routed call used: "pools" (paged_attention), "pages" (a prefill chunk's
    pages read in place: paged_prefill_attention) or "passed" (eager_sdpa over the K/V passed)."""
    used: list[str] = []
    pools, pages, passed = routing.paged_attention, routing.paged_prefill_attention, routing.eager_sdpa

    def on_pools(*args, **kwargs):
        used.append("pools")
        return pools(*args, **kwargs)

    def on_passed(*args, **kwargs):
        used.append("passed")
        return passed(*args, **kwargs)

    def on_pages(*args, **kwargs):
        used.append("pages")
        return pages(*args, **kwargs)

    monkeypatch.setattr(routing, "paged_attention", on_pools)
    monkeypatch.setattr(routing, "paged_prefill_attention", on_pages)
    monkeypatch.setattr(routing, "eager_sdpa", on_passed)
    return used


def decode_view(lengths: list[int], seed: int = 0):
    """One full-attention layer's view after a prefill of `lengths` tokens, fed one decode token per
    sequence; returns (view, new K/V it returned, queries, the view-made mask)."""
    kv = PagedKVCache(1, 32, BLOCK, KV_HEADS, DIM, mx.float32)
    free = shuffled_blocks(kv.num_blocks, seed)
    tables = [[[free.pop() for _ in range(-(-(n + 1) // BLOCK))]] for n in lengths]
    mx.random.seed(seed)
    longest = max(lengths)
    prefill = paged_views(kv, tables, [0] * len(lengths), lengths)[0]
    prefill.make_mask(longest)
    prefill.update_and_fetch(
        mx.random.normal((len(lengths), KV_HEADS, longest, DIM)),
        mx.random.normal((len(lengths), KV_HEADS, longest, DIM)),
    )
    view = paged_views(kv, tables, lengths)[0]
    mask = view.make_mask(1)
    keys, values = view.update_and_fetch(
        mx.random.normal((len(lengths), KV_HEADS, 1, DIM)), mx.random.normal((len(lengths), KV_HEADS, 1, DIM))
    )
    return view, keys, values, mx.random.normal((len(lengths), HEADS, 1, DIM)), mask


def mlx_lm_attention(queries, keys, values, mask, sinks=None) -> mx.array:
    """What mlx-lm computes over the K/V its cache returned (the view's gather)."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=SCALE, mask=mask, sinks=sinks)


@pytest.mark.parametrize("lengths", [[13], [5, 20, 9]], ids=["alone", "batched"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_decode_with_the_views_mask_reads_the_pools(calls, lengths, with_sinks):
    view, keys, values, queries, mask = decode_view(lengths)
    assert (mask is None) == (len(lengths) == 1)  # batched decode gets the ragged mask the view made
    sinks = mx.random.normal((HEADS,)) * 2 if with_sinks else None
    out = routing._routed_sdpa(queries, keys, values, view, SCALE, mask, sinks)
    assert calls == ["pools"]
    assert mx.allclose(out, mlx_lm_attention(queries, keys, values, mask, sinks), atol=1e-5).item()


def test_a_mask_the_model_built_attends_over_the_passed_keys(calls):
    view, keys, values, queries, _ = decode_view([5, 20])
    own = mx.arange(keys.shape[2]) % 3 != 1  # e.g. a chunk mask: not what the pools would apply
    own = own & (mx.arange(keys.shape[2]) < mx.array([6, 21])[:, None])
    own = own[:, None, None, :]
    sinks = mx.ones((HEADS,))
    out = routing._routed_sdpa(queries, keys, values, view, SCALE, own, sinks)
    assert calls == ["passed"]
    assert mx.allclose(out, mlx_lm_attention(queries, keys, values, own, sinks), atol=1e-5).item()


def test_a_windowed_mask_from_the_views_is_not_a_full_attention_mask(calls):
    view, keys, values, queries, _ = decode_view([5, 20])
    windowed = view.make_mask(1, window_size=4)
    out = routing._routed_sdpa(queries, keys, values, view, SCALE, windowed)
    assert calls == ["passed"]
    assert mx.allclose(out, mlx_lm_attention(queries, keys, values, windowed), atol=1e-5).item()


@pytest.mark.parametrize("change", ["keys", "values", "latent_values"])
def test_keys_or_values_the_model_changed_are_attended_as_passed(calls, change):
    """MLA passes a V derived from the cache, other models normalise K after the fetch: the pools
    would hold the wrong numbers."""
    view, keys, values, queries, mask = decode_view([13])
    if change == "keys":
        keys = keys * 0.5
    elif change == "values":
        values = values + 1.0
    else:
        values = keys[..., :8]  # narrower V, as MLA's latent split
    out = routing._routed_sdpa(queries, keys, values, view, SCALE, mask)
    assert calls == ["passed"]
    assert mx.allclose(out, mlx_lm_attention(queries, keys, values, mask), atol=1e-5).item()


def test_prefill_attends_over_the_gathered_keys(calls):
    kv = PagedKVCache(1, 8, BLOCK, KV_HEADS, DIM, mx.float32)
    view = paged_views(kv, [[[3, 1]]])[0]
    mask = view.make_mask(10)
    new = mx.random.normal((1, KV_HEADS, 10, DIM))
    keys, values = view.update_and_fetch(new, new + 1)
    queries = mx.random.normal((1, HEADS, 10, DIM))
    out = routing._routed_sdpa(queries, keys, values, view, SCALE, mask, mx.zeros((HEADS,)))
    assert calls == ["passed"] and view.decode_inputs() is None
    assert mx.allclose(out, mlx_lm_attention(queries, keys, values, mask, mx.zeros((HEADS,))), atol=1e-5).item()


def prefill_chunk(prefix: int, chunk: int, lengths_batch: int = 1, window: int | None = None):
    """A layer's view (full attention, or a sliding `window`) after `prefix` cached tokens per sequence,
    fed a `chunk`-token pass."""
    kv = PagedKVCache(1, 64, BLOCK, KV_HEADS, DIM, mx.float32, layer_windows=[window])
    free = shuffled_blocks(kv.num_blocks, 1)
    tables = [[[free.pop() for _ in range(-(-(prefix + chunk) // BLOCK))]] for _ in range(lengths_batch)]
    mx.random.seed(1)
    first = paged_views(kv, tables, [0] * lengths_batch)[0]
    first.make_mask(prefix)
    first.update_and_fetch(
        mx.random.normal((lengths_batch, KV_HEADS, prefix, DIM)),
        mx.random.normal((lengths_batch, KV_HEADS, prefix, DIM)),
    )
    view = paged_views(kv, tables, [prefix] * lengths_batch)[0]
    mask = view.make_mask(chunk)
    keys, values = view.update_and_fetch(
        mx.random.normal((lengths_batch, KV_HEADS, chunk, DIM)), mx.random.normal((lengths_batch, KV_HEADS, chunk, DIM))
    )
    return view, keys, values, mx.random.normal((lengths_batch, HEADS, chunk, DIM)), mask


@pytest.fixture
def numpy_everywhere(monkeypatch):
    """Tiny calls would stay under MIN_SCORES; routing must still choose as it does for big ones."""
    from mlxpaged.kernels import attention, numpy_attention

    monkeypatch.setattr(numpy_attention, "MIN_SCORES", 0)
    monkeypatch.setattr(attention, "resolved_backend", lambda: "cpu")


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_a_short_chunk_of_one_sequence_reads_its_pages_in_place(calls, numpy_everywhere, with_sinks):
    """A cache hit's few new tokens after a long prefix: the pages, not the gathered copy."""
    view, keys, values, queries, mask = prefill_chunk(300, 9)
    assert mask == "causal"
    sinks = mx.random.normal((HEADS,)) if with_sinks else None
    out = routing._routed_sdpa(queries, keys, values, view, SCALE, mask, sinks)
    assert calls == ["pages"]
    assert mx.allclose(out, mlx_lm_attention(queries, keys, values, mask, sinks), atol=1e-5).item()


def test_long_chunks_batches_and_other_masks_attend_the_gathered_keys(calls, numpy_everywhere):
    long_chunk = prefill_chunk(40, 100)  # more than one query block: gathered K/V are as fast
    batched = prefill_chunk(40, 9, lengths_batch=2)
    for view, keys, values, queries, mask in (long_chunk, batched):
        out = routing._routed_sdpa(queries, keys, values, view, SCALE, mask)
        assert mx.allclose(out, mlx_lm_attention(queries, keys, values, mask), atol=1e-5).item()
    view, keys, values, queries, mask = prefill_chunk(40, 9)
    own = mx.array(mask == "causal") & (mx.arange(49) % 2 == 0)[None]  # a mask the model built
    routing._routed_sdpa(queries, keys, values, view, SCALE, own)
    assert calls == ["passed", "passed", "passed"]


def test_only_full_attention_layers_of_one_sequence_offer_their_pages():
    """A window layer's keys are a ring's last positions, not pages 0.. of the table."""
    assert prefill_chunk(40, 9)[0].prefill_pages() is not None
    assert prefill_chunk(40, 9, window=256)[0].prefill_pages() is None
    assert prefill_chunk(40, 9, lengths_batch=2)[0].prefill_pages() is None


def test_a_mask_from_an_earlier_pass_is_not_this_passes():
    view, _keys, _values, _queries, old = decode_view([5, 20])
    new = view.make_mask(1)  # the next pass (offsets moved on) builds its own
    assert view.made_mask(new) and not view.made_mask(old)


def test_views_return_the_gathered_keys_in_decode():
    """The K/V a view returns in decode are the whole context, whatever consumes them."""
    view, keys, values, _, _ = decode_view([13])
    assert keys.shape == values.shape == (1, KV_HEADS, 14, DIM)
    assert view.returned(keys, values) and not view.returned(keys, values * 1)


def compiled_view() -> tuple[DecodeView, mx.array, mx.array]:
    pools = [mx.zeros((4, KV_HEADS, BLOCK, DIM))], [mx.zeros((4, KV_HEADS, BLOCK, DIM))]
    state = _PassState(mx.array([3]), mx.array([[0]]), *pools)
    view = DecodeView(state, 0)
    keys, values = view.update_and_fetch(mx.ones((1, KV_HEADS, 1, DIM)), mx.ones((1, KV_HEADS, 1, DIM)))
    return view, keys, values


def test_compiled_pass_attends_the_pools_with_sinks():
    view, keys, values = compiled_view()
    queries = mx.ones((1, HEADS, 1, DIM))
    out = routing._routed_sdpa(queries, keys, values, view, SCALE, None, mx.full((HEADS,), 100.0))
    assert mx.abs(out).max().item() < 1e-6  # a dominant sink takes all the weight, and has no value


def test_compiled_pass_refuses_calls_it_cannot_honour():
    view, keys, values = compiled_view()
    queries = mx.ones((1, HEADS, 1, DIM))
    with pytest.raises(RuntimeError, match=r"mask it built itself.*MLXPAGED_COMPILE=0"):
        routing._routed_sdpa(queries, keys, values, view, SCALE, mx.ones((1, 1, 1, 8), mx.bool_))
    with pytest.raises(RuntimeError, match="K/V other than its cache returned"):
        routing._routed_sdpa(queries, keys * 2, values, view, SCALE, None)
