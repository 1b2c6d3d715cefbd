"""What every route shares: the HTTP-side settings, and the state built once per app around a model registry.

Routes get a model's state through ONE call, `await state.served_model(name)` (ServerState below): it returns
the loaded model's `ServedModel` (served_model.py: `.engine`, `.admission`, `.token_text`, `.model_id`,
`.config`, `.metrics`, ...), loading it first if needed, and raises the API errors routes already answer with:
404 `model_not_found` for a name the server cannot serve, 503 `unavailable` / `insufficient_memory` /
`model_loading`, 500 `model_load_failed` with the reason. `kind` says what the route runs: "generate" (the chat
routes; an embedding model is refused with 400 before it is loaded), "embed" (the embedding routes get a
`ServedEmbedder`; a generative model is refused saying why it cannot embed) or None (either: Ollama's /api/show).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mlxpaged.loading.generation_defaults import NO_DEFAULTS, GenerationDefaults
from mlxpaged_app.server.errors import embedding_model_only, model_not_found, not_an_embedding_model, unavailable
from mlxpaged_app.server.images import ImagePolicy
from mlxpaged_app.server.metrics import ServerMetrics
from mlxpaged_app.server.model_catalog import ModelNotServable
from mlxpaged_app.server.model_registry import UNSET, ModelRegistry, WrongKind
from mlxpaged_app.server.served_model import (  # noqa: F401  (re-exported: their home was here)
    API_DEFAULT_MAX_TOKENS,
    LONG_SEQUENCE_WARNING,
    AdaptedModel,
    ServedModel,
    fit_tokenizer_to_context,
)

import anyio


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings (the engine has its own CacheConfig and SchedulerConfig)."""

    api_key: str | None = None
    max_body_size: int = 50_000_000  # images come base64 in the body
    max_queue: int = 64
    default_max_tokens: int | None = None  # None: the model's max_new_tokens, else API_DEFAULT_MAX_TOKENS
    cors_origins: tuple[str, ...] = ()
    model_aliases: tuple[str, ...] = field(default_factory=tuple)  # more names for the first model (--model)
    # What requests get for the sampling fields they leave unset; each model served carries its own copy of this
    # config with its own (--generation-config auto). NO_DEFAULTS: the plain API defaults (temperature 1.0).
    sampling_defaults: GenerationDefaults = NO_DEFAULTS
    images: ImagePolicy = field(default_factory=ImagePolicy)  # what a request's images may be (server/images.py)
    max_loras: int = 8  # store adapters one model keeps attached at once (adapter_catalog.py); --lora ones not counted


class ServerState:
    """Everything a route needs: the settings, the models (a ModelRegistry), draining, the HTTP counters."""

    def __init__(self, registry: ModelRegistry, config: ServerConfig) -> None:
        self.registry, self.config = registry, config
        self.metrics = ServerMetrics()  # HTTP requests by route and status; each model has its own token counts
        self.created = int(time.time())
        self.draining = False
        self.responses_in_progress = 0  # HTTP requests whose response has not ended (middleware.py counts them)

    async def served_model(self, name: str | None, keep_alive: object = UNSET, kind: str | None = "generate"):
        """The per-model state for a request's `model` (None: the default model), loaded if needed: a
        ServedModel for kind "generate", a ServedEmbedder for "embed", either for None.

        `keep_alive`: seconds (None: never unload), already parsed (keep_alive.parse_keep_alive); UNSET keeps
        the model's own. Raises APIError: 404 model_not_found, 400 for a model of the other kind (with the
        reason), 503 (cannot fit, still loading, shutting down), 500 model_load_failed with the reason."""
        self.check_accepting()
        target = self.registry.catalog.adapters.target(name) if kind != "embed" else None
        if target is not None:  # an adapter: its base model, running it (attached first if it is the store's)
            served = await self.served_model(target.base.name, keep_alive, kind)
            if not target.given:
                await served.use_adapter(target.name, target.path, target.trained_on)
            return AdaptedModel(served, target.name)
        try:
            return await self.registry.get(name, keep_alive, kind)
        except WrongKind as exc:
            if exc.entry.kind == "embed":
                raise embedding_model_only(exc.entry.name) from None
            raise not_an_embedding_model(exc.entry.name, exc.reason()) from None
        except ModelNotServable as exc:
            raise await self._not_found(name, exc) from None

    async def expire_model(self, name: str | None) -> None:
        """Unload `name` now if it is loaded and idle, else once its requests end (Ollama's keep_alive 0 with
        nothing to run); a model not loaded stays so. 404 for a name the server cannot serve."""
        self.check_accepting()
        try:
            await self.registry.expire(name)
        except ModelNotServable as exc:
            raise await self._not_found(name, exc) from None

    async def _not_found(self, name: str | None, why: ModelNotServable):
        served = await anyio.to_thread.run_sync(self.registry.catalog.names_served)  # reads the store
        error = model_not_found(name or "(none)", served)
        error.message = f"{error.message}. {why}"
        return error

    def abort_all(self) -> None:
        """Withdraw every in-flight generation of every model: each ends now with finish_reason "abort"."""
        self.registry.abort_all()

    def check_accepting(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down and takes no new requests")
