"""The engine panel names the backend the engine reports, and on CUDA shows MLX's and the device's memory
(memory_use.probe_memory reads them only where MLX really runs on that GPU)."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.platform import backend
from mlxpaged_app.tui import memory_use
from mlxpaged_app.tui.memory_use import MemoryUse, probe_memory
from mlxpaged_app.tui.widgets.engine_panel import memory_text, stats_text
from tests.app.tui.tui_support import FakeEngine
from tests.platform.mx_stand_ins import CUDA_INFO

import mlx.core as mx


def test_stats_name_the_backend_when_the_engine_reports_it():
    stats = FakeEngine().stats()
    assert "backend" not in stats_text(stats).plain
    stats.update(backend="cuda", backend_description="CUDA GPU (MLX's CUDA backend)")
    assert "backend     CUDA GPU (MLX's CUDA backend)" in stats_text(stats).plain


def test_memory_shows_the_cuda_device_when_probed():
    plan = FakeEngine().plan
    host_only = MemoryUse(process_rss=10**9, host_used=8 * 10**9, host_total=25 * 10**9)
    assert "device" not in memory_text(plan, host_only).plain
    on_cuda = MemoryUse(
        10**9,
        8 * 10**9,
        25 * 10**9,
        mlx_active=20 * 10**9,
        mlx_peak=22 * 10**9,
        device_used=21 * 10**9,
        device_total=150 * 10**9,
    )
    text = memory_text(plan, on_cuda).plain
    assert "MLX active  20.00 GB (peak 22.00 GB)" in text
    assert "device      21.00 GB of 150.00 GB used" in text


def test_probe_on_cuda_reads_mlx_and_the_device(monkeypatch):
    monkeypatch.setattr(backend, "detected", lambda: "cuda")
    monkeypatch.setattr(mx, "device_info", lambda: dict(CUDA_INFO))
    monkeypatch.setattr(mx, "get_active_memory", lambda: 5_000_000_000)
    monkeypatch.setattr(mx, "get_peak_memory", lambda: 6_000_000_000)
    use = probe_memory(None)
    assert (use.mlx_active, use.mlx_peak) == (5_000_000_000, 6_000_000_000)
    assert (use.device_used, use.device_total) == (150_754_820_096 - 149_512_257_536, 150_754_820_096)


def test_probe_on_the_cpu_reads_no_gpu_memory():
    """MLX on the CPU (simulated GPU or not): its active memory is host memory, already in the host row."""
    use = probe_memory(None)
    assert (use.mlx_active, use.device_total) == (None, None) and use.host_total
    with backend.simulate("cuda"):
        assert memory_use._mlx_on_gpu() == (None, None) and memory_use._cuda_device() == (None, None)
