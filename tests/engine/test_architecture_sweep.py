"""The sweep's own machinery (tests/archs/sweep.py): a sweep in the background of the suite runs at the lowest CPU
priority and can be stopped; its verdicts are the foreground's."""

from __future__ import annotations

import threading
import time

from tests.archs.sweep import Stop, sweep
from tests.lowest_priority import runs_at_lowest_priority

import pytest

pytestmark = pytest.mark.slow


def _first_worker(stop: Stop, deadline_s: float = 60.0):
    deadline = time.monotonic() + deadline_s
    while not stop.running():
        assert time.monotonic() < deadline, "no worker process started"
        time.sleep(0.05)
    return stop.running()[0]


def assert_lowest_priority(pid: int) -> None:
    """tests/lowest_priority.py's priority; `chrt` sets it just after the worker starts."""
    deadline = time.monotonic() + 10
    while True:
        lowest = runs_at_lowest_priority(pid)
        if lowest or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert lowest, "the background worker runs at a normal priority"


def test_a_background_sweep_runs_at_the_lowest_priority_and_stops_with_its_workers():
    stop = Stop()
    done = threading.Event()
    thread = threading.Thread(
        target=lambda: (sweep(["llama", "qwen2", "gemma"], workers=1, background=True, stop=stop), done.set())
    )
    thread.start()
    worker = _first_worker(stop)
    assert_lowest_priority(worker.pid)
    stop()
    assert done.wait(30), "the sweep went on after stop()"
    assert worker.poll() is not None and not stop.running()


def test_a_stopped_sweep_starts_no_worker():
    stop = Stop()
    stop()
    start = time.monotonic()
    sweep(["llama"], workers=1, stop=stop)
    assert time.monotonic() - start < 30 and not stop.running()


def test_a_background_sweep_gives_the_foregrounds_verdicts():
    def verdict(background: bool) -> dict:
        verdict = sweep(["llama"], workers=1, background=background)["cpu"]["llama"]
        del verdict["seconds"]  # how long it took
        return verdict

    foreground = verdict(False)
    assert foreground == verdict(True) and foreground["status"] == "paged", foreground
