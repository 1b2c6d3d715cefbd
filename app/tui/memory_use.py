"""Current memory use for the engine panel: the host via psutil, MLX's active memory on a GPU (Metal or
CUDA), and on CUDA the device's memory in use (platform/backend.py says which)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxpaged.platform import backend


@dataclass(frozen=True)
class MemoryUse:
    process_rss: int | None = None
    host_used: int | None = None
    host_total: int | None = None
    mlx_active: int | None = None  # on a GPU (Metal, CUDA): what MLX holds on the device
    mlx_peak: int | None = None
    device_used: int | None = None  # CUDA only: the device's memory in use by every process (mx.device_info())
    device_total: int | None = None


MemoryProbe = Callable[[Any], MemoryUse]


def probe_memory(engine: Any) -> MemoryUse:
    """The host's memory and MLX's own counters (the engine reports its plan, not its use)."""
    rss, host_used, host_total = _host()
    active, peak = _mlx_on_gpu()
    device_used, device_total = _cuda_device()
    return MemoryUse(rss, host_used, host_total, active, peak, device_used, device_total)


def _host() -> tuple[int | None, int | None, int | None]:
    try:
        import psutil

        host = psutil.virtual_memory()
        return psutil.Process().memory_info().rss, host.total - host.available, host.total
    except Exception:  # psutil can fail in restricted sandboxes; the panel just shows less
        return None, None, None


def _mlx_on_gpu() -> tuple[int | None, int | None]:
    """MLX's active and peak memory where MLX really runs on a GPU (on the CPU they are host memory)."""
    try:
        import mlx.core as mx

        if backend.computes_on_gpu():
            return mx.get_active_memory(), mx.get_peak_memory()
    except Exception:
        pass
    return None, None


def _cuda_device() -> tuple[int | None, int | None]:
    """(used, total) of the CUDA device; Metal's memory is the host's, which _host reports."""
    try:
        import mlx.core as mx

        if backend.detected() == "cuda":
            info = mx.device_info()
            return int(info["total_memory"]) - int(info["free_memory"]), int(info["total_memory"])
    except Exception:
        pass
    return None, None
