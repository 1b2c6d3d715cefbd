"""platform/backend.py: which backend MLX computes on, read from stand-ins for each build, and the
choices that follow it (tuning, simulate, the environment override)."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.platform import backend
from tests.platform.mx_stand_ins import stand_in_mx

import pytest


@pytest.mark.parametrize("name", ["metal", "cuda", "cpu"])
def test_detect_names_the_build_mlx_runs_on(name):
    assert backend.detect(stand_in_mx(name)) == name


def test_a_gpu_whose_default_device_is_the_cpu_is_the_cpu():
    assert backend.detect(stand_in_mx("cuda", default_device="cpu")) == "cpu"
    assert backend.detect(stand_in_mx("metal", default_device="cpu")) == "cpu"


def test_a_gpu_device_without_metal_or_cuda_is_the_cpu():
    """An MLX build without mx.cuda (older releases) whose GPU is not Metal: nothing to run GPU paths on."""
    assert backend.detect(stand_in_mx("cpu", default_device="gpu", has_cuda_module=False)) == "cpu"


@pytest.mark.parametrize("name, gpu", [("cuda", True), ("metal", True), ("cpu", False)])
def test_simulate_moves_every_choice_and_restores(name, gpu):
    with backend.simulate(name):
        assert backend.current() == name and backend.is_gpu() is gpu
        assert not backend.computes_on_gpu()  # MLX still computes on this CPU
        assert backend.tuning().float32_weights is not gpu
        assert "simulated" in backend.describe()
    assert backend.current() == backend.detected()


def test_only_the_cpu_can_be_forced(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "cpu")
    assert backend.current() == "cpu"
    other = "metal" if backend.detected() != "metal" else "cuda"
    monkeypatch.setenv(backend.ENV_VAR, other)
    with pytest.raises(ValueError, match=f"MLX computes on '{backend.detected()}' here; only 'cpu' can be forced"):
        backend.current()


def test_unknown_backends_are_refused():
    with pytest.raises(ValueError, match="backend must be one of cpu, metal, cuda, got 'rocm'"):
        backend.tuning("rocm")
    with pytest.raises(ValueError, match="got 'rocm'"), backend.simulate("rocm"):
        pass


@pytest.mark.parametrize("name, tokens", [("cpu", 2048), ("metal", 2048), ("cuda", 8192)])
def test_the_step_budget_defaults_to_the_backends_and_a_setting_wins(name, tokens):
    from mlxpaged.config import SchedulerConfig, split_settings

    with backend.simulate(name):
        assert SchedulerConfig().max_batch_tokens == tokens == backend.tuning().max_batch_tokens
        assert split_settings({})[1].max_batch_tokens == tokens
        assert split_settings({"max_batch_tokens": 512})[1].max_batch_tokens == 512
