"""`mlxpaged bench`: measured, never asserted. Prints medians and ratios; one module per benchmark."""

from __future__ import annotations

from argparse import Namespace

from mlxpaged_app.bench.batch import bench_batch
from mlxpaged_app.bench.constraints import bench_constraints
from mlxpaged_app.bench.decode import bench_decode
from mlxpaged_app.bench.fleet import bench_fleet
from mlxpaged_app.bench.gpu import bench_gpu
from mlxpaged_app.bench.hybrid import bench_hybrid
from mlxpaged_app.bench.kernel import bench_kernel
from mlxpaged_app.bench.kv import bench_kv
from mlxpaged_app.bench.lora import bench_lora
from mlxpaged_app.bench.memory import bench_memory
from mlxpaged_app.bench.prefill import bench_prefill
from mlxpaged_app.bench.prefix import bench_prefix
from mlxpaged_app.bench.restart import bench_restart
from mlxpaged_app.bench.spec import bench_spec
from mlxpaged_app.bench.vision import bench_vision


def bench_server(args: Namespace) -> int:
    """Imported when run: bench/server.py is also `python -m mlxpaged_app.bench.server`."""
    from mlxpaged_app.bench.server import run_server_bench

    return run_server_bench(args)


def bench_distributed(args: Namespace) -> int:
    """Imported when run: its rank script runs as `python -m mlxpaged_app.bench.distributed_ranks`."""
    from mlxpaged_app.bench.distributed import bench_distributed as run

    return run(args)


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
    "distributed": bench_distributed,
    "vision": bench_vision,
    "fleet": bench_fleet,
    "lora": bench_lora,
}


# --tokens and --runs when not given: 128 and 3, except where a bench's own default keeps its run short.
DEFAULTS = {
    "distributed": {"tokens": 16, "runs": 1},
    "vision": {"tokens": 32},
    "fleet": {"tokens": 64},
    "lora": {"tokens": 64},
}


def run_bench(args: Namespace) -> int:
    for name, value in {"tokens": 128, "runs": 3, **DEFAULTS.get(args.what, {})}.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return BENCHES[args.what](args)
