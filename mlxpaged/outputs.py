"""What the engine hands back: streamed deltas and finished completions."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class StreamDelta:
    """One piece of a streamed reply. The last one has finish_reason set and the usage counts."""

    request_id: str
    text: str
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    index: int = 0  # which of the request's n sequences (SamplingParams.n)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    stop_sequence: str | None = None  # the stop string that ended the sequence (Anthropic reports it)


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def drain(sink: queue.Queue, sequences: int = 1) -> Iterator[StreamDelta]:
    """Events of one request until all its `sequences` have finished; an exception is raised."""
    while sequences:
        event = sink.get()
        if isinstance(event, BaseException):
            raise event
        sequences -= event.finish_reason is not None
        yield event


def collect(request_id: str, deltas: Iterator[StreamDelta]) -> list[Completion]:
    """One Completion per sequence index, in index order."""
    parts: dict[int, list[StreamDelta]] = {}
    for delta in deltas:
        parts.setdefault(delta.index, []).append(delta)
    return [completion(request_id, parts[i]) for i in sorted(parts)]


def completion(request_id: str, deltas: list[StreamDelta]) -> Completion:
    tokens = [d for d in deltas if d.token_id is not None]
    token_ids = [d.token_id for d in tokens if d.token_id is not None]
    # A sequence's tokens all carry logprobs (its SamplingParams asked for them) or none do.
    logprobs = [d.logprob for d in tokens if d.logprob is not None]
    tops = [d.top_logprobs for d in tokens if d.top_logprobs is not None]
    last = deltas[-1]
    return Completion(
        request_id,
        "".join(d.text for d in deltas),
        token_ids,
        last.finish_reason,
        last.prompt_tokens,
        last.cached_tokens,
        logprobs or None,
        tops or None,
    )
