"""One assistant reply: submit it to the engine and drain its events on a worker thread, posting
each step to the app as a Textual Message (messages.py). No polling: the drain blocks on the
engine's event queue, and `stop` wakes it to start the grace period.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from mlxpaged_app.tui.messages import ReplyDelta, ReplyFailed, ReplyFinished, ReplyStarted

from textual.message import Message

STOP_GRACE_S = 3.0  # after an abort, how long to wait for the engine's final event
_WAKE = object()  # queued by stop(): wakes a drain blocked on the queue so it starts the grace period

Post = Callable[[Message], bool]  # post_message: False when nobody will read the message


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
    def from_dict(cls, data: dict | None) -> ReplyStats | None:
        if not data:
            return None
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class ReplyRun:
    """`post` delivers this run's Messages to the app (its thread-safe post_message)."""

    def __init__(self, engine: Any, messages: list[dict], params: Any, post: Post):
        self.engine, self.messages, self.params, self._post = engine, messages, params, post
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
        self._events.put(_WAKE)
        if self.request_id is not None:
            self.engine.abort(self.request_id)

    def run(self) -> None:
        """The worker thread's body: posts ReplyStarted, ReplyDelta..., then ReplyFinished or ReplyFailed."""
        started = time.perf_counter()
        try:
            prompt = self.engine.chat_prompt(self.messages)  # token ids, or an ImagePrompt with images
            self.prompt_tokens = len(getattr(prompt, "token_ids", prompt))
            self.request_id = self.engine.submit(prompt, self.params, self._events.put)
        except Exception as exc:  # too long, bad settings, engine closed: the UI says why
            self._send(ReplyFailed(self, exc, rejected=True))
            return
        if self._stop.is_set():  # Esc arrived while we were submitting
            self.engine.abort(self.request_id)
        self._send(ReplyStarted(self))
        self._drain(started)

    def _send(self, message: Message) -> None:
        if not self._post(message):  # the app has gone: do not leave the request running
            self.stop()

    def _drain(self, started: float) -> None:
        first_token = None
        while True:
            events = self._next_events()
            if events is None:  # stopped, and the engine never confirmed: end the reply ourselves
                self._send(ReplyFinished(self, ReplyStats(self.prompt_tokens or 0, finish_reason="abort")))
                return
            pieces, final = [], None
            for event in events:
                if isinstance(event, BaseException):
                    self._flush(pieces)
                    self._send(ReplyFailed(self, event, rejected=False))
                    return
                if first_token is None and event.token_id is not None:
                    first_token = time.perf_counter()
                pieces.append(event.text)
                final = event if event.finish_reason is not None else final
            self._flush(pieces)
            if final is not None:
                self._send(ReplyFinished(self, _stats(final, started, first_token, time.perf_counter())))
                return

    def _flush(self, pieces: list[str]) -> None:
        text = "".join(pieces)
        if text:
            self.text += text
            self._send(ReplyDelta(self, text))

    def _next_events(self) -> list | None:
        """Every event already queued (at least one), as one batch; None once stopped and the
        engine has not confirmed within STOP_GRACE_S."""
        events: list = []
        while not events:
            try:
                first = self._events.get(timeout=self._grace_left())
            except queue.Empty:
                return None
            events = [event for event in [first, *self._queued()] if event is not _WAKE]
        return events

    def _queued(self) -> list:
        queued = []
        while True:
            try:
                queued.append(self._events.get_nowait())
            except queue.Empty:
                return queued

    def _grace_left(self) -> float | None:
        """None (wait as long as the reply takes) until stopped; then what is left of the grace."""
        if self._stopped_at is None:
            return None
        return max(0.0, self._stopped_at + STOP_GRACE_S - time.perf_counter())


def _stats(final: Any, started: float, first_token: float | None, ended: float) -> ReplyStats:
    rate = None
    if first_token is not None and final.completion_tokens > 1 and ended > first_token:
        rate = (final.completion_tokens - 1) / (ended - first_token)
    ttft = first_token - started if first_token is not None else None
    return ReplyStats(
        final.prompt_tokens, final.cached_tokens, final.completion_tokens, ttft, rate, final.finish_reason
    )
