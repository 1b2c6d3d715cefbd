"""`mlxpaged doctor` names the backend MLX computes on (platform/backend.py) and reports CUDA's device
memory; the attention line describes each path the kernels report, and shows an unknown one bare."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
import mlxpaged.kernels.attention as attention
from mlxpaged.platform import backend
from mlxpaged.platform.memory import DeviceFacts
from mlxpaged_app import doctor
from mlxpaged_app.doctor import OK, WARN

import pytest

H200 = DeviceFacts("cuda", 150_754_820_096, 149_512_257_536, None, "NVIDIA H200")


def test_mlx_line_names_the_backend():
    assert doctor.check_mlx().detail.endswith(f", backend: {backend.describe()}")
    with backend.simulate("cuda"):
        check = doctor.check_mlx()
    assert check.detail.endswith(
        f", backend: CUDA GPU (MLX's CUDA backend) (simulated; MLX computes on {backend.detected()})"
    )


def report_path(monkeypatch, path: str, reason: str = "why") -> None:
    monkeypatch.setattr(attention, "resolved_backend", lambda: path)
    monkeypatch.setattr(attention, "attention_status", lambda: {"path": path, "reason": reason, "variants": []})


def test_attention_line_describes_the_fused_path(monkeypatch):
    report_path(monkeypatch, "fused", "MLX runs on a CUDA GPU")
    assert doctor.check_attention() == doctor.Check(
        OK,
        "attention",
        "fused (MLX's fused attention (gathered pages, mx.fast.scaled_dot_product_attention)): MLX runs on a CUDA GPU",
    )


@pytest.mark.parametrize("path", ["kernel", "cpu", "reference"])
def test_attention_line_describes_every_known_path(monkeypatch, path):
    report_path(monkeypatch, path)
    assert doctor.check_attention().detail == f"{path} ({doctor.ATTENTION_PATHS[path]}): why"


def test_attention_line_shows_an_unknown_path_bare(monkeypatch):
    report_path(monkeypatch, "tensor-cores", "a path this doctor predates")
    assert doctor.check_attention() == doctor.Check(OK, "attention", "tensor-cores: a path this doctor predates")
    report_path(monkeypatch, "kernel (with reference fallback)", "self-check failed")
    assert doctor.check_attention() == doctor.Check(
        WARN, "attention", "kernel (with reference fallback): self-check failed"
    )


def test_memory_line_on_cuda_reports_device_memory(monkeypatch):
    monkeypatch.setattr(DeviceFacts, "detect", classmethod(lambda cls: H200))
    assert doctor.check_memory() == doctor.Check(
        OK, "memory", "CUDA device memory 150.75 GB, free 149.51 GB (cuda backend; the KV plan starts from the total)"
    )


def test_memory_line_warns_when_others_fill_the_gpu(monkeypatch):
    """More than the plan's 10% reserve held by other processes: the default plan would not fit."""
    busy = DeviceFacts("cuda", 150_754_820_096, 120_000_000_000, None, "NVIDIA H200")
    monkeypatch.setattr(DeviceFacts, "detect", classmethod(lambda cls: busy))
    check = doctor.check_memory()
    assert check.status == WARN and "free 120.00 GB" in check.detail and "--kv-memory" in check.detail


def test_memory_line_on_the_cpu_is_unchanged(monkeypatch):
    monkeypatch.setattr(DeviceFacts, "detect", classmethod(lambda cls: DeviceFacts("cpu", 25 * 2**30, 20 * 2**30)))
    assert doctor.check_memory() == doctor.Check(OK, "memory", "RAM 26.84 GB, available 21.47 GB (cpu backend)")


def test_wired_line_on_cuda_touches_no_wired_limit(monkeypatch):
    import mlx.core as mx

    monkeypatch.setattr(backend, "detected", lambda: "cuda")
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: pytest.fail("set_wired_limit called on CUDA"))
    assert doctor.check_wired() == doctor.Check(
        OK, "wired memory", "not applicable on CUDA (mx.set_wired_limit is Metal's)"
    )


def test_kv_plan_line_on_cuda(monkeypatch):
    monkeypatch.setattr(DeviceFacts, "detect", classmethod(lambda cls: H200))
    check = doctor.check_kv_plan(doctor.find_default_model())
    assert check.status == OK and "(cuda)" in check.detail


def test_the_store_dtype_follows_the_backend():
    with backend.simulate("cuda"):
        assert doctor.find_default_model().dtype == "float16"
    with backend.simulate("cpu"):
        assert doctor.find_default_model().dtype == "float32"


def test_models_verbose_names_the_backend(capsys):
    from mlxpaged_app.cli import main

    assert main(["models", "--verbose"]) == 0
    assert f"\nBackend: {backend.describe()}\n" in capsys.readouterr().out
