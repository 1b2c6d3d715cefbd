"""Whole-process checks started when collection ends, at the lowest CPU priority, whose results tests read.

Some tests are one long subprocess whose work the rest of the suite does not wait on: mypy over the library, the
quantized tests under each OpenBLAS kernel family. Run in the foreground they add their whole time to the suite;
started as collection ends (tests/conftest.py), at the lowest CPU priority (tests/lowest_priority.py), they take
the CPU the suite leaves idle while it waits on live servers, ranks and subprocesses (as the architecture sweep
does: tests/archs/background.py), and the test that reads a result waits for it only if it is not done yet. A
test run on its own (or one whose run was not started) runs its command then, in the foreground.

A test module lists its runs in `BACKGROUND_RUNS` (name -> `Run`); its tests read them with `result(name)`.
"""

from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tests.lowest_priority import at_lowest_priority

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Run:
    """A command run in the checkout's root with `env` added to this process's environment."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 900.0


class _Started:
    def __init__(self, run: Run, background: bool):
        self.run = run
        self._done = threading.Event()
        self._result: subprocess.CompletedProcess | None = None
        argv = at_lowest_priority(list(run.argv)) if background else list(run.argv)
        self._process = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, **run.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=self._wait, name=f"background {run.argv[:2]}", daemon=True).start()

    def _wait(self) -> None:
        try:
            out, err = self._process.communicate(timeout=self.run.timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            out, err = self._process.communicate()
            err += f"\n(killed after {self.run.timeout_s:g} s)"
        self._result = subprocess.CompletedProcess(self._process.args, self._process.returncode, out, err)
        self._done.set()

    def result(self) -> subprocess.CompletedProcess:
        self._done.wait()
        assert self._result is not None  # set before the event
        return self._result

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()


_started: dict[str, _Started] = {}
_lock = threading.Lock()


def start(name: str, run: Run) -> None:
    """Start `run` in the background under `name` (once)."""
    with _lock:
        if name not in _started:
            _started[name] = _Started(run, background=True)


def result(name: str, run: Run) -> subprocess.CompletedProcess:
    """The finished run `name`: the background one's if it was started, else `run` now, in the foreground."""
    with _lock:
        started = _started.get(name)
    if started is None:
        started = _Started(run, background=False)
    return started.result()


def stop_all() -> None:
    """Kill the runs still going (the session ends before their results were read)."""
    with _lock:
        for started in _started.values():
            started.stop()
