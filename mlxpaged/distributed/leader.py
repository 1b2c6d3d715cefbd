"""Rank 0's side: the runner's StepMirror, sending each pass's inputs and each block copy before queuing them,
and bounding each step across the ranks (watchdog.py: a step that fails or hangs ends the process)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager

from mlxpaged.distributed import plan
from mlxpaged.distributed.channel import PlanChannel
from mlxpaged.distributed.watchdog import KEEP_ALIVE_S, StepWatchdog, Tell
from mlxpaged.runner.passes import StepInput


class PlanSender:
    """Installed as `Runner.mirror` on rank 0 (engine/build.py); `close` ends the followers' loops."""

    def __init__(self, channel: PlanChannel, watchdog: StepWatchdog | None = None):
        self.channel = channel
        self.watchdog = watchdog if watchdog is not None else StepWatchdog(channel.ranks)
        self.stopped = False
        self.last_sent = time.monotonic()

    def watch(self, tell: Tell) -> AbstractContextManager[None]:
        """Around one engine step (engine_thread.py): `tell` fails the requests in flight if the ranks fail it."""
        return self.watchdog.watch("an engine step", tell)

    def before_step(self, inputs: Sequence[StepInput]) -> None:
        self._send(plan.encode_step(inputs))

    def before_copy(self, copies: list[tuple[int, int]]) -> None:
        self._send(plan.encode_copies(copies))

    def idle(self) -> None:
        """The engine waits for work (EngineCore.idle, twice a second): every KEEP_ALIVE_S, tell the followers
        rank 0 is alive, so that one hearing nothing for long knows it hangs (watchdog.LeaderWatch). A follower
        gone is seen here too, with nothing in flight."""
        if not self.stopped and time.monotonic() - self.last_sent >= KEEP_ALIVE_S:
            with self.watchdog.watch("a keep-alive message", lambda error: None):
                self._send(plan.encode_keep_alive())

    def _send(self, values: list[int]) -> None:
        self.channel.send(values)
        self.last_sent = time.monotonic()

    def close(self) -> None:
        """Once: the engine closes, the followers return. A follower already gone (the collective fails) has
        nothing left to stop: the close goes on. One that hangs is bounded like a step (the requests have
        ended by now: nobody to tell)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            with self.watchdog.watch("the stop message", lambda error: None):
                self.channel.send(plan.encode_stop())
        except RuntimeError as exc:  # what MLX raises for a failed collective
            warnings.warn(f"could not tell the other ranks to stop ({exc})", RuntimeWarning, stacklevel=2)
