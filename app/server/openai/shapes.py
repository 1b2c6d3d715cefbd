"""OpenAI response bodies: envelopes, per-choice accumulation, and logprobs in the chat and the
legacy shapes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mlxpaged.engine.engine import StreamDelta
from mlxpaged_app.server.formatting import TokenLogprob, TokenText


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
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t): lp for t, lp in e.top or []} for e in entries],
            "text_offset": offsets}


@dataclass(frozen=True)
class Envelope:
    """What every body and chunk of one response shares."""
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, object_name: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}
