"""What every route shares: the HTTP-side settings and the state built once per app around one served model."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mlxpaged.embedding.embedder import Embedder
from mlxpaged.loading.generation_defaults import NO_DEFAULTS, GenerationDefaults
from mlxpaged_app.server.admission import Admission
from mlxpaged_app.server.engine_client import Generation
from mlxpaged_app.server.errors import embedding_model_only, model_not_found, unavailable
from mlxpaged_app.server.formatting import TokenText
from mlxpaged_app.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings (the engine has its own CacheConfig and SchedulerConfig)."""

    api_key: str | None = None
    max_body_size: int = 4_000_000
    max_queue: int = 64
    default_max_tokens: int | None = None  # None: the model's max_new_tokens, else API_DEFAULT_MAX_TOKENS
    cors_origins: tuple[str, ...] = ()
    model_aliases: tuple[str, ...] = field(default_factory=tuple)
    # What requests get for the sampling fields they leave unset; `mlxpaged serve` fills it from the model
    # (--generation-config auto). NO_DEFAULTS: the plain API defaults (temperature 1.0, top_p 1.0).
    sampling_defaults: GenerationDefaults = NO_DEFAULTS


API_DEFAULT_MAX_TOKENS = 1024


LONG_SEQUENCE_WARNING = "sequence-length-is-longer-than-the-specified-maximum"  # transformers' key for it


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


class ServerState:
    """Everything a route needs, built once per app around the model it serves: a generative `Engine`, or an
    `Embedder` when the model is an embedding model (then `engine` is None: chat routes refuse in check_model, and
    embeddings/lookup.py hands the embedder to /v1/embeddings and /api/embed)."""

    def __init__(self, served, config: ServerConfig) -> None:
        self.config = config
        self.embedder: Embedder | None = served if isinstance(served, Embedder) else None
        self.engine = None if self.embedder is not None else served
        self.metrics = ServerMetrics()
        if self.engine is not None:
            fit_tokenizer_to_context(self.engine.tokenizer, self.engine.max_model_len)
        # An embedder runs one request's batch at a time; the rest wait in the queue.
        batch = 1 if self.engine is None else self.engine.scheduler_config.max_num_seqs
        self.admission = Admission(batch, config.max_queue)
        self.token_text = TokenText(served.tokenizer)
        self.model_id = served.loaded.name
        path = getattr(served.loaded, "path", None)
        self.model_names = {self.model_id, *config.model_aliases, *((str(path), path.name) if path else ())}
        self.created = int(time.time())
        self.draining = False
        self.active: set[Generation] = set()  # for abort_all at the end of a shutdown's drain

    def abort_all(self) -> None:
        """Withdraw every in-flight generation: each ends now with finish_reason "abort"."""
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

    def check_model(self, requested: str | None) -> None:
        """The generative routes' check (chat, completions, messages, responses): the model is served, and it is
        no embedding model."""
        if requested is not None and requested not in self.model_names:
            raise model_not_found(requested, [self.model_id])
        if self.engine is None:
            raise embedding_model_only(self.model_id)

    def check_accepting(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down and takes no new requests")
