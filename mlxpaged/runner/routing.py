"""Routing mlx-lm (and mlx-vlm) attention to the paged cache.

mlx-lm model modules import `scaled_dot_product_attention` from `mlx_lm.models.base` by name,
and mlx-vlm's from `mlx_vlm.models.base` (same signature), so each module's binding is replaced.
The wrapper only acts on paged cache views; every other cache (the library's own) goes to that
library's original function untouched.

The rule (design14 D4) never trusts a guess about the model: a decode call reads the page pools
directly only when that is provably what mlx-lm would compute - the K/V passed are the very arrays
the view returned, the mask is None or one the pass's views made for full attention, and the
heads and widths fit the pools. Any other call (a mask the model built, K/V the model changed or
derived, prefill) attends over what the model passed, which the view gathered from the pages.
Sinks (gpt-oss) go through either way.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mlxpaged.cache.cache_view import PagedCacheView
from mlxpaged.kernels.attention import (
    eager_sdpa,
    kernel_attention_with_tail,
    paged_attention,
    paged_prefill_attention,
    reads_pages_in_place,
    reads_pools,
)
from mlxpaged.runner.decode_pass import DecodeView
from mlxpaged.runner.deferred_writes import DeferredView
from mlxpaged.vision.language import VisionLanguageModel

import mlx.core as mx
import mlx.nn as nn

_ORIGINAL_SDPA: Callable[..., mx.array] | None = None  # mlx-lm's, once routed
_ROUTED_MODULES: dict[str, object] = {}
_VLM_ROUTED: Callable[..., mx.array] | None = None  # the dispatcher for mlx-vlm's modules (falls back to its SDPA)
# The recorder of a calibration prefill on this thread (kv_calibration.py): another engine's thread may be attending.
_RECORDING = threading.local()


@contextmanager
def recording_attention(
    recorder: Callable[[int, mx.array, mx.array, mx.array, mx.array | None], None],
) -> Iterator[None]:
    """Within the block, every paged view's attention call hands `recorder` its layer, queries, the K/V it attends
    (the model's own coordinates) and sinks first: what a calibration prefill measures (runner/kv_calibration.py)."""
    previous = getattr(_RECORDING, "recorder", None)
    _RECORDING.recorder = recorder
    try:
        yield
    finally:
        _RECORDING.recorder = previous


def _routed_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    out = _paged_sdpa(queries, keys, values, cache, scale, mask, sinks)
    if out is not None:
        return out
    if _ORIGINAL_SDPA is None:  # only installed once it is set
        raise RuntimeError("mlx-lm's attention was never routed")
    return _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _routed_for(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """The dispatcher for another library's modules: paged views as `_routed_sdpa`, every other cache to
    `original` (that library's own SDPA, which knows its own cache kinds)."""

    def routed(queries, keys, values, cache, scale, mask, sinks=None):
        out = _paged_sdpa(queries, keys, values, cache, scale, mask, sinks)
        if out is not None:
            return out
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    return routed


def _paged_sdpa(queries, keys, values, cache, scale, mask, sinks) -> mx.array | None:
    """Attention through a paged view of any kind; None for any other cache."""
    if isinstance(cache, DeferredView):  # a decode pass queued ahead: pages, then the K/V not written yet
        if cache.on_kernel_path:  # the view returned only the tail: the kernel reads the pages in place
            if not cache.returned(keys, values) or not (mask is None or cache.made_mask(mask)):
                raise RuntimeError(
                    "a decode pass queued ahead: the model attends K/V or a mask other than its "
                    "cache gave; please report this model"
                )
            out = kernel_attention_with_tail(queries, *cache.kernel_inputs(), scale, sinks)
            if out is not None:
                return out
            keys, values = cache.gathered()  # a shape or variant the kernel declines: attend the gathered pages
        return eager_sdpa(queries, keys, values, scale, mask, sinks, cache.backend)
    if isinstance(cache, DecodeView):  # inside a compiled decode pass
        _check_compiled_call(keys, values, cache, mask)
        return cache.attend(queries, scale, sinks)
    if isinstance(cache, PagedCacheView):
        mask = cache.widened(mask, keys, values)
        recorder = getattr(_RECORDING, "recorder", None)
        if recorder is not None:
            recorder(cache.layer, queries, keys, values, sinks)
        pools = pool_inputs(queries, keys, values, cache, mask)
        pages = page_inputs(queries, keys, values, cache, mask) if pools is None else None
        if pools is None and pages is None:
            return eager_sdpa(queries, keys, values, scale, mask, sinks)  # K/V the view gathered: the model's own
        # The pools in place: in their own K/V coordinates (cache/kv_transform.py), the output mapped back.
        t, layer = cache.page_coordinates(), cache.layer
        q = queries if t is None else t.queries_in(layer, queries)
        if pools is not None:
            k_pool, v_pool, tables, lens = pools
            out = paged_attention(q, k_pool, v_pool, tables, lens, scale, sinks=sinks)
        else:
            assert pages is not None  # one of the two, checked above
            k_pool, v_pool, table, context = pages
            length = q.shape[2]
            out = paged_prefill_attention(q, k_pool, v_pool, table, context - length, length, scale, sinks=sinks)
        return out if t is None else t.output_out(layer, out)
    return None


def pool_inputs(queries: mx.array, keys: mx.array, values: mx.array, cache: PagedCacheView, mask) -> tuple | None:
    """(k_pool, v_pool, block_tables, context_lens) when attending the pools is the same computation
    as attending `keys`/`values` under `mask`; else None."""
    if not reads_pools():  # the fused path attends what the view gathered, under its own (or no) mask
        return None
    decode = cache.decode_inputs()  # one new token per sequence on a full-attention layer
    if decode is None or not cache.returned(keys, values):
        return None
    if mask is not None and not cache.made_mask(mask):
        return None
    k_pool, v_pool = decode[0], decode[1]
    heads, kv_heads = queries.shape[1], k_pool.shape[1]
    if queries.shape[-1] != k_pool.shape[-1] or heads % kv_heads or values.shape[-1] != v_pool.shape[-1]:
        return None
    return decode


def page_inputs(queries: mx.array, keys: mx.array, values: mx.array, cache: PagedCacheView, mask) -> tuple | None:
    """(k_pool, v_pool, block table, context) when a batch-1 prefill chunk may attend its pages in place
    (the view's own causal mask over the K/V it returned, and faster so: `reads_pages_in_place`); else None."""
    pages = cache.prefill_pages()
    if (
        pages is None
        or not cache.returned(keys, values)
        or not isinstance(mask, str)
        or mask != "causal"
        or not cache.made_mask(mask)
    ):
        return None
    k_pool, v_pool, _, context = pages
    if (
        queries.shape[-1] != k_pool.shape[-1]
        or queries.shape[1] % k_pool.shape[1]
        or values.shape[-1] != v_pool.shape[-1]
    ):
        return None
    return pages if reads_pages_in_place(queries, k_pool, v_pool, context) else None


def _check_compiled_call(keys, values, cache: DecodeView, mask) -> None:
    """A compiled pass reads the pools only (its views return the new K/V, not gathered pages), so a
    call it cannot honour must fail loudly instead of attending the wrong keys."""
    if not cache.returned(keys, values):
        raise RuntimeError(
            "compiled decode: the model attends K/V other than its cache returned; "
            "run with MLXPAGED_COMPILE=0 for this model"
        )
    if mask is not None:
        raise RuntimeError(
            "compiled decode: the model passed an attention mask it built itself; "
            "run with MLXPAGED_COMPILE=0 for this model"
        )


def route_paged_attention() -> int:
    """Point every loaded mlx-lm (and mlx-vlm, when it is imported) model module at the paged dispatcher;
    returns how many were patched. Idempotent; call after loading a model (its module is imported lazily)."""
    global _ORIGINAL_SDPA, _VLM_ROUTED
    import mlx_lm.models.base as base

    if _ORIGINAL_SDPA is None:
        _ORIGINAL_SDPA = base.scaled_dot_product_attention
    vlm_base = sys.modules.get("mlx_vlm.models.base")
    if vlm_base is not None and _VLM_ROUTED is None:
        _VLM_ROUTED = _routed_for(vlm_base.scaled_dot_product_attention)
    # Each library's SDPA -> its dispatcher (a module of either library may import either's by name).
    routes: list[tuple[Callable[..., mx.array], Callable[..., mx.array]]] = [(_ORIGINAL_SDPA, _routed_sdpa)]
    if vlm_base is not None and _VLM_ROUTED is not None:
        routes.append((vlm_base.scaled_dot_product_attention, _VLM_ROUTED))
    loaded: list[tuple[str, Any]] = list(sys.modules.items())  # Any: modules get an attribute set
    for name, module in loaded:
        if not name.startswith(("mlx_lm.models.", "mlx_vlm.models.")):
            continue
        bound = getattr(module, "scaled_dot_product_attention", None)
        for original, routed in routes:
            if bound is original:
                module.scaled_dot_product_attention = routed
                _ROUTED_MODULES[name] = module
    return len(_ROUTED_MODULES)


def is_routed(model: nn.Module) -> bool:
    """True when `model`'s attention layers call the paged dispatcher (their module was patched); a
    vision-language model's (vision/language.py) are its language model's."""
    attending = model.language_model if isinstance(model, VisionLanguageModel) else model
    module = sys.modules.get(type(attending).__module__)
    bound = getattr(module, "scaled_dot_product_attention", None) if module is not None else None
    return bound is not None and bound in (_routed_sdpa, _VLM_ROUTED)
