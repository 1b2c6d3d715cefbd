"""The request path every API shares: read and check the request (`accept`), take queue slots and start
(`launch`), then answer in the API's shape (`respond`): a stream of server-sent events, or one JSON body once
the reply is whole unless the client leaves first.

What differs between the APIs is only how a reply looks; a `ReplyShape` says that for one reply and never sees
the transport. OpenAI chat, completions, Anthropic Messages, Responses and Ollama's chat and generate each have one.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import ExitStack, aclosing
from typing import TypeVar

from mlxpaged.sampling_params import MAX_N
from mlxpaged_app.server.engine_client import Generation, GenerationFailed
from mlxpaged_app.server.errors import invalid_param, server_error
from mlxpaged_app.server.keep_alive import KeepAliveError, parse_keep_alive
from mlxpaged_app.server.model_registry import UNSET
from mlxpaged_app.server.request_body import parse_request, read_body
from mlxpaged_app.server.sse import (
    EVENT_STREAM,
    ClientGone,
    EventStream,
    data_event,
    unless_disconnected,
    with_pings,
)
from mlxpaged_app.server.state import ServedModel, ServerState

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the metrics count it
PING_INTERVAL = 15.0  # seconds of silence before a shape's keep-alive event


class ReplyShape:
    """One reply in one API's shape, fed what the run produces per choice (`item`: an engine delta, or the chat
    events one delta completed). Streamed: `opening()`, `chunks()` per item, then `closing(usage)` - or
    `failed(message)` if the engine failed after the headers went out - and `trailer`; every payload goes out
    through `frame`. Whole: `add()` per item, then `body(usage)`."""

    headers: dict[str, str]
    frame: Callable[[dict | str], bytes] = staticmethod(data_event)
    media_type: str = EVENT_STREAM  # of a streamed reply (Ollama's: NDJSON lines)
    trailer: tuple = ()  # payloads after either ending (OpenAI's "[DONE]")
    keepalive: dict | None = None  # sent after PING_INTERVAL seconds without an event (Anthropic's ping)

    def opening(self) -> list:
        return []

    def chunks(self, choice: int, item) -> list:
        raise NotImplementedError

    def closing(self, usage: dict) -> list:
        return []

    def failed(self, message: str) -> list:
        raise NotImplementedError

    def add(self, choice: int, item) -> None:
        raise NotImplementedError

    def body(self, usage: dict) -> dict:
        raise NotImplementedError


def reply_id(shape: ReplyShape) -> str:
    """The id the client sees for this reply (OpenAI's x-request-id, Anthropic's request-id): for log lines."""
    return shape.headers.get("x-request-id") or shape.headers.get("request-id") or "-"


async def accept(request: Request, state: ServerState, schema: type) -> tuple[object, float]:
    """What every API does first: note the arrival, refuse while draining, read and validate the body against
    `schema`. Returns (body, arrived); `model_for` then finds (or loads) the model it names."""
    arrived = time.perf_counter()
    state.check_accepting()
    body = parse_request(await read_body(request, state.config.max_body_size), schema)
    return body, arrived


async def model_for(state: ServerState, body) -> ServedModel:
    """The model `body.model` names, with the body's `keep_alive` (Ollama's field, accepted as an extension by
    every API: how long the model stays loaded once idle; 0 unloads it after this request, -1 never)."""
    return await state.served_model(body.model, request_keep_alive(getattr(body, "keep_alive", None)))


def request_keep_alive(value) -> object:
    """A body's keep_alive, parsed (seconds, None for never); UNSET when it sent none. 400 naming it if bad."""
    if value is None:
        return UNSET
    try:
        return parse_keep_alive(value)
    except KeepAliveError as exc:
        raise invalid_param("keep_alive", str(exc)) from None


async def launch(
    model: ServedModel, count: int, start: Callable[[], Awaitable[Generation]], route: str
) -> tuple[Generation, ExitStack]:
    """Take `count` queue slots, then `start()`; the ExitStack returned withdraws whatever has not finished
    and frees the slots: every API closes it once its reply is done (or its client is gone: what it left is
    counted and logged under `route`, the request's path)."""
    cleanup = ExitStack()
    cleanup.enter_context(model.admission.slot(count))
    try:
        generation = await start()
    except BaseException:
        cleanup.close()
        raise
    model.active.add(generation)
    cleanup.callback(model.generation_ended, model.adapter)  # a store adapter's keep-alive starts then
    cleanup.callback(model.active.discard, generation)
    cleanup.callback(generation.left, route)  # runs first: whatever has not finished is withdrawn
    return generation, cleanup


def sane_n(n: int | None) -> int:
    """For counting queue slots only; SamplingParams rejects an n out of range with a 400 later."""
    return 1 if n is None else max(1, min(n, MAX_N))


async def respond(
    request: Request,
    shape: ReplyShape,
    stream: bool,
    items: AsyncIterator[tuple[int, object]],
    usage: Callable[[], dict],
    cleanup: ExitStack,
) -> Response:
    """The reply to a launched request: `items` are (choice, item) as the run produces them, `usage` its token
    counts once it has ended; `cleanup` is closed when the reply is done or the client is gone."""
    if stream:
        events = stream_events(shape, items, usage)
        return EventStream(events, on_close=cleanup.close, headers=shape.headers, media_type=shape.media_type)
    try:
        body = await reply_or_gone(request, _whole(shape, items, usage), cleanup)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(body, headers=shape.headers)


async def reply_or_gone(request: Request, work: Awaitable[T], cleanup: ExitStack) -> T:
    """A whole (non-streamed) reply: ClientGone if the client left first, 500 if the engine failed."""
    try:
        return await unless_disconnected(request.receive, work)
    except GenerationFailed as exc:
        raise server_error(str(exc)) from exc
    finally:
        cleanup.close()


async def _whole(shape: ReplyShape, items: AsyncIterator[tuple[int, object]], usage: Callable[[], dict]) -> dict:
    async for choice, item in items:
        shape.add(choice, item)
    return shape.body(usage())


async def stream_events(
    shape: ReplyShape, items: AsyncIterator[tuple[int, object]], usage: Callable[[], dict]
) -> AsyncIterator[bytes]:
    for payload in shape.opening():
        yield shape.frame(payload)
    source = items if shape.keepalive is None else with_pings(items, PING_INTERVAL)
    try:
        async with aclosing(source) as produced:  # closed at once if the client goes
            async for produced_item in produced:
                payloads = [shape.keepalive] if produced_item is None else shape.chunks(*produced_item)
                for payload in payloads:
                    yield shape.frame(payload)
    except GenerationFailed as exc:  # the headers are out: report in-band, as each API does
        ending = shape.failed(str(exc))
    else:
        ending = shape.closing(usage())
    for payload in (*ending, *shape.trailer):
        yield shape.frame(payload)
