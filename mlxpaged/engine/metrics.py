"""Engine throughput and latency counters, written by the engine thread."""

from __future__ import annotations

import time


class StatsCounter:
    """Throughput over the last few seconds, and time to first token; written by the engine thread."""

    WINDOW = 10.0

    def __init__(self):
        self._events: list[tuple[float, int, int]] = []
        self._ttfts: list[float] = []
        self.generated_total = 0
        self.preemptions = 0

    def add_tokens(self, generated: int, processed: int) -> None:
        now = time.perf_counter()
        self.generated_total += generated
        self._events.append((now, generated, processed))
        while self._events and self._events[0][0] < now - self.WINDOW:
            self._events.pop(0)

    def add_ttft(self, seconds: float) -> None:
        self._ttfts = [*self._ttfts, seconds][-100:]

    def snapshot(self) -> dict:
        events = list(self._events)
        span = max(events[-1][0] - events[0][0], 1e-9) if len(events) > 1 else None
        return {
            "generation_tokens_per_s": sum(e[1] for e in events[1:]) / span if span else 0.0,
            "processed_tokens_per_s": sum(e[2] for e in events[1:]) / span if span else 0.0,
            "generated_tokens_total": self.generated_total,
            "preemptions": self.preemptions,
            "last_time_to_first_token": self._ttfts[-1] if self._ttfts else None,
        }
