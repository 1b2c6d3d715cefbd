"""Stand-ins for mlx.core on each backend MLX 0.32 runs on, for the code that reads the machine
(platform.backend.detect, DeviceFacts.detect): the attributes they read, with each backend's values."""

from __future__ import annotations

from types import SimpleNamespace

GiB = 2**30
GPU, CPU = "gpu", "cpu"  # stand-ins for mx.gpu / mx.cpu (DeviceType values compare by identity of these)

# mx.device_info() as each backend reports it (Metal: an M2 with 16 GB; CUDA: an H200, NVML's figures).
METAL_INFO = {
    "architecture": "applegpu_g14g",
    "device_name": "Apple M2",
    "memory_size": 16 * GiB,
    "max_recommended_working_set_size": 11_453_251_584,
    "max_buffer_size": 9 * GiB,
    "resource_limit": 499000,
}
CUDA_INFO = {
    "device_name": "NVIDIA H200",
    "architecture": "sm_90",
    "total_memory": 150_754_820_096,
    "free_memory": 149_512_257_536,
    "uuid": "GPU-00000000-0000-0000-0000-000000000000",
    "pci_bus_id": "0000:19:00.0",
    "compute_capability_major": 9,
    "compute_capability_minor": 0,
}
CPU_INFO = {"architecture": "x86_64", "device_name": "AMD EPYC"}


def stand_in_mx(
    backend: str, info: dict | None = None, default_device: str | None = None, has_cuda_module: bool = True
) -> SimpleNamespace:
    """An mlx.core-like module as MLX's `backend` build shows it ("metal", "cuda" or "cpu");
    `default_device` "cpu" makes a GPU build whose default device was set to the CPU."""
    device = default_device or (CPU if backend == "cpu" else GPU)
    module = SimpleNamespace(
        gpu=GPU,
        cpu=CPU,
        default_device=lambda: SimpleNamespace(type=device),
        metal=SimpleNamespace(is_available=lambda: backend == "metal"),
        device_info=lambda: dict(
            info if info is not None else {"metal": METAL_INFO, "cuda": CUDA_INFO, "cpu": CPU_INFO}[backend]
        ),
    )
    if has_cuda_module:  # mlx[cpu] and Metal builds have mx.cuda too; it says False there
        module.cuda = SimpleNamespace(is_available=lambda: backend == "cuda")
    return module


def stand_in_psutil(total: int = 16 * GiB, available: int = 9_000_000_000) -> SimpleNamespace:
    vm = SimpleNamespace(total=total, available=available)
    return SimpleNamespace(virtual_memory=lambda: vm)
