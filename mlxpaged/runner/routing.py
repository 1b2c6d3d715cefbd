"""Routing mlx-lm attention to the paged cache.

mlx-lm model modules import `scaled_dot_product_attention` from `mlx_lm.models.base` by name,
so each module's binding is replaced. The wrapper only acts on paged cache views; every other
cache (mlx-lm's own) goes to the original function untouched.
"""

from __future__ import annotations

import sys

import mlx.nn as nn

from mlxpaged.cache.cache_view import PagedCacheView
from mlxpaged.kernels.attention import paged_attention, sdpa
from mlxpaged.runner.decode_pass import DecodeView


_ORIGINAL_SDPA = None
_ROUTED_MODULES: dict[str, object] = {}


def _routed_sdpa(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(cache, DecodeView) and sinks is None:  # inside a compiled decode pass
        return cache.attend(queries, scale)
    if isinstance(cache, PagedCacheView) and sinks is None:
        decode = cache.decode_inputs()
        if decode is not None:
            k_pool, v_pool, tables, lens = decode
            return paged_attention(queries, k_pool, v_pool, tables, lens, scale)
        return sdpa(queries, keys, values, scale, mask)  # prefill: the CPU's faster softmax too
    return _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def route_paged_attention() -> int:
    """Point every loaded mlx-lm model module at the paged dispatcher; returns how many were patched.
    Idempotent; call after loading a model (its module is imported lazily by mlx-lm)."""
    global _ORIGINAL_SDPA
    import mlx_lm.models.base as base

    if _ORIGINAL_SDPA is None:
        _ORIGINAL_SDPA = base.scaled_dot_product_attention
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is _ORIGINAL_SDPA:
            module.scaled_dot_product_attention = _routed_sdpa
            _ROUTED_MODULES[name] = module
    return len(_ROUTED_MODULES)


def is_routed(model: nn.Module) -> bool:
    """True when `model`'s attention layers call the paged dispatcher (their module was patched)."""
    module = sys.modules.get(type(model).__module__)
    return module is not None and getattr(module, "scaled_dot_product_attention", None) is _routed_sdpa
