"""The loader's dtype follows platform/backend.py: a GPU (Metal or CUDA) keeps the checkpoint's dtype,
MLX's CPU backend makes half precision float32; LoadedModel.dtype says what was loaded. Tiny random
checkpoints saved by mlx-lm are loaded under backend.simulate (MLX computes on the CPU either way)."""

from __future__ import annotations

from pathlib import Path

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.loading.checkpoint import facts_before_load, kv_dtype_before_load
from mlxpaged.loading.loader import default_dtype, load_local, locate_model
from mlxpaged.loading.model_store import ModelRef
from mlxpaged.platform import backend
from tests.loading.test_plan_before_load import loaded_facts, save_tiny
from tests.tiny_models import tiny_llama

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return locate_model(None)[1]


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return save_tiny(tmp_path_factory.mktemp("bf16"), tiny_llama(seed=4), tokenizer_dir, dtype=mx.bfloat16)


@pytest.fixture(scope="module")
def bf16_4bit_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return save_tiny(tmp_path_factory.mktemp("bf16-4bit"), tiny_llama(seed=5), tokenizer_dir, dtype=mx.bfloat16, bits=4)


def load(path: Path):
    return load_local(ModelRef(str(path), "path", path=path), path)


def floating_dtypes(model) -> set:
    return {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}


@pytest.mark.parametrize("gpu", ["cuda", "metal"])
def test_a_gpu_keeps_bf16_weights(bf16_dir, gpu):
    with backend.simulate(gpu):
        loaded = load(bf16_dir)
    assert floating_dtypes(loaded.model) == {mx.bfloat16}
    assert loaded.dtype == "bfloat16"


def test_the_cpu_makes_bf16_weights_float32(bf16_dir):
    with backend.simulate("cpu"):
        loaded = load(bf16_dir)
    assert floating_dtypes(loaded.model) == {mx.float32}
    assert loaded.dtype == "float32"


@pytest.mark.parametrize("name, packed, scales", [("cuda", mx.uint32, {mx.bfloat16}), ("cpu", mx.uint32, {mx.float32})])
def test_quantized_weights_stay_packed_and_scales_follow_the_backend(bf16_4bit_dir, name, packed, scales):
    with backend.simulate(name):
        loaded = load(bf16_4bit_dir)
    params = dict(tree_flatten(loaded.model.parameters()))
    assert params["model.layers.0.self_attn.q_proj.weight"].dtype == packed
    assert floating_dtypes(loaded.model) == scales
    assert loaded.dtype == ("bfloat16" if name == "cuda" else "float32")


@pytest.mark.parametrize("name", ["cuda", "metal", "cpu"])
def test_facts_before_load_are_the_loaded_models_under_each_backend(bf16_dir, name):
    """The plan's figures read from the headers are what the loader then loads, backend by backend."""
    with backend.simulate(name):
        assert facts_before_load(bf16_dir, backend.current()) == loaded_facts(bf16_dir, backend.current())


def test_cuda_counts_weights_and_kv_as_the_checkpoint_holds_them(bf16_dir):
    cuda, cpu = facts_before_load(bf16_dir, "cuda"), facts_before_load(bf16_dir, "cpu")
    assert (cuda.kv.dtype_bytes, cpu.kv.dtype_bytes) == (2, 4)
    assert cpu.weight_bytes == 2 * cuda.weight_bytes
    assert (kv_dtype_before_load(bf16_dir, "cuda"), kv_dtype_before_load(bf16_dir, "cpu")) == ("bfloat16", "float32")


@pytest.mark.parametrize("name, dtype", [("cuda", "float16"), ("metal", "float16"), ("cpu", "float32")])
def test_the_embedded_models_store_dtype(name, dtype):
    with backend.simulate(name):
        assert default_dtype() == dtype
