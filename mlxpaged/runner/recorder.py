"""Recording the queued-ahead decode pass on a thread of its own (issue 38's GPU lever; MLXPAGED_RECORD_THREAD=1).

On MLX's CUDA backend `mx.async_eval` is where a step's kernels are recorded into CUDA graphs and launched (every
step anew: ../shared/DESIGN.md), and it releases the GIL while it does: about 10 of a 13.45 ms step at 16 requests on
an H200 (session 13's profile), the rest Python building the pass. With this lever the engine thread hands the pass
it queued ahead to the recorder thread and goes on: it reads the step before, delivers its tokens, schedules and
builds the next pass while the recorder records this one, so a step costs about the longer of the two, not their sum.

MLX is not thread-safe, so the engine keeps to a few rules (runner/model_runner.py, engine/core.py,
engine/engine_thread.py), each because of what `eval` does to the arrays it walks:

- Arrays are built on a stream any thread may evaluate (`mx.new_thread_unsafe_stream`: MLX's streams otherwise
  belong to the thread that made them); the engine thread makes it.
- One recording at a time, and none while the engine thread evaluates anything: every launch or read on the engine
  thread settles the recorder first (`settle`), except the read of the step before the one being recorded.
- That read is of a copy of its tokens (`LazySample`'s separate read): evaluating the next pass detaches the tokens it
  consumes (their graph and their event), which a read of the same array on another thread would race.
- A step that may do anything but continue the same rows (a request or a command arrived, a draft, the disk tier)
  settles the recorder before it schedules.

What it cannot show here: its gain. On MLX's CPU backend `async_eval` only queues work for the CPU stream's own
thread; the tests (tests/runner/test_gpu_levers.py) check the tokens, token for token, on the path a GPU takes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx

ENV_VAR = "MLXPAGED_RECORD_THREAD"  # "1": record queued-ahead passes on a second thread (a GPU lever, off by default)
THREAD_NAME = "mlxpaged-recorder"


def wanted() -> bool:
    """Whether MLXPAGED_RECORD_THREAD asks for the recorder thread."""
    return os.environ.get(ENV_VAR, "").strip() == "1"


class Recorder:
    """A thread that runs `mx.async_eval` on the passes the engine thread hands it, one at a time, in order. Each
    pass's Future is done once it is queued on the device (its `result()` raising what queuing it raised); only then
    may another thread evaluate its arrays."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        self._current: Future | None = None

    def record(self, arrays: Sequence[mx.array]) -> Future:
        """Queue `arrays` on the device from the recorder thread, once the pass before is recorded."""
        self.settle()
        self._current = self._thread.submit(mx.async_eval, *arrays)
        return self._current

    def settle(self, quiet: bool = False) -> None:
        """Wait until nothing is being recorded; raise what the last recording raised unless `quiet` (a step that
        failed already: the failure is being handled)."""
        current, self._current = self._current, None
        if current is None:
            return
        try:
            current.result()
        except BaseException:
            if not quiet:
                raise

    @property
    def busy(self) -> bool:
        return self._current is not None and not self._current.done()

    def close(self) -> None:
        """Stop the thread once it has recorded what it was given (the engine thread stops)."""
        self.settle(quiet=True)
        self._thread.submit(mx.clear_streams)  # MLX requires a thread to release the streams it made before it ends
        self._thread.shutdown(wait=True)
