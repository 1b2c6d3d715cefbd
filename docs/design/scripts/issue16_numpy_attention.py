"""Usage: python docs/design/scripts/issue16_numpy_attention.py (from the repo root).

One SmolLM2 layer's attention (9 query / 3 KV heads, D 64), causal: MLX's cpu_attention.attend vs
NumPy over contiguous K/V, then for a batch-1 chunk after a cached context, gathered pages + NumPy
vs pages read in place. Medians of 5, wall ms."""
import time

import numpy as np

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.kernels import numpy_attention as na
from mlxpaged.kernels.cpu_attention import attend


def ms(fn, n=5):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1e3


for length, keys in [(8, 2048), (64, 512), (128, 1024), (512, 2048), (2048, 2048), (2048, 8192)]:
    q = mx.random.normal((1, 9, length, 64))
    k, v = mx.random.normal((1, 3, keys, 64)), mx.random.normal((1, 3, keys, 64))
    mx.eval(q, k, v)
    a, b = ms(lambda: attend(q, k, v, 0.125, "causal")), ms(lambda: na.attend_numpy(q, k, v, 0.125, "causal"))
    print(f"{length:5d} queries x {keys:5d} keys: MLX {a:7.2f} ms, NumPy {b:7.2f} ms ({a / b:.2f}x)", flush=True)

blocks, block_size = 40000, 16  # a pool too big for any cache, as the engine's
kv = PagedKVCache(1, blocks, block_size, 3, 64)
kv.keys[0], kv.values[0] = mx.random.normal((blocks, 3, block_size, 64)), mx.random.normal((blocks, 3, block_size, 64))
mx.eval(kv.keys[0], kv.values[0])
rng = np.random.default_rng(0)
for length, context in [(8, 2048), (8, 16384), (64, 16384), (128, 8192), (512, 8192)]:
    start = int(rng.integers(0, blocks - context // block_size))
    table = list(range(start, start + context // block_size))
    q = mx.random.normal((1, 9, length, 64))
    mx.eval(q)

    def gathered():
        k, v = kv.gather_blocks(0, mx.array([table], dtype=mx.int32))
        return na.attend_numpy(q, k[..., :context, :], v[..., :context, :], 0.125, "causal")

    a = ms(gathered)
    b = ms(lambda: na.attend_pages_numpy(q, kv.keys[0], kv.values[0], table, context, 0.125))
    print(f"{length:4d} queries after {context:5d}: gathered {a:7.2f} ms, in place {b:7.2f} ms ({a / b:.2f}x)", flush=True)
