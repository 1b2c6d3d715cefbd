"""OpenAI response bodies: envelopes, what chat and completions replies share as reply shapes, per-choice
accumulation, and logprobs in the chat and the legacy shapes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mlxpaged.engine.engine import StreamDelta
from mlxpaged_app.server.errors import server_error
from mlxpaged_app.server.formatting import TokenLogprob, TokenText
from mlxpaged_app.server.serving import ReplyShape


@dataclass
class ChoiceText:
    """One choice of a non-streamed reply, built from its deltas."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: StreamDelta) -> None:
        self.parts.append(delta.text)
        if delta.token_id is not None and delta.logprob is not None:
            self.logprobs.append(TokenLogprob(delta.token_id, delta.logprob, delta.top_logprobs))
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _chat_entry(text: TokenText, token_id: int, logprob: float) -> dict:
    token = text(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(text: TokenText, entries: list[TokenLogprob]) -> dict:
    """`choices[i].logprobs` of a chat completion: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for entry in entries:
        item = _chat_entry(text, entry.token_id, entry.logprob)
        item["top_logprobs"] = [_chat_entry(text, t, lp) for t, lp in entry.top or []]
        content.append(item)
    return {"content": content}


def completion_logprobs(text: TokenText, entries: list[TokenLogprob], offset: int = 0) -> dict:
    """`choices[i].logprobs` of a legacy completion: parallel lists, top alternatives as {token: logprob}."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(offset)
        tokens.append(text(entry.token_id))
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{text(t): lp for t, lp in e.top or []} for e in entries],
        "text_offset": offsets,
    }


@dataclass(frozen=True)
class Envelope:
    """What every body and chunk of one response shares."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, object_name: str, choices: list[dict], **extra) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            **extra,
        }


class OpenAIShape(ReplyShape):
    """What chat and completions replies share: the envelope, usage as a last chunk when the client asked for it
    (stream_options.include_usage), an engine failure in-band as OpenAI reports it, and `[DONE]` after either."""

    chunk_object: str  # the `object` of a streamed chunk, e.g. "chat.completion.chunk"
    trailer = ("[DONE]",)  # OpenAI's end-of-stream marker

    def __init__(self, envelope: Envelope, include_usage: bool) -> None:
        self.envelope, self.include_usage = envelope, include_usage
        self.headers = {"x-request-id": envelope.id}

    def closing(self, usage: dict) -> list:
        return [self.envelope.body(self.chunk_object, [], usage=usage)] if self.include_usage else []

    def failed(self, message: str) -> list:
        return [server_error(message).body()]
