"""Rank 0's side: the runner's StepMirror, sending each pass's inputs and each block copy before queuing them,
and bounding each step across the ranks (watchdog.py: a step that fails or hangs ends the process)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager

from mlxpaged.distributed import plan
from mlxpaged.distributed.channel import PlanChannel
from mlxpaged.distributed.watchdog import StepWatchdog, Tell
from mlxpaged.runner.passes import StepInput

# While idle, rank 0 sends a keep-alive every IDLE_TICK_S telling the followers to sleep NAP_S before their next
# collective. A rank waiting in a collective costs a core: MLX's ring thread polls its sockets meanwhile (an idle
# follower measured 3.4 s of CPU in 5 s, 88% of it sys), so the followers sleep through most of the idle time
# instead, and spin only the tick's rest. A request arriving meanwhile waits at most NAP_S for them.
IDLE_TICK_S = 0.1
NAP_S = 0.09


class PlanSender:
    """Installed as `Runner.mirror` on rank 0 (engine/build.py); `close` ends the followers' loops."""

    def __init__(self, channel: PlanChannel, watchdog: StepWatchdog | None = None):
        self.channel = channel
        self.watchdog = watchdog if watchdog is not None else StepWatchdog(channel.ranks)
        self.stopped = False
        self.last_sent = time.monotonic()
        self.idle_tick_s = IDLE_TICK_S  # how often the engine thread calls `idle` while it waits (engine_thread.py)

    def watch(self, tell: Tell) -> AbstractContextManager[None]:
        """Around one engine step (engine_thread.py): `tell` fails the requests in flight if the ranks fail it."""
        return self.watchdog.watch("an engine step", tell)

    def before_step(self, inputs: Sequence[StepInput]) -> None:
        self._send(plan.encode_step(inputs))

    def before_copy(self, copies: list[tuple[int, int]]) -> None:
        self._send(plan.encode_copies(copies))

    def idle(self) -> None:
        """The engine waits for work (EngineCore.idle, every `idle_tick_s`): tell the followers rank 0 is alive, so
        that one hearing nothing for long knows it hangs (watchdog.LeaderWatch), and to sleep until about the next
        tick rather than wait in a collective. A follower gone is seen here too, with nothing in flight."""
        if not self.stopped and time.monotonic() - self.last_sent >= IDLE_TICK_S:
            with self.watchdog.watch("a keep-alive message", lambda error: None):
                self._send(plan.encode_keep_alive(round(NAP_S * 1000)))

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
