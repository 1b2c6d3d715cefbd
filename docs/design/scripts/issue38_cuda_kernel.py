"""Issue 38, part 5: the paged decode kernel's CUDA twin against what the engine's CUDA path does by default, on a
lent GPU (MLX's CUDA backend; the kit in ../shared/gpu). Not run yet: no device has been lent since it was written.

    python3 docs/design/scripts/issue38_cuda_kernel.py [--dtype bfloat16] [--contexts 512,2048,8192] [--batches 1,16,64]

For each (context, batch), over a shuffled page pool with SmolLM2-1.7B's attention shape (32 heads, 32 KV heads,
head dim 64) and skewed lengths (each row's length drawn log-uniformly up to the context):
- "fused": the default CUDA path: each row's pages gathered to the longest row, then MLX's fused attention under a
  mask (batch 1: no mask; routing.py's `pool_inputs` returns None there, the cache view gathers);
- "twin": `paged_attention_kernel(..., language="cuda")`, pages read in place, no gather, no mask.
First each is checked against the float64-free reference (`paged_attention_reference`, float32 math) on the same
inputs; then timed, interleaved, medians of `mx.eval`.
"""

from __future__ import annotations

import argparse

import mlxpaged  # noqa: F401
from mlxpaged.kernels.bench import time_interleaved
from mlxpaged.kernels.paged_attention import paged_attention_kernel
from mlxpaged.kernels.reference import paged_attention_reference

import mlx.core as mx
import numpy as np

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 32, 64, 16


def gathered_fused(q, k_pool, v_pool, tables, lens_list, scale):
    """What the fused path computes: pages gathered per row to the longest row, masked past each row's length."""
    width = -(-max(lens_list) // BLOCK)
    rows = tables[:, :width]
    keys = k_pool[rows].transpose(0, 2, 1, 3, 4).reshape(q.shape[0], KV_HEADS, width * BLOCK, HEAD_DIM)
    values = v_pool[rows].transpose(0, 2, 1, 3, 4).reshape(q.shape[0], KV_HEADS, width * BLOCK, HEAD_DIM)
    if q.shape[0] == 1:
        n = lens_list[0]
        return mx.fast.scaled_dot_product_attention(q, keys[:, :, :n], values[:, :, :n], scale=scale)
    mask = (mx.arange(width * BLOCK)[None] < mx.array(lens_list)[:, None])[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def measure_cell(context: int, batch: int, dtype, rng, launcher=None) -> str:
    """One (context, batch) line: each path's max error against the reference, then interleaved medians."""
    scale = HEAD_DIM**-0.5
    lens_list = [int(x) for x in np.exp(rng.uniform(np.log(128), np.log(context), batch)).round()]
    lens_list[0] = context  # the longest row sets the padded width
    per_row = -(-context // BLOCK)
    tables = mx.array(rng.permutation(batch * per_row).astype(np.int32).reshape(batch, per_row))
    shape = (batch * per_row, KV_HEADS, BLOCK, HEAD_DIM)
    k_pool, v_pool = mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype)
    q = mx.random.normal((batch, HEADS, 1, HEAD_DIM)).astype(dtype)
    lens = mx.array(lens_list, dtype=mx.int32)
    f32 = [x.astype(mx.float32) for x in (q, k_pool, v_pool)]
    want = paged_attention_reference(f32[0], f32[1], f32[2], tables, lens, scale)
    fns = {
        "fused": lambda: gathered_fused(q, k_pool, v_pool, tables, lens_list, scale),
        "twin": lambda: paged_attention_kernel(
            q, k_pool, v_pool, tables, lens, scale, language="cuda", launcher=launcher
        ),
    }
    errors = {name: float(mx.max(mx.abs(fn().astype(mx.float32) - want))) for name, fn in fns.items()}
    ms = time_interleaved(fns, min_seconds=1.0 if launcher is None else 0.0, min_repeats=5 if launcher is None else 1)
    return (
        f"{context:>8} {batch:>5} {errors['fused']:>10.2e} {errors['twin']:>9.2e} "
        f"{ms['fused']:>9.3f} {ms['twin']:>8.3f} {ms['fused'] / ms['twin']:>9.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--batches", default="1,16,64")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"device {mx.default_device()}, {args.dtype}, heads {HEADS}/{KV_HEADS}, head dim {HEAD_DIM}, block {BLOCK}")
    print(f"{'context':>8} {'batch':>5} {'err fused':>10} {'err twin':>9} {'fused ms':>9} {'twin ms':>8} fused/twin")
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            print(measure_cell(context, batch, getattr(mx, args.dtype), rng), flush=True)


if __name__ == "__main__":
    main()
