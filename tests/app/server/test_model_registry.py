"""The model registry in-process, over fake engines (fast): one load per model however many ask at once, the
budget (LRU unload of idle models, refusal with the numbers), keep-alive (0, None, per request), pins, load
failures and timeouts, the catalog's names, and keep-alive durations."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from mlxpaged.units import format_size
from mlxpaged_app.server.errors import APIError
from mlxpaged_app.server.keep_alive import KeepAliveError, parse_keep_alive
from mlxpaged_app.server.model_catalog import ModelCatalog, ModelNotServable
from mlxpaged_app.server.model_registry import HANDOUT_GRACE_S, ModelRegistry, RegistryPolicy
from mlxpaged_app.server.served_model import ModelCost
from mlxpaged_app.server.state import ServerConfig
from tests.app.server.test_server_unit import FakeEngine

import pytest

MB = 10**6


class Loads:
    """The registry's worker-thread hooks, recording what ran: each model costs `costs[name]` MB."""

    def __init__(self, costs: dict[str, int], delay: float = 0.0, fail: set[str] | None = None) -> None:
        self.costs, self.delay, self.fail = costs, delay, fail or set()
        self.built: list[str] = []
        self.released: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def estimate(self, entry) -> ModelCost:
        return ModelCost(self.costs[entry.name] * MB, 0)

    def build(self, entry):
        self.gate.wait(10)
        time.sleep(self.delay)
        if entry.name in self.fail:
            raise OSError(f"{entry.path}/model.safetensors: truncated file")
        self.built.append(entry.name)
        engine = FakeEngine()
        engine.loaded.name = entry.name
        from mlxpaged.loading.generation_defaults import NO_DEFAULTS

        return engine, NO_DEFAULTS, self.estimate(entry)

    def release(self, holder: list) -> None:
        self.released.append(holder.pop().loaded.name)


def registry_for(loads: Loads, budget_mb: int | None = None, **policy) -> ModelRegistry:
    catalog = ModelCatalog(use_store=False)
    for name in loads.costs:
        catalog.add_given(name, None, Path(f"/models/{name}"))
    budget = None if budget_mb is None else budget_mb * MB
    policy.setdefault("keep_alive", None)
    return ModelRegistry(
        catalog,
        ServerConfig(),
        RegistryPolicy(budget, **policy),
        estimate=loads.estimate,
        build=loads.build,
        release=loads.release,
    )


def idle_past_grace(registry: ModelRegistry) -> None:
    """As if every model had been handed out longer ago than the grace (so it may be unloaded)."""
    for served in registry.loaded.values():
        served.handed_out -= HANDOUT_GRACE_S
        served.last_used -= HANDOUT_GRACE_S


@pytest.mark.asyncio
async def test_concurrent_first_requests_load_once():
    loads = Loads({"a": 10}, delay=0.2)
    registry = registry_for(loads)
    got = await asyncio.gather(*(registry.get("a") for _ in range(5)))
    assert loads.built == ["a"] and all(g is got[0] for g in got) and registry.loads["a"] == 1


@pytest.mark.asyncio
async def test_models_are_separate_and_answer_to_their_names():
    loads = Loads({"a": 10, "b": 10})
    registry = registry_for(loads)
    a, b = await registry.get("a"), await registry.get("/models/b")
    assert a.engine is not b.engine and a.admission is not b.admission and a.metrics is not b.metrics
    assert (a.model_id, b.model_id) == ("a", "b") and await registry.get("b") is b
    with pytest.raises(ModelNotServable):
        await registry.get("c")


@pytest.mark.asyncio
async def test_budget_unloads_the_least_recently_used_idle_model():
    loads = Loads({"a": 40, "b": 40, "c": 40})
    registry = registry_for(loads, budget_mb=100)
    await registry.get("a")
    await registry.get("b")
    idle_past_grace(registry)
    registry.loaded["b"].last_used -= 1  # b is now the least recently used
    await registry.get("c")
    assert loads.released == ["b"] and set(registry.loaded) == {"a", "c"} and registry.held_bytes() == 80 * MB


