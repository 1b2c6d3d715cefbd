"""attention.py picks the kernel on Metal, MLX's fused attention on CUDA and the CPU path on MLX's CPU
backend (platform/backend.py decides which), with an override."""

import mlxpaged  # noqa: F401
from mlxpaged.kernels import attention, numpy_attention
from mlxpaged.platform import backend
from tests.engine.test_engine import tokenizer  # noqa: F401  (the fixture, shared)
from tests.msl.oracle import make_decode_case, max_error

import mlx.core as mx
import pytest


@pytest.mark.parametrize("name, path", [("metal", "kernel"), ("cuda", "fused"), ("cpu", "cpu")])
def test_auto_follows_the_backend(monkeypatch, name, path):
    monkeypatch.delenv(attention.ENV_VAR, raising=False)
    with backend.simulate(name):
        assert attention.resolved_backend() == path


def test_auto_uses_the_cpu_path_on_the_cpu_backend(monkeypatch):
    monkeypatch.delenv(attention.ENV_VAR, raising=False)
    assert backend.current() == "cpu"
    assert attention.resolved_backend() == "cpu"
    case = make_decode_case(0, [9, 0, 20], 8, 2, 64, 8)
    out = attention.paged_attention(*case.args())
    assert max_error(out, case.expected()) < 1e-5


def test_environment_and_override(monkeypatch):
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
    with pytest.raises(ValueError, match="auto, kernel, fused, cpu, reference"):
        attention.resolved_backend()
    with pytest.raises(ValueError):
        attention.set_attention_backend("fast")


def test_kernel_chosen_on_metal(monkeypatch):
    monkeypatch.delenv(attention.ENV_VAR, raising=False)
    with backend.simulate("metal"):
        assert attention.resolved_backend() == "kernel"
        with attention.attention_backend("reference"):
            assert attention.resolved_backend() == "reference"


def test_the_fused_path_never_computes_on_the_host(monkeypatch):
    """On a non-Metal GPU, eager prefill and cache-hit chunks stay on the device: NumPy (a sync and a copy
    to the host per layer) is the CPU backend's alone."""

    def host(*args, **kwargs):
        raise AssertionError("NumPy attention on a GPU")

    monkeypatch.setattr(attention, "attend_numpy", host)
    monkeypatch.setattr(attention, "attend_pages_numpy", host)
    q = mx.random.normal((1, 4, 600, 64))
    k = mx.random.normal((1, 2, 1200, 64))
    assert numpy_attention.numpy_attention_applies(q, k, "causal")  # big enough for NumPy on the CPU backend
    with backend.simulate("cuda"):
        out = attention.eager_sdpa(q, k, k, 0.125, "causal")
        pool = mx.random.normal((6, 2, 8, 64))
        assert not attention.reads_pages_in_place(q[:, :, :8], pool, pool, 40)
        hit = attention.paged_prefill_attention(q[:, :, :8], pool, pool, mx.array([3, 1, 5, 0, 2]), 32, 8, 0.125)
    want = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask="causal")
    assert max_error(out, want) < 1e-5 and hit.shape == (1, 4, 8, 64)


def test_a_fused_batch_one_decode_passes_no_mask(monkeypatch, tokenizer):
    """MLX's fused decode kernels run only without a mask array: a batch-1 decode step on the fused path
    attends exactly the sequence's keys with mask None."""
    from tests.engine.test_engine import GREEDY, tiny_engine
    from tests.tiny_models import random_tokens, tiny_llama

    masks = []
    fast = mx.fast.scaled_dot_product_attention

    def spy(q, k, v, *, scale, mask=None, sinks=None):
        if q.shape[2] == 1:
            masks.append(mask)
        return fast(q, k, v, scale=scale, mask=mask, sinks=sinks)

    with backend.simulate("cuda"), tiny_engine(tiny_llama(), tokenizer) as eng:
        monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
        eng.generate([random_tokens(20, seed=1)], GREEDY)
    assert masks and all(mask is None for mask in masks)


def test_prefill_entry_point_runs_everywhere():
    pool = mx.random.normal((6, 2, 8, 64))
    q = mx.random.normal((1, 4, 5, 64))
    out = attention.paged_prefill_attention(q, pool, pool, mx.array([3, 1, 5]), 10, 5, 0.125)
    assert out.shape == (1, 4, 5, 64)
