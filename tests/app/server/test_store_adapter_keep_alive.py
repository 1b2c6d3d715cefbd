"""Store adapters attached on demand are detached once unused for the model's keep-alive (as the model itself is
unloaded), counted from the end of their last request; one a request still runs with stays; without a keep-alive,
none is detached. A stand-in engine: what is tested is ServedModel's bookkeeping, timed in fractions of a second."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from mlxpaged.errors import AdapterError
from mlxpaged_app.server import served_model
from mlxpaged_app.server.model_catalog import CatalogEntry
from mlxpaged_app.server.served_model import ModelCost, ServedModel
from mlxpaged_app.server.state import ServerConfig

import pytest

KEEP_ALIVE = 0.3


class StandInEngine:
    """What ServedModel asks of an engine about adapters; `busy` adapters have unfinished requests."""

    scheduler_config = SimpleNamespace(max_num_seqs=4)
    tokenizer = None
    max_model_len = 128

    def __init__(self) -> None:
        self.busy: set[str] = set()
        self.attached: set[str] = set()
        self.adapters = SimpleNamespace(
            known_as=lambda names: None, resolve=lambda name: SimpleNamespace(describe=lambda: {"bytes": 1000})
        )

    def check_adapter(self, name: str, path: str) -> str:
        return path

    def add_adapter(self, name: str, files: str) -> dict:
        self.attached.add(name)
        return {"bytes": 1000}

    def remove_adapter(self, name: str) -> None:
        if name in self.busy:
            raise AdapterError(f"adapter {name!r} has 1 unfinished request(s); remove it once they end")
        self.attached.discard(name)


def served(engine: StandInEngine, keep_alive: float | None) -> ServedModel:
    entry = CatalogEntry("base", None, Path("base"))
    return ServedModel(entry, engine, ServerConfig(), ModelCost(weights=10_000, kv_cache=0), keep_alive=keep_alive)


@pytest.fixture(autouse=True)
def no_handout_grace(monkeypatch):
    monkeypatch.setattr(served_model, "ADAPTER_HANDOUT_GRACE_S", 0.0)


def test_an_idle_store_adapter_is_detached_after_the_keep_alive_from_its_last_requests_end():
    async def scenario():
        engine = StandInEngine()
        model = served(engine, KEEP_ALIVE)
        await model.use_adapter("a", "/a")
        assert model.cost.weights == 11_000
        await asyncio.sleep(KEEP_ALIVE * 0.6)
        model.generation_ended("a")  # a request with it just ended: the keep-alive starts again
        await asyncio.sleep(KEEP_ALIVE * 0.6)
        assert engine.attached == {"a"}
        await asyncio.sleep(KEEP_ALIVE * 0.8)
        assert engine.attached == set() and model.cost.weights == 10_000

    asyncio.run(scenario())


def test_a_store_adapter_a_request_still_runs_with_stays_until_it_ends():
    async def scenario():
        engine = StandInEngine()
        model = served(engine, KEEP_ALIVE)
        await model.use_adapter("b", "/b")
        engine.busy.add("b")
        await asyncio.sleep(KEEP_ALIVE * 2)
        assert engine.attached == {"b"}
        engine.busy.clear()
        model.generation_ended("b")
        await asyncio.sleep(KEEP_ALIVE * 1.5)
        assert engine.attached == set()

    asyncio.run(scenario())


def test_without_a_keep_alive_store_adapters_stay():
    async def scenario():
        engine = StandInEngine()
        model = served(engine, None)
        await model.use_adapter("c", "/c")
        model.generation_ended("c")
        await asyncio.sleep(KEEP_ALIVE * 2)
        assert engine.attached == {"c"}

    asyncio.run(scenario())


def test_an_unloaded_models_adapter_checks_are_cancelled():
    async def scenario():
        engine = StandInEngine()
        model = served(engine, KEEP_ALIVE)
        await model.use_adapter("d", "/d")
        model.release()
        await asyncio.sleep(KEEP_ALIVE * 2)  # no check ran against the released engine
        assert engine.attached == {"d"}

    asyncio.run(scenario())
