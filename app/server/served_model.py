"""One model the server has loaded: its Engine and everything a route needs to run requests on it (admission,
token text, sampling defaults, metrics), and what the registry needs to unload it (memory cost, last use,
keep-alive, requests in flight).

This is what `await state.served_model(name)` returns (state.py). A route reads `.engine`, `.admission`,
`.token_text`, `.model_id`, `.config` (the server's settings with this model's sampling defaults),
`.metrics`, `.active`, `.context_limit`, `.cache_limits_context`, `.default_max_tokens` and `.adapter` (the adapter
its generations run with: None, or for an adapter's name an `AdaptedModel` over the base). Once the registry
has unloaded the model, `.engine` raises the 503 `unavailable` (a request that held it too long retries).

`kind` is "generate" for an Engine. An embedding model is kind "embed": a `ServedEmbedder` holds its Embedder
(`.embedder`) with the same admission (one batch at a time), metrics, keep-alive and memory accounting, all in
`ServedBase`, which is what the registry reads. The registry hands a route only the kind it asks for
(state.served_model's `kind`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from mlxpaged.errors import MlxpagedError, user_message
from mlxpaged.units import format_size
from mlxpaged_app.server.admission import Admission
from mlxpaged_app.server.engine_client import Generation
from mlxpaged_app.server.errors import adapter_load_failed, unavailable
from mlxpaged_app.server.formatting import TokenText
from mlxpaged_app.server.metrics import ServerMetrics
from mlxpaged_app.server.model_catalog import CatalogEntry
from mlxpaged_app.server.server_log import log

import anyio

API_DEFAULT_MAX_TOKENS = 1024
ADAPTER_SLOT_WAIT_S = 30.0  # how long a request for a store adapter waits for a --max-loras slot to be idle
ADAPTER_HANDOUT_GRACE_S = 1.0  # an adapter just handed to a request is not detached before it submits
LONG_SEQUENCE_WARNING = "sequence-length-is-longer-than-the-specified-maximum"  # transformers' key for it


@dataclass(frozen=True)
class ModelCost:
    """The memory a loaded model holds, as the memory plan counts it (bytes)."""

    weights: int
    kv_cache: int
    state: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.state + self.activations

    def describe(self) -> str:
        parts = [("weights", self.weights), ("KV cache", self.kv_cache), ("state", self.state)]
        parts.append(("activations", self.activations))
        shown = " + ".join(f"{label} {format_size(size)}" for label, size in parts if size)
        return f"{format_size(self.total)} ({shown})" if shown else format_size(self.total)


def model_cost(model) -> ModelCost:
    """What a built Engine or Embedder holds."""
    from mlxpaged.embedding.embedder import Embedder

    return embedder_cost(model) if isinstance(model, Embedder) else engine_cost(model)


def embedder_cost(embedder) -> ModelCost:
    """An Embedder's weights and one pass's activations, as its own memory check counts them (no KV cache kept)."""
    from mlxpaged.embedding.memory import embedding_costs
    from mlxpaged.platform import backend

    weights, activations = embedding_costs(embedder.loaded.path, backend.current(), embedder.max_batch_tokens)
    return ModelCost(weights, 0, 0, activations)


def engine_cost(engine) -> ModelCost:
    """What a built engine holds: its weights, its pools and state slots as planned, its activations."""
    from mlxpaged.platform.memory import activation_bytes

    plan, facts = engine.plan, getattr(engine, "facts", None)
    activations = activation_bytes(facts, engine.scheduler_config.max_batch_tokens) if facts is not None else 0
    weights = facts.weight_bytes if facts is not None else 0
    return ModelCost(weights, plan.kv_bytes, getattr(plan, "state_bytes", 0), activations)


def fit_tokenizer_to_context(tokenizer, max_model_len: int) -> None:
    """transformers warns that a prompt past the tokenizer's model_max_length (the trained context) "will result
    in indexing errors". With --max-model-len the engine runs such prompts on purpose, so the limit follows it;
    past the engine's context nothing is indexed either (reply_budget refuses it, saying why), so the warning is
    marked as given."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the Hugging Face one
    length = getattr(inner, "model_max_length", None)
    if isinstance(length, int) and length < max_model_len:
        inner.model_max_length = max_model_len
    given = getattr(inner, "deprecation_warnings", None)
    if isinstance(given, dict):
        given[LONG_SEQUENCE_WARNING] = True


