"""The kernel benchmark runs and prints (tiny sizes; timings are never asserted)."""

import mlxpaged  # noqa: F401
from mlxpaged.kernels.bench import BenchShape, format_kernel_bench, run_kernel_bench


def test_bench_rows_and_table():
    shape = BenchShape(heads=4, kv_heads=2, head_dim=64, block_size=8)
    seen = []
    rows = run_kernel_bench((16, 21), (1, 3), shape=shape, min_seconds=0.0, progress=seen.append)
    assert [(r.context, r.batch) for r in rows] == [(16, 1), (16, 3), (21, 1), (21, 3)] and seen == rows
    assert all(r.contiguous_ms > 0 and r.reference_ms > 0 and r.reference_ratio > 0 for r in rows)
    assert all(r.fast_path == "cpu" and r.fast_ms > 0 for r in rows)  # no Metal here
    table = format_kernel_bench(rows, shape)
    assert "4 heads / 2 KV heads" in table and len(table.splitlines()) == 2 + len(rows)
