"""One assistant reply: submit it to the engine and drain its events on a worker thread.

Plain Python (no Textual): the app hands in a listener whose methods forward to the UI thread.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

STOP_GRACE_S = 3.0  # after an abort, how long to wait for the engine's final event
POLL_S = 0.1


@dataclass
class ReplyStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    time_to_first_token: float | None = None
    tokens_per_s: float | None = None
    finish_reason: str | None = None

    def describe(self) -> str:
        parts = []
        if self.time_to_first_token is not None:
            parts.append(f"TTFT {self.time_to_first_token:.2f} s")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:.1f} tok/s")
        parts.append(f"prompt {self.prompt_tokens:,} tok ({self.cached_tokens:,} cached)")
        parts.append(f"{self.completion_tokens:,} out")
        if self.finish_reason == "abort":
            parts.append("stopped")
        elif self.finish_reason == "length":
            parts.append("hit max tokens")
        return " · ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "ReplyStats | None":
        if not data:
            return None
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class ReplyListener(Protocol):
    """Called on the worker thread; implementations forward to the UI thread."""

    def reply_started(self, run: "ReplyRun") -> None: ...

    def reply_text(self, run: "ReplyRun", text: str) -> None: ...

    def reply_finished(self, run: "ReplyRun", stats: ReplyStats) -> None: ...

    def reply_failed(self, run: "ReplyRun", error: BaseException, rejected: bool) -> None: ...


class ReplyRun:
    def __init__(self, engine: Any, messages: list[dict], params: Any):
        self.engine, self.messages, self.params = engine, messages, params
        self.request_id: str | None = None
        self.prompt_tokens: int | None = None
        self.text = ""
        self._events: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._stopped_at: float | None = None

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        """Abort the request now (its blocks are freed on the engine's next step)."""
        if self._stop.is_set():
            return
        self._stopped_at = time.perf_counter()
        self._stop.set()
        if self.request_id is not None:
            self.engine.abort(self.request_id)

    def run(self, listener: ReplyListener) -> None:
        """The worker thread's body."""
        started = time.perf_counter()
        try:
            prompt = self.engine.chat_tokens(self.messages)
            self.prompt_tokens = len(prompt)
            self.request_id = self.engine.submit(prompt, self.params, self._events.put)
        except Exception as exc:  # too long, bad settings, engine closed: the UI says why
            listener.reply_failed(self, exc, rejected=True)
            return
        if self._stop.is_set():  # Esc arrived while we were submitting
            self.engine.abort(self.request_id)
        listener.reply_started(self)
        self._drain(listener, started)

    def _drain(self, listener: ReplyListener, started: float) -> None:
        first_token = None
        while True:
            events = self._next_events()
            if events is None:  # stopped, and the engine never confirmed: end the reply ourselves
                listener.reply_finished(self, ReplyStats(self.prompt_tokens or 0, finish_reason="abort"))
                return
            pieces, final = [], None
            for event in events:
                if isinstance(event, BaseException):
                    self._flush(listener, pieces)
                    listener.reply_failed(self, event, rejected=False)
                    return
                if first_token is None and event.token_id is not None:
                    first_token = time.perf_counter()
                pieces.append(event.text)
                final = event if event.finish_reason is not None else final
            self._flush(listener, pieces)
            if final is not None:
                listener.reply_finished(self, _stats(final, started, first_token, time.perf_counter()))
                return

    def _flush(self, listener: ReplyListener, pieces: list[str]) -> None:
        text = "".join(pieces)
        if text:
            self.text += text
            listener.reply_text(self, text)

    def _next_events(self) -> list | None:
        """Every event already queued (at least one), so a slow UI gets tokens in batches."""
        while True:
            try:
                events = [self._events.get(timeout=POLL_S)]
                break
            except queue.Empty:
                if self._stopped_at is not None and time.perf_counter() - self._stopped_at > STOP_GRACE_S:
                    return None
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events


def _stats(final: Any, started: float, first_token: float | None, ended: float) -> ReplyStats:
    rate = None
    if first_token is not None and final.completion_tokens > 1 and ended > first_token:
        rate = (final.completion_tokens - 1) / (ended - first_token)
    ttft = first_token - started if first_token is not None else None
    return ReplyStats(final.prompt_tokens, final.cached_tokens, final.completion_tokens, ttft, rate,
                      final.finish_reason)
