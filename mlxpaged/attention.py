"""Paged attention entry point: the Metal kernel on Apple GPUs, the CPU path on MLX's CPU backend,
the pure-MLX reference as the oracle and fallback.

The engine's routed attention calls ``paged_attention`` for decode passes (one new token per
sequence: the pages are read in place by the kernel) and ``sdpa`` for prefill and chunked prefill
(over the K/V the cache view gathered). ``paged_prefill_attention`` is the same prefill computed
straight from the pages, for tests and future kernels. Shapes:

- K/V pools, per layer: ``[num_blocks, num_kv_heads, block_size, head_dim]``; token ``t`` of a
  sequence is at ``pool[table[t // block_size], :, t % block_size, :]``. A call reads the pools
  only; new K/V are written by the cache (indexed assignment) *before* attending.
- ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA: query head ``h`` reads KV head
  ``h // (num_heads // num_kv_heads)``).
- ``window``: ``None`` for full attention, else a query at position ``p`` sees keys ``p-window+1 .. p``.

Backend choice: ``set_attention_backend`` / ``attention_backend(...)`` or the environment variable
``MLXPAGED_ATTENTION`` = ``auto`` (default: ``kernel`` when MLX runs on a Metal GPU, else ``cpu``),
``kernel``, ``cpu`` (kernels/cpu_attention.py: pages read in place with ``mx.gather_mm`` and a
cheaper softmax) or ``reference`` (gathered pages + ``mx.fast.scaled_dot_product_attention``).
Forcing ``kernel`` without Metal raises; shapes a fast path does not support (kernel: see
``kernel_supports``; cpu: pools that are not float32) run on the reference path.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx

from mlxpaged.kernels.cpu_attention import attend, decode_attention_cpu, paged_attention_cpu
from mlxpaged.kernels.reference import attend_pages, paged_attention_reference, paged_prefill_attention_reference

ENV_VAR = "MLXPAGED_ATTENTION"
BACKENDS = ("auto", "kernel", "cpu", "reference")

_override: str | None = None


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def set_attention_backend(name: str | None) -> None:
    """Force "kernel" or "reference" ("auto" or None: back to the environment / automatic choice)."""
    global _override
    _override = None if name is None else _check_backend(name)


@contextmanager
def attention_backend(name: str) -> Iterator[None]:
    """Temporarily force a backend (tests, benchmarks)."""
    global _override
    previous = _override
    set_attention_backend(name)
    try:
        yield
    finally:
        _override = previous


def metal_available() -> bool:
    return bool(mx.metal.is_available()) and mx.default_device().type == mx.gpu


def resolved_backend() -> str:
    """"kernel", "cpu" or "reference": what ``paged_attention`` would use for supported shapes."""
    name = _override or _check_backend(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto")
    if name == "auto":
        return "kernel" if metal_available() else "cpu"
    if name == "kernel" and not metal_available():
        raise RuntimeError(f"the Metal paged-attention kernel was forced ({ENV_VAR} or "
                           "set_attention_backend) but MLX has no Metal GPU here")
    return name


def _float32(k_pool: mx.array, v_pool: mx.array) -> bool:
    """The CPU path's pools: float32, the CPU backend's fast dtype (others take the reference)."""
    return k_pool.dtype == mx.float32 and v_pool.dtype == mx.float32


def paged_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array,
                    context_lens: mx.array, scale: float, window: int | None = None) -> mx.array:
    """Decode: one query token per sequence over its pages.

    q [B, num_heads, 1, D]; block_tables [B, max_blocks] int32 (entries past a sequence's blocks
    are ignored; keep the table no wider than the longest sequence needs); context_lens [B] int32
    (an mx.array, or a tuple of ints), tokens in the pool including the current one (0 gives a
    zero output).
    Returns [B, num_heads, 1, D] in q's dtype.
    """
    backend = resolved_backend()
    if backend == "kernel":
        from mlxpaged.kernels.paged_attention import kernel_supports, paged_attention_metal

        if kernel_supports(q, k_pool, v_pool, block_tables, window):
            return paged_attention_metal(q, k_pool, v_pool, block_tables, context_lens, scale, window)
    if backend == "cpu" and _float32(k_pool, v_pool):
        return paged_attention_cpu(q, k_pool, v_pool, block_tables, context_lens, scale, window)
    return paged_attention_reference(q, k_pool, v_pool, block_tables, context_lens, scale, window)


def sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
    """Attention over contiguous K/V (prefill over the K/V a cache view gathered), with
    ``mx.fast.scaled_dot_product_attention``'s contract; ``cpu_attention.attend`` on the cpu backend."""
    if resolved_backend() == "cpu":
        return attend(q, k, v, scale, mask)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def paged_prefill_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, block_table,
                            prefix_len: int, chunk_len: int, scale: float,
                            window: int | None = None) -> mx.array:
    """Prefill / chunked prefill of one request: ``chunk_len`` new queries after ``prefix_len`` cached tokens.

    q [1, num_heads, chunk_len, D]; block_table [n_blocks] int32 covering at least
    ``prefix_len + chunk_len`` tokens; the chunk's K/V must already be in the pool. Query ``i``
    sits at position ``prefix_len + i`` (causal offset). Returns [1, num_heads, chunk_len, D].
    Pure MLX on every backend (see reference.py for where a Metal varlen kernel would go).
    """
    return paged_prefill_attention_reference(q, k_pool, v_pool, block_table, prefix_len, chunk_len,
                                             scale, window)


def decode_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, rows: mx.array, mask: mx.array,
                     scale: float) -> mx.array:
    """Decode attention from array inputs only, for compiled passes (no host lengths): ``rows``
    [B, KVH, nb] page rows (``reference.page_rows``), ``mask`` [B, 1, 1, nb * BS] bool (key in the
    sequence; every sequence has at least one). Same result as ``paged_attention``."""
    if resolved_backend() == "cpu" and _float32(k_pool, v_pool):
        return decode_attention_cpu(q, k_pool, v_pool, rows, mask, scale)
    return attend_pages(q, k_pool, v_pool, rows, mask, scale)
