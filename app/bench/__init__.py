"""`mlxpaged bench`: measured, never asserted. Prints medians and ratios; one module per benchmark."""

from __future__ import annotations

from argparse import Namespace

from mlxpaged_app.bench.batch import bench_batch
from mlxpaged_app.bench.constraints import bench_constraints
from mlxpaged_app.bench.decode import bench_decode
from mlxpaged_app.bench.gpu import bench_gpu
from mlxpaged_app.bench.hybrid import bench_hybrid
from mlxpaged_app.bench.kernel import bench_kernel
from mlxpaged_app.bench.kv import bench_kv
from mlxpaged_app.bench.memory import bench_memory
from mlxpaged_app.bench.prefill import bench_prefill
from mlxpaged_app.bench.prefix import bench_prefix
from mlxpaged_app.bench.restart import bench_restart
from mlxpaged_app.bench.spec import bench_spec


def bench_server(args: Namespace) -> int:
    """Imported when run: bench/server.py is also `python -m mlxpaged_app.bench.server`."""
    from mlxpaged_app.bench.server import run_server_bench

    return run_server_bench(args)


BENCHES = {
    "decode": bench_decode,
    "memory": bench_memory,
    "batch": bench_batch,
    "prefix": bench_prefix,
    "kernel": bench_kernel,
    "server": bench_server,
    "constraints": bench_constraints,
    "prefill": bench_prefill,
    "spec": bench_spec,
    "hybrid": bench_hybrid,
    "gpu": bench_gpu,
    "restart": bench_restart,
    "kv": bench_kv,
}


def run_bench(args: Namespace) -> int:
    return BENCHES[args.what](args)
