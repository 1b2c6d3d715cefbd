"""Chat events as Anthropic's content-block events, the middle of a message's stream (shapes.MessageShape).

One block is open at a time and blocks are numbered in order (the SDK's accumulator indexes its content list by
them): thinking (thinking_delta), text (text_delta) and tool_use (input_json_delta, the arguments' JSON text as
it is generated).
"""

from __future__ import annotations

from mlxpaged_app.server.chat.spec import (
    ChatEvent,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)


class BlockStream:
    """Content-block events from chat events, for one message."""

    def __init__(self) -> None:
        self.index = -1  # of the latest block
        self.open: str | None = None  # type of the open block

    def feed(self, event: ChatEvent) -> list[dict]:
        if isinstance(event, TextDelta):
            return self._ensure("text", {"type": "text", "text": ""}) + self._delta(
                {"type": "text_delta", "text": event.text}
            )
        if isinstance(event, ReasoningDelta):
            return self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""}) + self._delta(
                {"type": "thinking_delta", "thinking": event.text}
            )
        if isinstance(event, ToolCallStart):
            return self.close() + self._start(
                "tool_use", {"type": "tool_use", "id": event.id, "name": event.name, "input": {}}
            )
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