@pytest.mark.asyncio
async def test_a_model_in_use_is_kept_and_the_newcomer_refused_with_the_numbers():
    loads = Loads({"a": 60, "b": 60})
    registry = registry_for(loads, budget_mb=100)
    a = await registry.get("a")
    idle_past_grace(registry)
    with a.admission.slot(1), pytest.raises(APIError) as refused:
        await registry.get("b")
    error = refused.value
    assert error.status == 503 and error.code == "insufficient_memory" and error.param == "model"
    expected = (f"needs {format_size(60 * MB)}", f"only {format_size(40 * MB)} of the {format_size(100 * MB)}")
    for text in (*expected, "a 0.06 GB (1 request in flight)"):
        assert text in error.message, error.message
    assert loads.released == [] and list(registry.loaded) == ["a"]


@pytest.mark.asyncio
async def test_a_model_larger_than_the_budget_is_refused_before_unloading_anything():
    loads = Loads({"a": 10, "big": 200})
    registry = registry_for(loads, budget_mb=100)
    await registry.get("a")
    idle_past_grace(registry)
    with pytest.raises(APIError, match=r"needs 0.20 GB.*whole memory budget of 0.10 GB") as refused:
        await registry.get("big")
    assert refused.value.status == 503 and loads.released == [] and loads.built == ["a"]


@pytest.mark.asyncio
async def test_pinned_models_are_never_unloaded():
    loads = Loads({"a": 60, "b": 60})
    registry = registry_for(loads, budget_mb=100, pins=frozenset({"a"}))
    await registry.get("a")
    idle_past_grace(registry)
    with pytest.raises(APIError, match="pinned"):
        await registry.get("b")
    assert registry.loaded["a"].pinned and registry.loaded["a"].keep_alive is None


@pytest.mark.asyncio
async def test_keep_alive_zero_unloads_after_the_request_and_none_never():
    loads = Loads({"a": 10, "b": 10})
    registry = registry_for(loads, keep_alive=None)
    a = await registry.get("a", keep_alive=0.0)
    b = await registry.get("b")  # the server's default: never
    with a.admission.slot(1):
        await asyncio.sleep(HANDOUT_GRACE_S + 0.1)
        assert "a" in registry.loaded  # in flight: kept
    await asyncio.sleep(0.2)
    assert "a" not in registry.loaded and a.unloaded and loads.released == ["a"]
    with pytest.raises(APIError) as gone:
        _ = a.engine
    assert gone.value.status == 503
    assert registry.loaded.get("b") is b and not b.unloaded


@pytest.mark.asyncio
async def test_keep_alive_counts_from_the_end_of_the_last_request():
    loads = Loads({"a": 10})
    registry = registry_for(loads, keep_alive=0.6)
    a = await registry.get("a")
    with a.admission.slot(1):
        await asyncio.sleep(0.8)  # longer than the keep-alive, but in flight
    assert "a" in registry.loaded
    await asyncio.sleep(0.3)
    assert "a" in registry.loaded  # idle for 0.3 s of its 0.6
    await asyncio.sleep(0.6)
    assert "a" not in registry.loaded and loads.released == ["a"]


@pytest.mark.asyncio
async def test_a_request_keep_alive_of_never_overrides_the_server_default():
    loads = Loads({"a": 10})
    registry = registry_for(loads, keep_alive=0.0)
    await registry.get("a", keep_alive=None)
    await asyncio.sleep(HANDOUT_GRACE_S + 0.2)
    assert "a" in registry.loaded


@pytest.mark.asyncio
async def test_a_failed_load_says_why_and_leaves_the_others_serving():
    loads = Loads({"a": 10, "broken": 10}, fail={"broken"})
    registry = registry_for(loads)
    a = await registry.get("a")
    with pytest.raises(APIError) as failed:
        await registry.get("broken")
    assert failed.value.status == 500 and failed.value.code == "model_load_failed"
    assert "truncated file" in failed.value.message and "truncated file" in registry.failures["broken"]
    assert await registry.get("a") is a and registry.held_bytes() == 10 * MB  # nothing left reserved
    loads.fail.clear()
    assert (await registry.get("broken")).model_id == "broken"  # fixed on disk: the next request loads it
    assert "broken" not in registry.failures


