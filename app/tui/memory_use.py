"""Current memory use for the engine panel: the host via psutil, MLX's active memory on Metal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class MemoryUse:
    process_rss: int | None = None
    host_used: int | None = None
    host_total: int | None = None
    mlx_active: int | None = None  # Metal only: what MLX holds on the GPU heap
    mlx_peak: int | None = None


MemoryProbe = Callable[[Any], MemoryUse]


def probe_memory(engine: Any) -> MemoryUse:
    """The host's memory and MLX's own counters (the engine reports its plan, not its use)."""
    return MemoryUse(*_host(), *_metal())


def _host() -> tuple[int | None, int | None, int | None]:
    try:
        import psutil

        host = psutil.virtual_memory()
        return psutil.Process().memory_info().rss, host.total - host.available, host.total
    except Exception:  # psutil can fail in restricted sandboxes; the panel just shows less
        return None, None, None


def _metal() -> tuple[int | None, int | None]:
    try:
        import mlx.core as mx

        if mx.metal.is_available():
            return mx.get_active_memory(), mx.get_peak_memory()
    except Exception:
        pass
    return None, None
