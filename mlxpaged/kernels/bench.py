"""``mlxpaged bench kernel``: paged decode attention against contiguous SDPA.

For each (context, batch) it times contiguous ``mx.fast.scaled_dot_product_attention`` over
[B, kv_heads, context, D] caches, the reference paged path (gather pages + SDPA) over a shuffled
page pool, and the fast path: the paged kernel on a GPU (the Metal source on a Mac, its CUDA twin on MLX's CUDA
backend, where the engine takes it with MLXPAGED_ATTENTION=kernel), the CPU path (kernels/cpu_attention.py) on
MLX's CPU backend. Ratios are paged time / contiguous time.
Timings are medians of interleaved runs; nothing here asserts on them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from mlxpaged.config import DEFAULT_BLOCK_SIZE
from mlxpaged.kernels.cpu_attention import paged_attention_cpu
from mlxpaged.kernels.reference import paged_attention_reference
from mlxpaged.platform import backend as compute_backend

import mlx.core as mx
import numpy as np

DEFAULT_CONTEXTS = (512, 1024, 2048, 4096, 8192)
DEFAULT_BATCHES = (1, 4, 16)


@dataclass(frozen=True)
class BenchShape:
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: str = "float32"


@dataclass(frozen=True)
class KernelBenchRow:
    context: int
    batch: int
    contiguous_ms: float
    reference_ms: float
    fast_ms: float
    fast_path: str  # "kernel" (Metal or CUDA) or "cpu"

    @property
    def reference_ratio(self) -> float:
        return self.reference_ms / self.contiguous_ms

    @property
    def fast_ratio(self) -> float:
        return self.fast_ms / self.contiguous_ms


def time_interleaved(
    fns: Mapping[str, Callable[[], object]], min_seconds: float = 0.5, min_repeats: int = 5, max_repeats: int = 100
) -> dict[str, float]:
    """Median ms of ``mx.eval(fn())`` per function, after a warm-up call each.

    The functions take turns, so a noisy neighbour on a shared machine hits all of them alike
    and the ratios stay meaningful even when the absolute times drift.
    """
    for fn in fns.values():
        mx.eval(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    started = time.perf_counter()
    repeats = 0
    while repeats < max_repeats and (repeats < min_repeats or time.perf_counter() - started < min_seconds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - t0)
        repeats += 1
    return {name: float(np.median(ts)) * 1e3 for name, ts in times.items()}


def _inputs(context: int, batch: int, shape: BenchShape, rng: np.random.Generator):
    dtype = getattr(mx, shape.dtype)
    blocks_per_seq = -(-context // shape.block_size)
    num_blocks = batch * blocks_per_seq
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_seq)
    pool_shape = (num_blocks, shape.kv_heads, shape.block_size, shape.head_dim)
    k_pool = mx.random.normal(pool_shape).astype(dtype)
    v_pool = mx.random.normal(pool_shape).astype(dtype)
    cache_shape = (batch, shape.kv_heads, context, shape.head_dim)
    keys = mx.random.normal(cache_shape).astype(dtype)
    values = mx.random.normal(cache_shape).astype(dtype)
    q = mx.random.normal((batch, shape.heads, 1, shape.head_dim)).astype(dtype)
    lens = mx.array([context] * batch, dtype=mx.int32)
    mx.eval(k_pool, v_pool, keys, values, q, lens)
    return q, keys, values, k_pool, v_pool, mx.array(tables), lens


def run_kernel_bench(
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    batches: Sequence[int] = DEFAULT_BATCHES,
    shape: BenchShape = BenchShape(),
    min_seconds: float = 0.5,
    progress: Callable[[KernelBenchRow], None] | None = None,
) -> list[KernelBenchRow]:
    """Time every (context, batch) cell; ``progress`` sees each row as it completes."""
    rng = np.random.default_rng(0)
    rows = []
    for context in contexts:
        for batch in batches:
            rows.append(_bench_cell(context, batch, shape, rng, min_seconds))
            if progress:
                progress(rows[-1])
    return rows


def _bench_cell(context: int, batch: int, shape: BenchShape, rng, min_seconds: float) -> KernelBenchRow:
    """One cell; its arrays are freed on return, before the next size is allocated."""
    scale = shape.head_dim**-0.5
    use_kernel = compute_backend.computes_on_gpu()
    q, keys, values, k_pool, v_pool, tables, lens = _inputs(context, batch, shape, rng)
    fns = {
        "contiguous": lambda: mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale),
        "reference": lambda: paged_attention_reference(q, k_pool, v_pool, tables, lens, scale),
    }
    if use_kernel:
        from mlxpaged.kernels.paged_attention import paged_attention_kernel

        fns["kernel"] = lambda: paged_attention_kernel(q, k_pool, v_pool, tables, lens, scale)
    else:
        fns["cpu"] = lambda: paged_attention_cpu(q, k_pool, v_pool, tables, lens, scale)
    ms = time_interleaved(fns, min_seconds)
    fast = "kernel" if use_kernel else "cpu"
    return KernelBenchRow(context, batch, ms["contiguous"], ms["reference"], ms[fast], fast)


def format_kernel_bench(rows: Sequence[KernelBenchRow], shape: BenchShape = BenchShape()) -> str:
    fast = rows[0].fast_path if rows else "cpu"
    device = (
        {"metal": "Metal GPU", "cuda": "CUDA GPU"}.get(compute_backend.current(), "CPU") if fast == "kernel" else "CPU"
    )
    lines = [
        f"paged decode attention on {device}: {shape.heads} heads / {shape.kv_heads} KV heads, "
        f"head dim {shape.head_dim}, block size {shape.block_size}, {shape.dtype}; ratio = paged / contiguous",
        f"{'context':>8} {'batch':>5} {'contig ms':>10} {'ref ms':>9} {'ref x':>6} {fast + ' ms':>10} {fast + ' x':>7}",
    ]
    for r in rows:
        lines.append(
            f"{r.context:>8} {r.batch:>5} {r.contiguous_ms:>10.3f} {r.reference_ms:>9.3f} "
            f"{r.reference_ratio:>6.2f} {r.fast_ms:>10.3f} {r.fast_ratio:>7.2f}"
        )
    return "\n".join(lines)


def print_kernel_bench(rows: Sequence[KernelBenchRow], shape: BenchShape = BenchShape()) -> None:
    print(format_kernel_bench(rows, shape))


def main(
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    batches: Sequence[int] = DEFAULT_BATCHES,
    shape: BenchShape = BenchShape(),
) -> list[KernelBenchRow]:
    """Run and print (the CLI's ``mlxpaged bench kernel`` entry)."""
    rows = run_kernel_bench(contexts, batches, shape)
    print_kernel_bench(rows, shape)
    return rows


if __name__ == "__main__":  # python -m mlxpaged.kernels.bench (the package loads OpenBLAS first)
    main()