@pytest.mark.asyncio
async def test_waiting_for_a_load_is_bounded():
    loads = Loads({"slow": 10})
    loads.gate.clear()
    registry = registry_for(loads, load_timeout=0.2)
    with pytest.raises(APIError) as waited:
        await registry.get("slow")
    assert waited.value.status == 503 and waited.value.code == "model_loading" and "0.2 s" in waited.value.message
    loads.gate.set()
    served = await registry.get("slow")  # the load went on: the next request gets it, loaded once
    assert served.model_id == "slow" and loads.built == ["slow"]


def test_keep_alive_durations():
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400 and parse_keep_alive("250ms") == 0.25
    assert parse_keep_alive(0) == 0 and parse_keep_alive("0") == 0 and parse_keep_alive(42) == 42
    assert parse_keep_alive(-1) is None and parse_keep_alive("-1") is None and parse_keep_alive("-5m") is None
    for bad in ("soon", "5x", "", "m", True, [1], float("nan")):
        with pytest.raises(KeepAliveError, match="keep_alive"):
            parse_keep_alive(bad)


def test_catalog_serves_the_store_and_the_command_line_only(tmp_path, monkeypatch):
    store = tmp_path / "store"
    for name in ("tiny", ".hidden"):
        (store / name).mkdir(parents=True)
        (store / name / "config.json").write_text("{}")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    monkeypatch.setenv("MLXPAGED_MODELS_DIR", str(store))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing downloaded
    catalog = ModelCatalog()
    entry = catalog.find("tiny")
    assert entry.name == "tiny" and entry.path == store / "tiny" and catalog.find(str(store / "tiny")).name == "tiny"
    with pytest.raises(ModelNotServable, match="not in the model store"):
        catalog.find(str(outside))
    with pytest.raises(ModelNotServable, match="mlxpaged pull"):
        catalog.find("qwen3-0.6b")  # a hub preset never downloaded here
    with pytest.raises(ModelNotServable, match="unknown model"):
        catalog.find("no such model")
    given = catalog.add_given(str(outside), None, outside)
    assert catalog.find("elsewhere") is given and catalog.find(str(outside)) is given
    assert "tiny" in [e.name for e in catalog.servable()]


@pytest.mark.asyncio
async def test_a_load_waits_for_memory_still_being_unloaded_instead_of_refusing():
    loads = Loads({"a": 60, "b": 60})
    slow_release = threading.Event()
    plain_release = loads.release

    def release(holder: list) -> None:
        slow_release.wait(10)
        plain_release(holder)

    loads.release = release
    registry = registry_for(loads, budget_mb=100)
    registry._release = release
    a = await registry.get("a")
    idle_past_grace(registry)
    unloading = asyncio.create_task(registry.unload(a, "idle"))
    await asyncio.sleep(0.05)
    assert registry.unloading_names() == ["a"]
    loading = asyncio.create_task(registry.get("b"))
    await asyncio.sleep(0.2)
    assert not loading.done()  # a's 60 MB are not back yet: b waits rather than being refused
    slow_release.set()
    assert (await loading).model_id == "b"
    await unloading
    assert loads.released == ["a"] and list(registry.loaded) == ["b"]


def fake_hub_cache(root: Path, repo: str) -> Path:
    """huggingface_hub's cache layout for one downloaded repo: a blob, a snapshot linking to it, refs/main."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "blobs").mkdir(parents=True)
    (folder / "blobs" / "c0ffee").write_text("{}")
    snapshot = folder / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to(folder / "blobs" / "c0ffee")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("abc123")
    return snapshot


def test_a_downloaded_hub_repo_is_listed_and_servable(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXPAGED_MODELS_DIR", str(tmp_path / "store"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = fake_hub_cache(tmp_path / "hub", "someone/tiny-chat")
    from mlxpaged.loading.model_store import list_models

    rows = {row.name: row for row in list_models("float32")}
    assert rows["someone/tiny-chat"].path == snapshot and rows["someone/tiny-chat"].source == "hub"
    entry = ModelCatalog().find("someone/tiny-chat")
    assert entry.name == "someone/tiny-chat" and entry.path == snapshot
    assert "someone/tiny-chat" in [e.name for e in ModelCatalog().servable()]
