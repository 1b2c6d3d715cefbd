"""The models a running server holds: loaded on demand, unloaded when idle or to make room, within one memory
budget for all of them together.

- `get(name)` (what `ServerState.served_model` calls) returns the loaded model, or loads it: the blocking work
  runs in a worker thread (model_loading.py), never on the event loop. Requests for a model that is loading
  wait for that one load (at most `load_timeout` seconds, then a 503 saying so) instead of loading it again.
- Before a load, the model's cost comes from the memory plan without reading a weight. If the budget
  (--max-memory) cannot hold it next to what is loaded, idle models (no request in flight, not pinned) are
  unloaded least recently used first; if it still cannot, the request is refused with the numbers (503).
- A model idle for its keep-alive (--keep-alive, or the last request's `keep_alive`; None: never) is unloaded;
  pinned models (--pin) never are. Unloading closes the engine and gives its memory back (release_engine).
- A model that fails to load answers its requests with the reason (500) and changes nothing for the others.

Everything here runs on the event loop's thread (no locks beyond `_room`, which orders loads' evictions).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxpaged.errors import InsufficientMemoryError, MlxpagedError, user_message
from mlxpaged.units import format_size
from mlxpaged_app.server.errors import model_load_failed, model_memory_refused, model_still_loading
from mlxpaged_app.server.model_catalog import CatalogEntry, ModelCatalog, ModelNotServable
from mlxpaged_app.server.model_loading import release_engine
from mlxpaged_app.server.served_model import ModelCost, ServedEmbedder, ServedModel, model_cost
from mlxpaged_app.server.server_log import log

import anyio

UNSET = object()  # get()'s keep_alive when the request sent none: the model keeps its own
# A model handed to a route this recently is never unloaded: the route may not have taken its queue slot yet.
HANDOUT_GRACE_S = 0.5
UNLOAD_POLL_S = 0.05
# What wraps each kind of model the catalog names (CatalogEntry.kind) for routes: an Engine ("generate") or an
# Embedder ("embed"); both have the registry-facing attributes of served_model.ServedBase.
SERVED_KINDS: dict[str, type] = {"generate": ServedModel, "embed": ServedEmbedder}

Estimator = Callable[[CatalogEntry], ModelCost]  # worker thread: the cost before loading (may raise)
Builder = Callable[[CatalogEntry], tuple]  # worker thread: (engine or embedder, sampling defaults, cost)
Releaser = Callable[[list], None]  # worker thread: closes the one model in the list and frees its memory


@dataclass(frozen=True)
class RegistryPolicy:
    budget_bytes: int | None = None  # every model together; None: no budget (one fixed model, tests)
    keep_alive: float | None = 300.0  # seconds idle before unloading; None: never
    pins: frozenset[str] = frozenset()  # names of models never unloaded
    load_timeout: float = 300.0  # how long a request waits for its model to load


class WrongKind(Exception):
    """A model of the other kind than the route runs: an embedding model asked to chat, or a generative one asked
    for embeddings."""

    def __init__(self, entry: CatalogEntry) -> None:
        super().__init__(entry.name)
        self.entry = entry

    def reason(self) -> str:
        """Why a generative model cannot embed, by the embedding package's rule (model_files.py)."""
        from mlxpaged.embedding.model_files import embedding_spec

        preset = self.entry.ref.preset if self.entry.ref is not None else None
        try:
            embedding_spec(self.entry.path, preset.options if preset else None)
        except MlxpagedError as exc:
            return str(exc)
        except OSError:
            pass
        return "it is a generative model"


def _check_kind(entry: CatalogEntry, kind: str | None) -> None:
    if kind is not None and entry.kind != kind:
        raise WrongKind(entry)


