"""The flow every generation API shares: take queue slots and start (`launch`), and wait for a whole reply
unless the client leaves (`reply_or_gone`); and /v1/completions over them: read and check the request,
tokenize off the event loop, submit, then stream events or collect the whole reply. Chat-shaped APIs run
through chat/pipeline.py on the same two pieces.

A `GenerationEndpoint` supplies the parts that differ: its schema, prompt handling and response shapes.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import AsyncIterator, Awaitable, Callable, Protocol, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxpaged.engine.engine import StreamDelta
from mlxpaged.sampling_params import MAX_N, SamplingParams
from mlxpaged.loading.generation_defaults import GenerationDefaults
from mlxpaged_app.server.engine_client import Generation, GenerationFailed
from mlxpaged_app.server.errors import server_error
from mlxpaged_app.server.formatting import TokenText, new_id
from mlxpaged_app.server.openai.shapes import ChoiceText, Envelope
from mlxpaged_app.server.params import resolve_max_tokens
from mlxpaged_app.server.request_body import parse_request, read_body
from mlxpaged_app.server.sse import DONE, ClientGone, EventStream, data_event, unless_disconnected
from mlxpaged_app.server.state import ServerState

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the metrics count it


class GenerationEndpoint(Protocol):
    """The parts of a prompt-in, text-out API (serving_completion.CompletionEndpoint); one instance serves
    one request."""
    schema: type  # the pydantic request model (protocol.py)
    chunk_object: str  # the `object` of a streamed chunk, e.g. "chat.completion.chunk"
    prompt_param: str  # the API parameter an unusable prompt is blamed on
    id_prefix: str

    def __init__(self, engine, token_text: TokenText) -> None: ...

    def validate(self, body) -> list:
        """Checks the parts the schema cannot; returns one source (messages, text, ids) per prompt."""

    def tokenize(self, sources: list) -> list[list[int]]:
        """Runs in a worker thread."""

    def requested_max_tokens(self, body) -> int | None: ...

    def params(self, body, max_tokens: int, defaults: GenerationDefaults) -> SamplingParams:
        """`defaults`: the model's, for the sampling fields the request leaves unset (params.sampling_kwargs)."""

    def response(self, envelope: Envelope, choices: list[ChoiceText], usage: dict) -> dict: ...

    def stream_start(self, envelope: Envelope, count: int) -> list[dict]: ...

    def stream_chunk(self, envelope: Envelope, choice: int, delta: StreamDelta) -> dict | None:
        """None: nothing to send for this delta yet."""


async def serve_generation(request: Request, state: ServerState,
                           endpoint_class: type[GenerationEndpoint]) -> Response:
    arrived = time.perf_counter()
    state.check_accepting()
    body = parse_request(await read_body(request, state.config.max_body_size), endpoint_class.schema)
    state.check_model(body.model)
    endpoint = endpoint_class(state.engine, state.token_text)
    sources = endpoint.validate(body)
    count = len(sources) * sane_n(body.n)
    generation, cleanup = await launch(state, count, lambda: _start(state, endpoint, body, sources, arrived))
    envelope = Envelope(new_id(endpoint.id_prefix), state.model_id)
    headers = {"x-request-id": envelope.id}
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _events(endpoint, generation, envelope, count, usage)
        return EventStream(events, on_close=cleanup.close, headers=headers)
    try:
        choices = await reply_or_gone(request, _collect(generation, count), cleanup)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(endpoint.response(envelope, choices, generation.usage()), headers=headers)


async def launch(state: ServerState, count: int,
                 start: Callable[[], Awaitable[Generation]]) -> tuple[Generation, ExitStack]:
    """Take `count` queue slots, then `start()`; the ExitStack returned withdraws whatever has not finished
    and frees the slots: every API closes it once its reply is done (or its client is gone)."""
    cleanup = ExitStack()
    cleanup.enter_context(state.admission.slot(count))
    try:
        generation = await start()
    except BaseException:
        cleanup.close()
        raise
    state.active.add(generation)
    cleanup.callback(state.active.discard, generation)
    cleanup.callback(generation.abort)  # runs first: whatever has not finished is withdrawn
    return generation, cleanup


async def reply_or_gone(request: Request, work: Awaitable[T], cleanup: ExitStack) -> T:
    """A whole (non-streamed) reply: ClientGone if the client left first, 500 if the engine failed."""
    try:
        return await unless_disconnected(request.receive, work)
    except GenerationFailed as exc:
        raise server_error(str(exc)) from exc
    finally:
        cleanup.close()


def sane_n(n: int | None) -> int:
    """For counting queue slots only; SamplingParams rejects an n out of range with a 400 later."""
    return 1 if n is None else max(1, min(n, MAX_N))


async def _start(state: ServerState, endpoint: GenerationEndpoint, body, sources: list, arrived: float) -> Generation:
    prompts = await anyio.to_thread.run_sync(endpoint.tokenize, sources)
    longest = max(len(p) for p in prompts)
    max_tokens = resolve_max_tokens(endpoint.requested_max_tokens(body), longest, state.context_limit,
                                    state.default_max_tokens)
    params = endpoint.params(body, max_tokens, state.config.sampling_defaults)
    generation = Generation(state.engine, state.metrics, params.n, arrived)
    generation.submit(prompts, params, endpoint.prompt_param)
    return generation


async def _collect(generation: Generation, count: int) -> list[ChoiceText]:
    choices = [ChoiceText() for _ in range(count)]
    async for choice, delta in generation.deltas():
        choices[choice].add(delta)
    return choices


async def _events(endpoint: GenerationEndpoint, generation: Generation, envelope: Envelope, count: int,
                  include_usage: bool) -> AsyncIterator[bytes]:
    for chunk in endpoint.stream_start(envelope, count):
        yield data_event(chunk)
    try:
        async for choice, delta in generation.deltas():
            chunk = endpoint.stream_chunk(envelope, choice, delta)
            if chunk is not None:
                yield data_event(chunk)
    except GenerationFailed as exc:  # headers are sent: report in-band, as OpenAI does
        yield data_event(server_error(str(exc)).body())
    else:
        if include_usage:
            yield data_event(envelope.body(endpoint.chunk_object, [], usage=generation.usage()))
    yield DONE
