"""Admission control: a full server refuses at once (429 with Retry-After) rather than queue without limit."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from mlxpaged_app.server.errors import queue_full


class Admission:
    """At most `capacity` sequences in flight (the engine's batch plus a queue); beyond that, 429."""

    def __init__(self, batch: int, queue: int, on_idle: Callable[[], None] | None = None) -> None:
        self.batch, self.capacity, self.in_flight = batch, batch + queue, 0
        self.on_idle = on_idle  # called when the last request in flight ends (the model registry's idle timer)

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: one per batch's worth of work ahead of the caller."""
        return max(1, min(60, math.ceil(self.in_flight / self.batch)))

    @contextmanager
    def slot(self, units: int) -> Iterator[None]:
        # An oversized request (n larger than the whole capacity) still runs when nothing else does.
        if self.in_flight and self.in_flight + units > self.capacity:
            raise queue_full(self.in_flight, self.capacity, self.retry_after())
        self.in_flight += units
        try:
            yield
        finally:
            self.in_flight -= units
            if not self.in_flight and self.on_idle is not None:
                self.on_idle()