class ModelRegistry:
    def __init__(
        self,
        catalog: ModelCatalog,
        config,
        policy: RegistryPolicy,
        *,
        estimate: Estimator | None = None,
        build: Builder | None = None,
        release: Releaser = release_engine,
    ) -> None:
        self.catalog, self.config, self.policy = catalog, config, policy
        self._estimate, self._build, self._release = estimate, build, release
        self.loaded: dict[str, ServedModel] = {}
        self.default_name: str | None = None  # what a request naming no model gets
        self._loading: dict[str, asyncio.Task] = {}
        # Bytes of models loading or unloading (by name), counted against the budget until their memory is back.
        self._loading_bytes: dict[str, int] = {}
        self._unloading_bytes: dict[str, int] = {}
        self._room = asyncio.Lock()
        self.loads: Counter = Counter()  # name -> loads done
        self.unloads: Counter = Counter()
        self.failures: dict[str, str] = {}  # name -> why its last load failed

    # --- what routes call ----------------------------------------------------------------------------------
    async def get(self, name: str | None, keep_alive: object = UNSET, kind: str | None = None) -> ServedModel:
        """The loaded model `name` means (None: the default model), loading it if needed. Raises
        ModelNotServable for a name the server cannot serve, WrongKind for a model that is not of `kind` (None:
        any; checked before loading), and APIErrors for a model that cannot fit (503), is still loading at the
        timeout (503) or failed to load (500)."""
        served = self.find_loaded(name)
        if served is None:
            entry = self._entry(name)
            _check_kind(entry, kind)
            served = self.loaded.get(entry.name) or await self._wait_for_load(entry)
        _check_kind(served.entry, kind)
        served.touch()
        if keep_alive is not UNSET and not served.pinned:
            served.keep_alive = keep_alive  # type: ignore[assignment]  # Ollama's: the last request's value holds
        self._schedule_check(served)
        return served

    async def expire(self, name: str | None) -> ServedModel | None:
        """Ollama's keep_alive 0 with nothing to run: unload `name` now if it is loaded and idle, else once its
        requests end (its keep-alive becomes 0). Pinned models stay. ModelNotServable for an unknown name; the
        model it was, or None when it was not loaded."""
        served = self.find_loaded(name)
        if served is None:
            entry = self._entry(name)
            served = self.loaded.get(entry.name)
        if served is None or served.pinned:
            return served
        served.keep_alive = 0.0
        await asyncio.sleep(max(served.handed_out + HANDOUT_GRACE_S - time.monotonic(), 0.0))  # a route's turn
        if served.in_flight or self.loaded.get(served.model_id) is not served:
            return served  # its last request's end schedules the unload (or it is already gone)
        if served.idle_timer is not None:
            served.idle_timer.cancel()
            served.idle_timer = None
        await self.unload(served, "as a request asked (keep_alive 0)")
        return served

    def find_loaded(self, name: str | None) -> ServedModel | None:
        """The loaded model `name` (or an alias of it) means, None when it is not loaded."""
        if name is None:
            return self.loaded.get(self.default_name) if self.default_name else None
        name = self.catalog.aliases.get(name, name)
        return next((s for s in self.loaded.values() if name in s.model_names), None)

    def loading_names(self) -> list[str]:
        return list(self._loading)

    def unloading_names(self) -> list[str]:
        """Models out of service whose memory is not back yet."""
        return list(self._unloading_bytes)

    def _entry(self, name: str | None) -> CatalogEntry:
        if name is None:
            if self.default_name is None:
                raise ModelNotServable("the request names no model and the server has no default model")
            name = self.default_name
        return self.catalog.find(name)

    # --- loading -------------------------------------------------------------------------------------------
    def add_loaded(self, entry: CatalogEntry, engine, defaults, cost: ModelCost | None = None) -> ServedModel:
        """A model loaded before serving (the launcher's --model and --pin): the first becomes the default."""
        config = dataclasses.replace(self.config, sampling_defaults=defaults)
        served = self._served(entry, engine, config, cost or model_cost(engine))
        self.loaded[entry.name] = served
        self.default_name = self.default_name or entry.name
        self.loads[entry.name] += 1
        return served

    def _served(self, entry: CatalogEntry, engine, config, cost: ModelCost) -> ServedModel:
        pinned = bool(entry.names & self.policy.pins)
        keep_alive = None if pinned else self.policy.keep_alive
        served = SERVED_KINDS[entry.kind]
        return served(entry, engine, config, cost, keep_alive=keep_alive, pinned=pinned, on_idle=self._on_idle)

    async def _wait_for_load(self, entry: CatalogEntry) -> ServedModel:
        task = self._loading.get(entry.name)
        if task is None:
            task = asyncio.create_task(self._load(entry))  # its own task: a client leaving does not cancel it
            self._loading[entry.name] = task
            task.add_done_callback(lambda done: self._load_done(entry.name, done))
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.policy.load_timeout)
        except TimeoutError:
            raise model_still_loading(entry.name, self.policy.load_timeout) from None

    def _load_done(self, name: str, task: asyncio.Task) -> None:
        if self._loading.get(name) is task:
            del self._loading[name]
        if not task.cancelled():
            task.exception()  # retrieved: waiters that timed out must not leave it "never retrieved"

    async def _load(self, entry: CatalogEntry) -> ServedModel:
        if self._build is None or self._estimate is None:
            raise ModelNotServable(f"this server serves only the models it started with, not {entry.name!r}")
        cost = await self._run(entry, self._estimate)
        async with self._room:
            await self._make_room(entry.name, cost)
            self._loading_bytes[entry.name] = cost.total
        started = time.perf_counter()
        try:
            engine, defaults, measured = await self._run(entry, self._build)
        finally:
            del self._loading_bytes[entry.name]
        config = dataclasses.replace(self.config, sampling_defaults=defaults)
        served = self._served(entry, engine, config, measured)
        self.loaded[entry.name] = served
        self.loads[entry.name] += 1
        self.failures.pop(entry.name, None)
        served.load_seconds = time.perf_counter() - started
        log.info("model %s loaded in %.1f s: %s", entry.name, served.load_seconds, measured.describe())
        return served

    async def _run(self, entry: CatalogEntry, work: Callable):
        """`work(entry)` in a worker thread; its failure becomes the answer the waiting requests get."""
        try:
            return await anyio.to_thread.run_sync(work, entry)
        except InsufficientMemoryError as exc:
            message = f"model {entry.name!r} cannot fit in this machine's memory: {user_message(exc, 'cli')}"
            self.failures[entry.name] = message
            raise model_memory_refused(message) from None
        except Exception as exc:
            reason = user_message(exc, "cli") if isinstance(exc, MlxpagedError) else f"{type(exc).__name__}: {exc}"
            self.failures[entry.name] = reason
            log.warning("model %s failed to load: %s", entry.name, reason)
            raise model_load_failed(entry.name, reason) from None

    # --- the budget -----------------------------------------------------------------------------------------
    def held_bytes(self) -> int:
        """Bytes counted against the budget: loaded models, and those loading or unloading."""
        aside = sum(self._loading_bytes.values()) + sum(self._unloading_bytes.values())
        return sum(s.cost.total for s in self.loaded.values()) + aside

    async def _make_room(self, name: str, cost: ModelCost) -> None:
        budget = self.policy.budget_bytes
        if budget is None:
            return
        if cost.total > budget:
            raise model_memory_refused(
                f"model {name!r} needs {cost.describe()}, more than the whole memory budget of "
                f"{format_size(budget)} (--max-memory)"
            )
        while self.held_bytes() + cost.total > budget:
            victim = self._eviction_candidate()
            if victim is not None:
                await self.unload(victim, f"to make room for {name}")
            elif self._unloading_bytes:  # memory on its way back (an idle unload): wait for it, do not refuse
                await asyncio.sleep(UNLOAD_POLL_S)
            else:
                raise model_memory_refused(self._no_room(name, cost, budget))

    def _eviction_candidate(self) -> ServedModel | None:
        """The least recently used model that is idle, not pinned, and not just handed to a route."""
        now = time.monotonic()
        idle = [
            s
            for s in self.loaded.values()
            if not s.pinned and not s.in_flight and now - s.handed_out >= HANDOUT_GRACE_S
        ]
        return min(idle, key=lambda s: s.last_used, default=None)

    def _no_room(self, name: str, cost: ModelCost, budget: int) -> str:
        held = [f"{s.model_id} {format_size(s.cost.total)} ({_why_kept(s)})" for s in self.loaded.values()]
        held += [f"{n} {format_size(size)} (loading)" for n, size in self._loading_bytes.items()]
        held += [f"{n} {format_size(size)} (unloading)" for n, size in self._unloading_bytes.items()]
        free = budget - self.held_bytes()
        return (
            f"model {name!r} needs {cost.describe()} but only {format_size(max(free, 0))} of the "
            f"{format_size(budget)} memory budget (--max-memory) is free, and no loaded model can be unloaded: "
            f"{'; '.join(held)}. Retry once a model is idle, or raise --max-memory"
        )

    # --- unloading ------------------------------------------------------------------------------------------
    async def unload(self, served: ServedModel, reason: str) -> None:
        """Take `served` out of service and free its memory (in a worker thread); its requests must be done."""
        if self.loaded.get(served.model_id) is served:
            del self.loaded[served.model_id]
        if served.unloaded:
            return
        self._unloading_bytes[served.model_id] = served.cost.total
        holder = [served.release()]
        try:
            await anyio.to_thread.run_sync(self._release, holder)
        finally:
            del self._unloading_bytes[served.model_id]
        self.unloads[served.model_id] += 1
        log.info(
            "model %s unloaded %s (%s of the budget back)", served.model_id, reason, format_size(served.cost.total)
        )

    def _on_idle(self, served: ServedModel) -> None:
        """The model's last request just ended: its keep-alive starts now."""
        served.last_used = time.monotonic()
        self._schedule_check(served)

    def _schedule_check(self, served: ServedModel) -> None:
        if served.pinned or served.keep_alive is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # before the server runs (startup): start() schedules it
            return
        if served.idle_timer is not None:
            served.idle_timer.cancel()  # one pending check per model, however many requests it had
        served.idle_timer = loop.call_later(max(self._due(served) - time.monotonic(), 0.0), self._idle_check, served)

    def _due(self, served: ServedModel) -> float:
        return max(served.last_used + (served.keep_alive or 0.0), served.handed_out + HANDOUT_GRACE_S)

    def _idle_check(self, served: ServedModel) -> None:
        served.idle_timer = None
        if self.loaded.get(served.model_id) is not served or served.pinned or served.keep_alive is None:
            return
        if served.in_flight:
            return  # its last request's end schedules the next check
        if time.monotonic() < self._due(served) - 1e-3:
            self._schedule_check(served)  # used again since this check was scheduled
            return
        task = asyncio.get_running_loop().create_task(self.unload(served, f"after {served.keep_alive:g} s idle"))
        task.add_done_callback(_log_failure)

    def start(self) -> None:
        """On the event loop, once serving: idle timers for the models loaded before it ran."""
        for served in self.loaded.values():
            self._schedule_check(served)

    def close(self) -> None:
        """At shutdown (the event loop has stopped): close every engine."""
        for served in list(self.loaded.values()):
            self._release([served.release()])
        self.loaded.clear()

    def abort_all(self) -> None:
        for served in self.loaded.values():
            served.abort_all()


def _why_kept(served: ServedModel) -> str:
    if served.pinned:
        return "pinned"
    if served.in_flight:
        return f"{served.in_flight} request{'s' if served.in_flight > 1 else ''} in flight"
    return "just used"


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("unloading a model failed: %r", task.exception())


def single_model_registry(engine, config) -> ModelRegistry:
    """A registry serving one engine (or Embedder) already loaded, under its name, its directory's and
    config.model_aliases; it loads and unloads nothing (create_app over an Engine: the caller owns the engine)."""
    from mlxpaged.embedding.embedder import Embedder

    name = engine.loaded.name
    catalog = ModelCatalog(dict.fromkeys(config.model_aliases, name), use_store=False)
    path = getattr(engine.loaded, "path", None)
    kind = "embed" if isinstance(engine, Embedder) else "generate"
    ref = getattr(engine.loaded, "ref", None)
    entry = catalog.add_given(name, ref, path if path is not None else Path(name), kind=kind)
    registry = ModelRegistry(catalog, config, RegistryPolicy(keep_alive=None), release=lambda holder: holder.clear())
    registry.add_loaded(entry, engine, config.sampling_defaults)
    return registry
