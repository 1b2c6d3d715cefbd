"""`mlxpaged bench kernel`: paged attention vs contiguous SDPA (the measuring lives in mlxpaged.kernels.bench)."""

from __future__ import annotations

from argparse import Namespace


def bench_kernel(args: Namespace) -> int:
    """Paged attention (reference path on CPU; kernel too on a Mac) vs contiguous SDPA, contexts 512-8192."""
    from mlxpaged.kernels.bench import print_kernel_bench, run_kernel_bench

    print_kernel_bench(run_kernel_bench([512, 1024, 2048, 4096, 8192], [1, 4, 16]))
    return 0
