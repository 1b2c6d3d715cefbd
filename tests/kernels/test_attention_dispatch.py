"""attention.py picks the kernel on Metal and the reference elsewhere, with an override."""

import mlxpaged  # noqa: F401
import mlx.core as mx
import pytest

from mlxpaged.kernels import attention
from tests.msl.oracle import make_decode_case, max_error


def test_auto_uses_the_cpu_path_without_metal(monkeypatch):
    monkeypatch.delenv(attention.ENV_VAR, raising=False)
    monkeypatch.setattr(attention, "metal_available", lambda: False)
    assert attention.resolved_backend() == "cpu"
    case = make_decode_case(0, [9, 0, 20], 8, 2, 64, 8)
    out = attention.paged_attention(*case.args())
    assert max_error(out, case.expected()) < 1e-5


def test_environment_and_override(monkeypatch):
    monkeypatch.setattr(attention, "metal_available", lambda: False)
    monkeypatch.setenv(attention.ENV_VAR, "reference")
    assert attention.resolved_backend() == "reference"
    monkeypatch.setenv(attention.ENV_VAR, "kernel")
    with pytest.raises(RuntimeError, match="no Metal"):
        attention.resolved_backend()
    with attention.attention_backend("reference"):
        assert attention.resolved_backend() == "reference"
    monkeypatch.setenv(attention.ENV_VAR, "cpu")
    assert attention.resolved_backend() == "cpu"
    monkeypatch.setenv(attention.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="auto, kernel, cpu, reference"):
        attention.resolved_backend()
    with pytest.raises(ValueError):
        attention.set_attention_backend("fast")


def test_kernel_chosen_on_metal(monkeypatch):
    monkeypatch.delenv(attention.ENV_VAR, raising=False)
    monkeypatch.setattr(attention, "metal_available", lambda: True)
    assert attention.resolved_backend() == "kernel"
    with attention.attention_backend("reference"):
        assert attention.resolved_backend() == "reference"


def test_prefill_entry_point_runs_everywhere():
    pool = mx.random.normal((6, 2, 8, 64))
    q = mx.random.normal((1, 4, 5, 64))
    out = attention.paged_prefill_attention(q, pool, pool, mx.array([3, 1, 5]), 10, 5, 0.125)
    assert out.shape == (1, 4, 5, 64)
