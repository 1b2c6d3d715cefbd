"""What both generation endpoints do: read and check the request, take a queue slot, tokenize off
the event loop, submit, then stream events or collect the whole reply.

An endpoint (openai_chat.ChatEndpoint, openai_completions.CompletionEndpoint) supplies the parts
that differ: its schema, prompt handling and response shapes.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxpaged.sampling import MAX_N
from mlxpaged_app.server.engine_client import Admission, Generation, GenerationFailed
from mlxpaged_app.server.errors import model_not_found, server_error, unavailable
from mlxpaged_app.server.formatting import DONE, ChoiceText, Envelope, TokenText, new_id, sse
from mlxpaged_app.server.metrics import ServerMetrics
from mlxpaged_app.server.params import resolve_max_tokens
from mlxpaged_app.server.protocol import parse_request, read_body
from mlxpaged_app.server.sse import ClientGone, EventStream, unless_disconnected

CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the metrics count it


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings (the engine has its own CacheConfig)."""
    api_key: str | None = None
    max_body_size: int = 4_000_000
    max_queue: int = 64
    default_max_tokens: int = 1024
    cors_origins: tuple[str, ...] = ()
    model_aliases: tuple[str, ...] = field(default_factory=tuple)


class ServerState:
    """Everything a route needs, built once per app around one Engine."""

    def __init__(self, engine, config: ServerConfig) -> None:
        self.engine, self.config = engine, config
        self.metrics = ServerMetrics()
        self.admission = Admission(engine.cache_config.max_num_seqs, config.max_queue)
        self.token_text = TokenText(engine.tokenizer)
        self.model_id = engine.loaded.name
        path = getattr(engine.loaded, "path", None)
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

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested not in self.model_names:
            raise model_not_found(requested, [self.model_id])

    def check_accepting(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down and takes no new requests")


async def serve_generation(request: Request, state: ServerState, endpoint_class) -> Response:
    arrived = time.perf_counter()
    state.check_accepting()
    body = parse_request(await read_body(request, state.config.max_body_size), endpoint_class.schema)
    state.check_model(body.model)
    endpoint = endpoint_class(state.engine, state.token_text)
    sources = endpoint.validate(body)
    count = len(sources) * _sane_n(body.n)
    cleanup = ExitStack()
    cleanup.enter_context(state.admission.slot(count))
    try:
        generation = await _start(state, endpoint, body, sources, arrived)
    except BaseException:
        cleanup.close()
        raise
    state.active.add(generation)
    cleanup.callback(state.active.discard, generation)
    cleanup.callback(generation.abort)  # runs first: whatever has not finished is withdrawn
    envelope = Envelope(new_id(endpoint.id_prefix), state.model_id)
    headers = {"x-request-id": envelope.id}
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _events(endpoint, generation, envelope, count, usage)
        return EventStream(events, on_close=cleanup.close, headers=headers)
    try:
        choices = await unless_disconnected(request.receive, _collect(generation, count))
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    except GenerationFailed as exc:
        raise server_error(str(exc)) from exc
    finally:
        cleanup.close()
    return JSONResponse(endpoint.response(envelope, choices, generation.usage()), headers=headers)


def _sane_n(n: int | None) -> int:
    """For counting queue slots only; SamplingParams rejects an n out of range with a 400 later."""
    return 1 if n is None else max(1, min(n, MAX_N))


async def _start(state: ServerState, endpoint, body, sources: list, arrived: float) -> Generation:
    prompts = await anyio.to_thread.run_sync(endpoint.tokenize, sources)
    longest = max(len(p) for p in prompts)
    max_tokens = resolve_max_tokens(endpoint.requested_max_tokens(body), longest, state.context_limit,
                                    state.config.default_max_tokens)
    params = endpoint.params(body, max_tokens)
    generation = Generation(state.engine, state.metrics, params.n, arrived)
    generation.submit(prompts, params, endpoint.prompt_param)
    return generation


async def _collect(generation: Generation, count: int) -> list[ChoiceText]:
    choices = [ChoiceText() for _ in range(count)]
    async for choice, delta in generation.deltas():
        choices[choice].add(delta)
    return choices


async def _events(endpoint, generation: Generation, envelope: Envelope, count: int,
                  include_usage: bool) -> AsyncIterator[bytes]:
    for chunk in endpoint.stream_start(envelope, count):
        yield sse(chunk)
    try:
        async for choice, delta in generation.deltas():
            chunk = endpoint.stream_chunk(envelope, choice, delta)
            if chunk is not None:
                yield sse(chunk)
    except GenerationFailed as exc:  # headers are sent: report in-band, as OpenAI does
        yield sse(server_error(str(exc)).body())
    else:
        if include_usage:
            yield sse(envelope.body(endpoint.chunk_object, [], usage=generation.usage()))
    yield DONE
