"""Warm-up-then-time, shared by the benches: the first call of each shape is never timed.

On a GPU the first call of each shape JIT-compiles kernels (MLX's CUDA backend compiles with NVRTC, Metal
builds pipelines); on the CPU it pays first-touch allocations and mx.compile's tracing. Both sides of a
comparison run their exact workload once, untimed, before the timed runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from mlxpaged.errors import ConfigError

T = TypeVar("T")


def after_warm_up(measure: Callable[[], T], runs: int) -> list[T]:
    """`measure()` once untimed (its result dropped), then `runs` results."""
    if runs < 1:
        raise ConfigError(f"--runs must be at least 1, got {runs}")
    measure()
    return [measure() for _ in range(runs)]