class ServedBase:
    """What every loaded model has for the registry and the routes: cost, keep-alive, admission, metrics, use."""

    kind = ""

    def __init__(
        self,
        entry: CatalogEntry,
        model,
        config,
        cost: ModelCost,
        *,
        keep_alive: float | None,
        pinned: bool = False,
        on_idle: Callable[[ServedBase], None] | None = None,
        batch: int = 1,
    ) -> None:
        self.entry, self._model, self.config, self.cost = entry, model, config, cost
        self.keep_alive, self.pinned = keep_alive, pinned
        self.metrics = ServerMetrics()
        notify = (lambda: on_idle(self)) if on_idle is not None else None
        self.admission = Admission(batch, config.max_queue, on_idle=notify)
        self.model_id = entry.name
        self.model_names = entry.names  # aliases (catalog.aliases) are mapped to a name before the lookup
        self.created = int(time.time())
        self.loaded_at = self.last_used = self.handed_out = time.monotonic()
        self.load_seconds = 0.0  # how long the registry took to load it (0: loaded before serving)
        self.unloaded = False
        self.idle_timer: asyncio.TimerHandle | None = None  # the registry's next keep-alive check

    def _held(self):
        if self._model is None:
            raise unavailable(f"model {self.model_id!r} was unloaded while this request waited; retry it")
        return self._model

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    def touch(self) -> None:
        """A route was just handed this model: it counts as used now."""
        self.last_used = self.handed_out = time.monotonic()

    def release(self):
        """Drop the model (the registry closes it): what still holds this object can no longer reach it."""
        model, self._model, self.unloaded = self._model, None, True
        return model

    def abort_all(self) -> None:
        """Withdraw what is in flight (generations end with "abort"; an embedding batch runs to its end)."""

    @property
    def context_limit(self) -> int | None:
        raise NotImplementedError

    def expires_in(self) -> float | None:
        """Seconds until the keep-alive unloads it (None: never; while requests run, the full keep-alive)."""
        if self.pinned or self.keep_alive is None:
            return None
        idle_for = 0.0 if self.in_flight else time.monotonic() - self.last_used
        return max(self.keep_alive - idle_for, 0.0)

    def status(self) -> dict:
        """For /v1/models, /health and `mlxpaged models --server`: loaded, memory, requests, keep-alive."""
        idle_for = 0.0 if self.in_flight else time.monotonic() - self.last_used
        return {
            "loaded": True,
            "kind": "embedding" if self.kind == "embed" else "generative",
            "memory_bytes": self.cost.total,
            "weights_bytes": self.cost.weights,
            "memory": self.cost.describe(),
            "requests_in_flight": self.in_flight,
            "pinned": self.pinned,
            "keep_alive_s": self.keep_alive,
            "idle_s": round(idle_for, 3),
        }


