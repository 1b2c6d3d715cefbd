"""A chat run as Anthropic's server-sent events.

    message_start, ping, (content_block_start, content_block_delta*, content_block_stop)*, message_delta,
    message_stop        (or an `error` event if the engine fails after the headers went out)

Every event has an `event:` line: the SDK skips events without one. One block is open at a time and blocks are
numbered in order (the SDK's accumulator indexes its content list by them): thinking (thinking_delta), text
(text_delta) and tool_use (input_json_delta, the arguments' JSON text as it is generated). A ping goes out
after message_start and after every PING_INTERVAL seconds without an event (a long prefill on a CPU), so
proxies and clients do not time the stream out.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing
from typing import AsyncIterator, TypeVar

from mlxpaged_app.server.anthropic.errors import error_body
from mlxpaged_app.server.anthropic.shapes import stop_reason, usage
from mlxpaged_app.server.chat.pipeline import ChatRun
from mlxpaged_app.server.chat.spec import (ChatEvent, Finish, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallEnd,
                                           ToolCallStart)
from mlxpaged_app.server.engine_client import GenerationFailed

T = TypeVar("T")
PING_INTERVAL = 15.0  # seconds of silence before a ping


def sse(payload: dict) -> bytes:
    """One event named by its payload's type, as Anthropic frames them."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


PING = sse({"type": "ping"})


class BlockStream:
    """Content-block events from chat events, for one message."""

    def __init__(self) -> None:
        self.index = -1  # of the latest block
        self.open: str | None = None  # type of the open block

    def feed(self, event: ChatEvent) -> list[dict]:
        if isinstance(event, TextDelta):
            return self._ensure("text", {"type": "text", "text": ""}) + \
                self._delta({"type": "text_delta", "text": event.text})
        if isinstance(event, ReasoningDelta):
            return self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""}) + \
                self._delta({"type": "thinking_delta", "thinking": event.text})
        if isinstance(event, ToolCallStart):
            return self.close() + self._start("tool_use", {"type": "tool_use", "id": event.id, "name": event.name,
                                                           "input": {}})
        if isinstance(event, ToolCallArgs) and self.open == "tool_use":
            return self._delta({"type": "input_json_delta", "partial_json": event.text})
        if isinstance(event, (ToolCallEnd, Finish)):
            return self.close()
        return []  # token logprobs: the Messages API has none

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _ensure(self, kind: str, block: dict) -> list[dict]:
        return [] if self.open == kind else self.close() + self._start(kind, block)

    def _start(self, kind: str, block: dict) -> list[dict]:
        self.index += 1
        self.open = kind
        return [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict) -> list[dict]:
        return [{"type": "content_block_delta", "index": self.index, "delta": delta}]


async def message_events(run: ChatRun, envelope: dict) -> AsyncIterator[bytes]:
    """`envelope`: the message's id, type, role and model."""
    usage_now = {"input_tokens": run.prompt_tokens, "output_tokens": 0}  # cached tokens are known at the end
    yield sse({"type": "message_start", "message": {**envelope, "content": [], "stop_reason": None,
                                                    "stop_sequence": None, "usage": usage_now}})
    yield PING
    blocks, finish = BlockStream(), None
    try:
        async with aclosing(with_pings(run.events(), PING_INTERVAL)) as items:  # closed at once if the client goes
            async for item in items:
                if item is None:
                    yield PING
                    continue
                for event in item[1]:
                    finish = event if isinstance(event, Finish) else finish
                    for payload in blocks.feed(event):
                        yield sse(payload)
    except GenerationFailed as exc:  # the headers are out: report in-band, as Anthropic does
        yield sse(error_body(500, str(exc)))
        return
    delta = {"stop_reason": stop_reason(finish), "stop_sequence": finish.stop_sequence if finish else None}
    yield sse({"type": "message_delta", "delta": delta, "usage": usage(run.usage())})
    yield sse({"type": "message_stop"})


async def with_pings(items: AsyncIterator[T], interval: float) -> AsyncIterator[T | None]:
    """The items, and None each time `interval` seconds pass without one (the pending item keeps waiting)."""
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
