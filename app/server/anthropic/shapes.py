"""Anthropic's `message` reply: the body from a chat run's results (content blocks, stop_reason, usage), and its
server-sent events:

    message_start, ping, (content_block_start, content_block_delta*, content_block_stop)*, message_delta,
    message_stop        (or an `error` event if the engine fails after the headers went out)

Every event has an `event:` line: the SDK skips events without one. A ping goes out after message_start and
after every serving.PING_INTERVAL seconds without an event (a long prefill on a CPU), so proxies and clients do
not time the stream out.

usage: `input_tokens` counts only the prompt tokens that were computed; `cache_read_input_tokens` those the
prefix cache served (their sum is the prompt, as Anthropic documents it); nothing is billed for writing the
cache here, so `cache_creation_input_tokens` is 0."""

from __future__ import annotations

from mlxpaged_app.server.anthropic.errors import error_body, new_request_id
from mlxpaged_app.server.anthropic.streaming import BlockStream
from mlxpaged_app.server.chat.pipeline import ChoiceResult
from mlxpaged_app.server.chat.spec import ChatEvent, Finish
from mlxpaged_app.server.formatting import new_id
from mlxpaged_app.server.serving import ReplyShape
from mlxpaged_app.server.sse import named_event

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
PING = {"type": "ping"}


def envelope(model: str) -> dict:
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": model}


def stop_reason(finish: Finish | None) -> str | None:
    """None when the run was aborted (server shutdown): it did not end on its own."""
    if finish is None:
        return None
    if finish.reason == "stop" and finish.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish.reason)


def usage(counts: dict) -> dict:
    """From the pipeline's OpenAI-style usage counts."""
    prompt, cached = counts["prompt_tokens"], counts["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": prompt - cached,
        "output_tokens": counts["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def content_blocks(choice: ChoiceResult) -> list[dict]:
    """thinking, text, then tool_use blocks; a call cut off by max_tokens (never ended) is left out."""
    blocks: list[dict] = []
    if choice.reasoning:
        blocks.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
    if choice.text:
        blocks.append({"type": "text", "text": choice.text})
    blocks += [
        {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
        for call in choice.tool_calls
        if call.arguments is not None
    ]
    return blocks


def message_body(env: dict, choice: ChoiceResult, counts: dict) -> dict:
    finish = choice.finish
    return {
        **env,
        "content": content_blocks(choice),
        "stop_reason": stop_reason(finish),
        "stop_sequence": finish.stop_sequence if finish is not None else None,
        "usage": usage(counts),
    }


class MessageShape(ReplyShape):
    """One message, streamed or whole (Messages has a single choice)."""

    frame = staticmethod(named_event)
    keepalive = PING

    def __init__(self, model: str, prompt_tokens: int) -> None:
        self.envelope, self.prompt_tokens = envelope(model), prompt_tokens
        self.headers = {"request-id": new_request_id()}
        self.blocks, self.result = BlockStream(), ChoiceResult()
        self.finish: Finish | None = None

    def opening(self) -> list[dict]:
        usage_now = {"input_tokens": self.prompt_tokens, "output_tokens": 0}  # cached tokens are known at the end
        return [
            {
                "type": "message_start",
                "message": {
                    **self.envelope,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": usage_now,
                },
            },
            PING,
        ]

    def chunks(self, choice: int, events: list[ChatEvent]) -> list[dict]:
        out: list[dict] = []
        for event in events:
            self.finish = event if isinstance(event, Finish) else self.finish
            out += self.blocks.feed(event)
        return out

    def closing(self, counts: dict) -> list[dict]:
        finish = self.finish
        delta = {"stop_reason": stop_reason(finish), "stop_sequence": finish.stop_sequence if finish else None}
        return [{"type": "message_delta", "delta": delta, "usage": usage(counts)}, {"type": "message_stop"}]

    def failed(self, message: str) -> list[dict]:
        return [error_body(500, message)]

    def add(self, choice: int, events: list[ChatEvent]) -> None:
        self.result.extend(events)

    def body(self, counts: dict) -> dict:
        return message_body(self.envelope, self.result, counts)