class ServedModel(ServedBase):
    """A loaded generative model and its per-model serving state (see the module docstring for what routes read)."""

    kind = "generate"
    adapter: str | None = None  # the base model: no adapter

    def __init__(self, entry: CatalogEntry, engine, config, cost: ModelCost, **kwargs) -> None:
        super().__init__(entry, engine, config, cost, batch=engine.scheduler_config.max_num_seqs, **kwargs)
        fit_tokenizer_to_context(engine.tokenizer, engine.max_model_len)
        self.token_text = TokenText(engine.tokenizer)
        self.active: set[Generation] = set()  # for abort_all at the end of a shutdown's drain
        self._store_adapters: dict[str, float] = {}  # store adapters attached on demand -> when last asked for
        self._adapter_lock = asyncio.Lock()
        self._adapter_timers: dict[str, asyncio.TimerHandle] = {}  # each store adapter's next keep-alive check

    @property
    def engine(self):
        return self._held()

    def release(self):
        self.token_text = TokenText(None)
        for timer in self._adapter_timers.values():
            timer.cancel()
        self._adapter_timers.clear()
        return super().release()

    async def use_adapter(self, name: str, path: str, trained_on: str | None = None) -> None:
        """Attach the store's adapter `name` (directory `path`) to this model's engine if it is not yet, detaching
        the least recently used idle one past --max-loras first (waiting up to ADAPTER_SLOT_WAIT_S for one to be idle).
        `trained_on`: the base its config names, which the catalog matched to this model (so the engine knows the
        model by that name too). A 500 `adapter_load_failed` with the reason for one that cannot be served (the model
        and its other adapters go on), a 503 when every slot stays busy."""
        async with self._adapter_lock:
            if name not in self._store_adapters:
                if trained_on is not None:
                    self.engine.adapters.known_as([trained_on])
                try:  # read and checked first: one that cannot be served detaches nothing
                    files = await anyio.to_thread.run_sync(self.engine.check_adapter, name, path)
                except MlxpagedError as exc:
                    raise adapter_load_failed(name, user_message(exc, "cli")) from None
                deadline = time.monotonic() + ADAPTER_SLOT_WAIT_S
                while len(self._store_adapters) >= self.config.max_loras and not await self._detach_idle_adapter():
                    if time.monotonic() > deadline:
                        raise unavailable(
                            f"all {self.config.max_loras} adapter slots of {self.model_id!r} (--max-loras) are in use"
                        )
                    await asyncio.sleep(0.05)
                try:
                    described = await anyio.to_thread.run_sync(self.engine.add_adapter, name, files)
                except MlxpagedError as exc:
                    raise adapter_load_failed(name, user_message(exc, "cli")) from None
                self.cost = replace(self.cost, weights=self.cost.weights + described["bytes"])
                log.info("adapter %s attached to %s (%s)", name, self.model_id, format_size(described["bytes"]))
            self._store_adapters[name] = time.monotonic()
            self._check_adapter_later(name)

    def generation_ended(self, adapter: str | None) -> None:
        """A request ran with `adapter` (None: the base model) until now: a store adapter's keep-alive starts again."""
        if adapter in self._store_adapters:
            self._store_adapters[adapter] = time.monotonic()
            self._check_adapter_later(adapter)

    def _check_adapter_later(self, name: str) -> None:
        """Detach the store adapter `name` once it has gone unused for the model's keep-alive (as the model itself is
        unloaded after it; never when the model has none)."""
        if self.keep_alive is None or self.unloaded:
            return
        if (timer := self._adapter_timers.pop(name, None)) is not None:
            timer.cancel()
        due = self._store_adapters[name] + self.keep_alive + ADAPTER_HANDOUT_GRACE_S
        loop = asyncio.get_running_loop()
        self._adapter_timers[name] = loop.call_later(max(due - time.monotonic(), 0.0), self._start_check, name)

    def _start_check(self, name: str) -> None:
        task = asyncio.get_running_loop().create_task(self._adapter_idle_check(name))
        task.add_done_callback(_log_check_failure)

    async def _adapter_idle_check(self, name: str) -> None:
        self._adapter_timers.pop(name, None)
        async with self._adapter_lock:
            if name not in self._store_adapters or self.unloaded or self.keep_alive is None:
                return
            if time.monotonic() < self._store_adapters[name] + self.keep_alive:
                self._check_adapter_later(name)  # used again since the check was set
            elif not await self._detach(name, f"after {self.keep_alive:g} s idle"):
                self._store_adapters[name] = time.monotonic()  # requests run with it: their end sets the next check
                self._check_adapter_later(name)

    async def _detach_idle_adapter(self) -> bool:
        """Detach the least recently used store adapter no request runs with, nor was just handed to one (it is about
        to submit); False when there is none."""
        handed = time.monotonic() - ADAPTER_HANDOUT_GRACE_S
        for name in sorted(self._store_adapters, key=self._store_adapters.__getitem__):
            if self._store_adapters[name] <= handed and await self._detach(
                name, f"for room (--max-loras {self.config.max_loras})"
            ):
                return True
        return False

    async def _detach(self, name: str, why: str) -> bool:
        """Detach the store adapter `name`; False (nothing changed) while requests run with it."""
        try:
            described = self.engine.adapters.resolve(name).describe()
            await anyio.to_thread.run_sync(self.engine.remove_adapter, name)
        except MlxpagedError:
            return False
        del self._store_adapters[name]
        if (timer := self._adapter_timers.pop(name, None)) is not None:
            timer.cancel()
        self.cost = replace(self.cost, weights=self.cost.weights - described["bytes"])
        log.info("adapter %s detached from %s %s", name, self.model_id, why)
        return True

    def abort_all(self) -> None:
        for generation in list(self.active):
            generation.abort(notify=True)

    @property
    def context_limit(self) -> int:
        """Prompt + reply tokens one sequence can hold: the model context, or the cache's limit if smaller."""
        capacity = self.engine.plan.token_capacity  # None: every layer slides, the cache fits any length
        return self.engine.max_model_len if capacity is None else min(self.engine.max_model_len, capacity)

    @property
    def cache_limits_context(self) -> bool:
        """Whether the KV cache, not the model context, is what bounds one sequence."""
        capacity = self.engine.plan.token_capacity
        return capacity is not None and capacity < self.engine.max_model_len

    @property
    def default_max_tokens(self) -> int:
        """The reply length when a request sets none (before clipping to the context): --default-max-tokens,
        else the model's max_new_tokens, else API_DEFAULT_MAX_TOKENS."""
        if self.config.default_max_tokens is not None:
            return self.config.default_max_tokens
        return self.config.sampling_defaults.values.get("max_tokens", API_DEFAULT_MAX_TOKENS)


class ServedEmbedder(ServedBase):
    """A loaded embedding model: `.embedder` (mlxpaged.embedding.Embedder), one batch at a time (its lock)."""

    kind = "embed"

    def __init__(self, entry: CatalogEntry, embedder, config, cost: ModelCost, **kwargs) -> None:
        super().__init__(entry, embedder, config, cost, batch=1, **kwargs)  # the rest wait in the queue

    @property
    def embedder(self):
        return self._held()

    @property
    def context_limit(self) -> int | None:
        """The longest input it embeds (None: the config names no limit)."""
        return self.embedder.max_input_tokens


class AdaptedModel:
    """A loaded model as a request for one of its adapters sees it: replies name the adapter, generations
    run with it, and everything else (engine, queue, metrics, keep-alive) is the base model's own, read through."""

    def __init__(self, base: ServedModel, adapter: str) -> None:
        self.base, self.adapter, self.model_id = base, adapter, adapter

    def __getattr__(self, name: str):
        return getattr(self.base, name)


def _log_check_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("detaching an idle adapter failed: %r", task.exception())
