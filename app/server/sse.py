"""Server-sent events: their framing (one framer for every API), keep-alives for silent stretches, and a response
that ends its engine request however the connection ends (it also streams Ollama's NDJSON lines: only the media
type differs).

Starlette's StreamingResponse notices a client that left only when it next writes, and never
runs cleanup if the client leaves before the first chunk. `EventStream` watches for
`http.disconnect` alongside the writes and calls `on_close` in a `finally`: after the last
event, when the client goes away (the engine request is then aborted at its next step), and
when the server cancels the task at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


def sse_event(payload: dict | str, name: str | None = None) -> bytes:
    """One event: an `event:` line when it has a name, then `data:`, a JSON payload (compact) or a literal such
    as "[DONE]"."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return (f"event: {name}\n" if name is not None else "").encode() + f"data: {data}\n\n".encode()


def data_event(payload: dict | str) -> bytes:
    """OpenAI chat and completions: unnamed `data:` events."""
    return sse_event(payload)


def named_event(payload: dict) -> bytes:
    """Anthropic and Responses: every event named by its payload's type (Anthropic's SDK skips unnamed ones)."""
    return sse_event(payload, payload["type"])


DONE = data_event("[DONE]")  # OpenAI's end-of-stream marker


class ClientGone(Exception):
    """The client closed the connection before its reply was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """`await work`, or raise ClientGone (cancelling the work) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        finished = task.done()
        if not finished:
            task.cancel()
    if not finished:
        raise ClientGone()
    return task.result()


EVENT_STREAM = "text/event-stream; charset=utf-8"


class EventStream:
    """An ASGI response streaming `events` (already framed bytes), as text/event-stream unless `media_type` says
    otherwise."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[], None],
        headers: dict[str, str] | None = None,
        media_type: str = EVENT_STREAM,
    ) -> None:
        self.events, self.on_close, self.media_type = events, on_close, media_type
        self.headers = {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}
        self.status_code = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._cancel_on_disconnect, receive, group.cancel_scope)
                await self._send_all(send)
                group.cancel_scope.cancel()
        except OSError:  # the client went away during a write
            pass
        finally:
            self.on_close()
            await _close_quietly(self.events)

    @staticmethod
    async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
        await wait_for_disconnect(receive)
        scope.cancel()

    async def _send_all(self, send: Send) -> None:
        headers = [(b"content-type", self.media_type.encode("latin-1"))]
        headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _close_quietly(events: AsyncIterator[bytes]) -> None:
    close = getattr(events, "aclose", None)
    if close is None:
        return
    with anyio.CancelScope(shield=True):
        with contextlib.suppress(Exception):
            await close()


async def with_pings(items: AsyncIterator[T], interval: float) -> AsyncIterator[T | None]:
    """The items, and None each time `interval` seconds pass without one (the pending item keeps waiting), so a
    stream can send a keep-alive through a long prefill before proxies and clients time it out."""
    iterator = items.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
