"""The HTTP layer's client of the engine: submission, and event delivery onto the event loop.

The engine thread pushes events into a sink; `Generation` hops them onto the event loop with
`call_soon_threadsafe` and merges the events of every prompt of a request (a /v1/completions
batch) into one stream of (choice index, StreamDelta). Whoever consumes it must call `abort()`
in a `finally`: it withdraws every sequence that has not finished, so a client that leaves frees
its blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from functools import partial

from mlxpaged.engine.engine import EngineClosedError, StreamDelta
from mlxpaged.errors import ConfigError, RequestTooLongError
from mlxpaged.sampling_params import SamplingParams
from mlxpaged_app.server.errors import APIError, invalid_param, unavailable
from mlxpaged_app.server.metrics import ServerMetrics
from mlxpaged_app.server.server_log import log


class GenerationFailed(RuntimeError):
    """The engine failed a request after accepting it (a server-side failure, not the client's)."""


def submit_error(exc: Exception, prompt_param: str) -> APIError:
    """What a synchronous `engine.submit` failure means to the client."""
    if isinstance(exc, RequestTooLongError):
        return invalid_param(prompt_param, str(exc), "context_length_exceeded")
    if isinstance(exc, EngineClosedError):
        return unavailable("the server is shutting down")
    if isinstance(exc, ConfigError) and exc.param == "logit_bias":  # a token id past the vocabulary
        return invalid_param("logit_bias", str(exc))
    return invalid_param(prompt_param, str(exc))


class Generation:
    """One API request's engine work: one engine request per prompt, each with `n` sequences."""

    def __init__(self, engine, metrics: ServerMetrics, n: int, arrived: float, adapter: str | None = None) -> None:
        self.engine, self.metrics, self.n, self.arrived = engine, metrics, n, arrived
        self.adapter = adapter  # the name of the engine's adapter every prompt runs with (None: the base model)
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._request_ids: list[str] = []
        self._open: list[int] = []  # unfinished sequences per prompt
        self._last_token: dict[int, float] = {}
        self.first_token_at: float | None = None
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.left_at: float | None = None  # when the client left before the reply ended (`left`)
        self.route = ""

    def submit(self, prompts: list[list[int]], params: SamplingParams, prompt_param: str) -> None:
        """Queue every prompt, or none: a prompt the engine refuses withdraws the ones before it."""
        try:
            for i, tokens in enumerate(prompts):
                self._request_ids.append(
                    self.engine.submit(tokens, params, partial(self._sink, i), adapter=self.adapter)
                )
                self._open.append(self.n)
        except Exception as exc:
            self.abort()
            raise submit_error(exc, prompt_param) from None

    def _sink(self, prompt_index: int, event: object) -> None:
        """Runs on the engine thread."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed: the server is gone, nobody listens
            self._loop.call_soon_threadsafe(self._deliver, prompt_index, event)

    def _deliver(self, prompt_index: int, event: object) -> None:
        """On the event loop: to the consumer, or, once its client has left, straight to the counts."""
        if self.left_at is None:
            self._events.put_nowait((prompt_index, event))
        else:
            self._settle(prompt_index, event)

    def left(self, route: str) -> None:
        """The reply's consumer is done (`launch`'s cleanup): whatever has not finished was left by its client. It
        is withdrawn, and its last events (the engine's "abort" deltas) are counted and logged as left."""
        if self.finished or self.left_at is not None:
            return
        self.left_at, self.route = time.perf_counter(), route
        while not self._events.empty():  # events the consumer never read: a sequence may have ended among them
            self._settle(*self._events.get_nowait())
        self.abort(notify=True)  # its listening goes on in _settle

    def _settle(self, prompt_index: int, event: object) -> None:
        if self._open[prompt_index] == 0:
            return
        if isinstance(event, BaseException):
            self._open[prompt_index] = 0
        elif event.finish_reason is not None:
            self._close_sequence(prompt_index, event)

    @property
    def finished(self) -> bool:
        return not any(self._open)

    async def deltas(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(choice index, delta) until every sequence has finished; GenerationFailed if the engine failed."""
        while not self.finished:
            prompt_index, event = await self._events.get()
            if isinstance(event, BaseException):
                self._open[prompt_index] = 0  # the engine already dropped this request
                raise GenerationFailed(f"generation failed: {event}") from event
            choice = prompt_index * self.n + event.index
            self._observe(choice, event)
            if event.finish_reason is not None:
                self._close_sequence(prompt_index, event)
            yield choice, event

    def _observe(self, choice: int, delta: StreamDelta) -> None:
        if delta.token_id is None:
            return
        now = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.arrived)
        if choice in self._last_token:
            self.metrics.token_latency.observe(now - self._last_token[choice])
        self._last_token[choice] = now

    def _close_sequence(self, prompt_index: int, delta: StreamDelta) -> None:
        if self._open[prompt_index] == self.n:  # the prompt is counted once, however many samples share it
            self.prompt_tokens += delta.prompt_tokens
            self.cached_tokens += delta.cached_tokens
        self._open[prompt_index] -= 1
        self.completion_tokens += delta.completion_tokens
        if not self.finished:
            return
        self.metrics.count_usage(self.prompt_tokens, self.cached_tokens, self.completion_tokens)
        if self.left_at is None:
            self.metrics.e2e.observe(time.perf_counter() - self.arrived)
            return
        self.metrics.abandoned[self.route] += 1
        log.info(
            "client left %s %.1f s after it asked: withdrawn with %d prompt tokens (%d cached) and %d generated",
            self.route,
            self.left_at - self.arrived,
            self.prompt_tokens,
            self.cached_tokens,
            self.completion_tokens,
        )

    def abort(self, notify: bool = False) -> None:
        """Withdraw whatever has not finished (idempotent; the engine ignores unknown ids).

        notify=False: stop listening now (the consumer is gone). notify=True: keep listening, so
        the engine's final "abort" deltas end the consumer's stream properly (shutdown drain)."""
        for request_id, still_open in zip(self._request_ids, self._open, strict=True):
            if still_open:
                self.engine.abort(request_id)
        if not notify:
            self._open = [0] * len(self._open)

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
