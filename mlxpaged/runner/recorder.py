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
import threading
from collections.abc import Sequence

import mlx.core as mx

ENV_VAR = "MLXPAGED_RECORD_THREAD"  # "1": record queued-ahead passes on a second thread (a GPU lever, off by default)


def wanted() -> bool:
    """Whether MLXPAGED_RECORD_THREAD asks for the recorder thread."""
    return os.environ.get(ENV_VAR, "").strip() == "1"


class Recording:
    """One pass handed to the recorder: `wait()` returns once it is queued on the device (raising what queuing it
    raised), after which its arrays may be read on any thread."""

    def __init__(self, arrays: Sequence[mx.array]):
        self.arrays: Sequence[mx.array] | None = arrays
        self.error: BaseException | None = None
        self._done = threading.Event()

    def finish(self, error: BaseException | None) -> None:
        self.error, self.arrays = error, None  # the arrays are the caller's again: nothing here holds them
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error


class Recorder:
    """A thread that runs `mx.async_eval` on the passes the engine thread hands it, one at a time, in order."""

    def __init__(self) -> None:
        self._current: Recording | None = None
        self._ready = threading.Condition()
        self._job: Recording | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="mlxpaged-recorder", daemon=True)
        self._thread.start()

    def record(self, arrays: Sequence[mx.array]) -> Recording:
        """Queue `arrays` on the device from the recorder thread, once the pass before is recorded."""
        self.settle()
        recording = Recording(list(arrays))
        with self._ready:
            if self._closed:
                raise RuntimeError("the recorder thread was closed")
            self._current = self._job = recording
            self._ready.notify()
        return recording

    def settle(self, quiet: bool = False) -> None:
        """Wait until nothing is being recorded; raise what the last recording raised unless `quiet` (a step that
        failed already: the failure is being handled)."""
        current, self._current = self._current, None
        if current is None:
            return
        try:
            current.wait()
        except BaseException:
            if not quiet:
                raise

    @property
    def busy(self) -> bool:
        return self._current is not None and not self._current.done

    def close(self) -> None:
        """Stop the thread once it has recorded what it was given (the engine thread stops)."""
        self.settle(quiet=True)
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join()

    def _serve(self) -> None:
        try:
            while True:
                with self._ready:
                    while self._job is None and not self._closed:
                        self._ready.wait()
                    if self._job is None:
                        return
                    job, self._job = self._job, None
                try:
                    mx.async_eval(*(job.arrays or ()))
                except BaseException as exc:  # the engine thread raises it where it reads the pass
                    job.finish(exc)
                else:
                    job.finish(None)
        finally:
            mx.clear_streams()  # MLX requires a thread to release the streams it made before it ends
