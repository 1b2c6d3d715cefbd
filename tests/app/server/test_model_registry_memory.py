"""Unloading gives the memory back: a real (tiny, random) model loaded through the registry's own worker-thread
hooks, then unloaded; MLX's active memory and the process's resident set are measured before and after."""

from __future__ import annotations

import functools
import gc

from mlxpaged.units import format_size
from mlxpaged_app.server.model_catalog import ModelCatalog
from mlxpaged_app.server.model_loading import EngineSettings, build_engine, estimate_cost
from mlxpaged_app.server.model_registry import ModelRegistry, RegistryPolicy
from mlxpaged_app.server.state import ServerConfig
from tests.tiny_models import write_tiny_llama_dir

import mlx.core as mx
import psutil
import pytest

SETTINGS = EngineSettings({"cache_tokens": 512, "max_batch_tokens": 128, "max_num_seqs": 2}, "none", warm_up=True)


def memory() -> tuple[int, int]:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory(), psutil.Process().memory_info().rss


@pytest.mark.asyncio
async def test_unloading_frees_the_weights_and_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXPAGED_MODELS_DIR", str(tmp_path))
    write_tiny_llama_dir(tmp_path / "tiny-mem", dtype="float32", hidden=256, seed=3)  # ~50 MB of embedding
    registry = ModelRegistry(
        ModelCatalog(),
        ServerConfig(),
        RegistryPolicy(budget_bytes=10**9, keep_alive=None),
        estimate=functools.partial(estimate_cost, settings=SETTINGS),
        build=functools.partial(build_engine, settings=SETTINGS),
    )
    active_before, rss_before = memory()
    served = await registry.get("tiny-mem")
    weights = served.cost.weights
    assert served.cost.total == estimate_cost(served.entry, SETTINGS).total  # the plan before load is what loaded
    active_loaded, rss_loaded = memory()
    await registry.unload(served, "by the test")
    del served
    active_after, rss_after = memory()
    print(
        f"\nMLX active {format_size(active_before)} -> {format_size(active_loaded)} -> {format_size(active_after)}; "
        f"RSS {format_size(rss_before)} -> {format_size(rss_loaded)} -> {format_size(rss_after)}"
    )
    assert active_loaded - active_before >= weights
    assert active_after - active_before < weights // 20  # the weights and pools are gone, not just unlisted
    assert rss_loaded - rss_after > weights // 2  # and the process really gave them back
    assert not registry.loaded and registry.held_bytes() == 0
