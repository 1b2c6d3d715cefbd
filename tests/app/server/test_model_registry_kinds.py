"""Embedding models in the model registry (fast, fake models): a catalog entry of kind "embed" is served as a
ServedEmbedder, counted against the same budget, unloaded least recently used and by keep-alive as engines are;
a route asking for the other kind is refused before anything loads; Ollama's keep_alive 0 unloads an idle model
now; the catalog reads a model's kind from its files (the embedding package's rule)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mlxpaged_app.server.model_catalog import ModelCatalog, model_kind
from mlxpaged_app.server.model_registry import ModelRegistry, RegistryPolicy, WrongKind
from mlxpaged_app.server.served_model import ServedEmbedder, ServedModel
from mlxpaged_app.server.state import ServerConfig
from tests.app.server.test_model_registry import MB, Loads, idle_past_grace
from tests.embedding.tiny_embedding import write_tiny_embedding_dir

import pytest


def mixed_registry(loads: Loads, budget_mb: int | None = None, **policy) -> ModelRegistry:
    """ "gen" a generative model, "emb" an embedding model (their kinds given, as the catalog reads them)."""
    catalog = ModelCatalog(use_store=False)
    catalog.add_given("gen", None, Path("/models/gen"), kind="generate")
    catalog.add_given("emb", None, Path("/models/emb"), kind="embed")
    policy.setdefault("keep_alive", None)
    budget = None if budget_mb is None else budget_mb * MB
    return ModelRegistry(
        catalog,
        ServerConfig(),
        RegistryPolicy(budget, **policy),
        estimate=loads.estimate,
        build=loads.build,
        release=loads.release,
    )


@pytest.mark.asyncio
async def test_an_embedding_model_shares_the_budget_and_the_lru_unloads():
    loads = Loads({"gen": 60, "emb": 60})
    registry = mixed_registry(loads, budget_mb=100)
    gen = await registry.get("gen", kind="generate")
    assert isinstance(gen, ServedModel) and gen.kind == "generate"
    idle_past_grace(registry)
    emb = await registry.get("emb", kind="embed")  # 60 + 60 > 100: the idle generative model goes
    assert isinstance(emb, ServedEmbedder) and emb.status()["kind"] == "embedding"
    assert loads.released == ["gen"] and list(registry.loaded) == ["emb"]
    assert registry.held_bytes() == 60 * MB == emb.cost.total
    idle_past_grace(registry)
    await registry.get("gen", kind="generate")  # and back: the idle embedding model goes
    assert loads.released == ["gen", "emb"] and list(registry.loaded) == ["gen"]


@pytest.mark.asyncio
async def test_the_other_kind_is_refused_before_loading():
    loads = Loads({"gen": 10, "emb": 10})
    registry = mixed_registry(loads)
    with pytest.raises(WrongKind) as chat_to_embedder:
        await registry.get("emb", kind="generate")
    with pytest.raises(WrongKind) as embed_with_generator:
        await registry.get("gen", kind="embed")
    assert loads.built == [] and registry.loaded == {}
    assert (chat_to_embedder.value.entry.name, embed_with_generator.value.entry.name) == ("emb", "gen")
    await registry.get("gen")  # kind None (Ollama's /api/show): either
    with pytest.raises(WrongKind):
        await registry.get("gen", kind="embed")  # loaded, still refused


@pytest.mark.asyncio
async def test_keep_alive_unloads_an_embedding_model_after_its_request():
    loads = Loads({"emb": 10})
    registry = mixed_registry(loads, keep_alive=300.0)
    emb = await registry.get("emb", keep_alive=0.0, kind="embed")
    with emb.admission.slot(1):
        await asyncio.sleep(0.6)
        assert "emb" in registry.loaded  # in flight: kept
    await asyncio.sleep(0.2)
    assert emb.unloaded and loads.released == ["emb"]


@pytest.mark.asyncio
async def test_expire_unloads_an_idle_model_now_and_a_busy_one_after():
    loads = Loads({"gen": 10, "emb": 10})
    registry = mixed_registry(loads, keep_alive=300.0)
    gen = await registry.get("gen")
    emb = await registry.get("emb", kind="embed")
    await registry.expire("gen")  # idle: gone when expire returns
    assert gen.unloaded and "gen" not in registry.loaded
    with emb.admission.slot(1):
        await registry.expire("emb")
        assert not emb.unloaded and emb.keep_alive == 0.0  # busy: its request ends first
    await asyncio.sleep(0.1)
    assert emb.unloaded and loads.released == ["gen", "emb"]
    assert await registry.expire("gen") is None  # not loaded: stays so


def test_the_catalog_reads_the_kind_from_the_model_files(tmp_path):
    embedding = write_tiny_embedding_dir(tmp_path / "emb")
    generative = write_tiny_embedding_dir(tmp_path / "gen", sentence_transformers=False)
    assert (model_kind(None, embedding), model_kind(None, generative)) == ("embed", "generate")
    catalog = ModelCatalog(use_store=False)
    assert catalog.add_given("emb", None, embedding).kind == "embed"
    assert catalog.add_given("gen", None, generative).kind == "generate"
