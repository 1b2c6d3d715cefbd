"""Rank 0's watchdog in one process (a stand-in group, no collectives): a step that outlasts the rank timeout or
raises tells the requests in flight and exits non-zero; a step within the bound does neither. The real thing,
with ranks that die, quit or hang under mlx.launch: test_rank_lost.py."""

from __future__ import annotations

import threading
import time

from mlxpaged.distributed import watchdog
from mlxpaged.distributed.ranks import Ranks
from mlxpaged.distributed.watchdog import EXIT_STATUS, KEEP_ALIVE_S, LeaderWatch, RanksLostError, StepWatchdog
from mlxpaged.errors import ConfigError, EngineClosedError

import pytest


class Group:
    def __init__(self, size: int):
        self._size = size

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self._size


class Recorder:
    def __init__(self):
        self.told: list[BaseException] = []
        self.exits: list[int] = []
        self.exited = threading.Event()

    def tell(self, error: BaseException) -> None:
        self.told.append(error)

    def exit(self, status: int) -> None:
        self.exits.append(status)
        self.exited.set()


@pytest.fixture(autouse=True)
def no_flush_wait(monkeypatch):
    monkeypatch.setattr(watchdog, "FLUSH_S", 0.0)


def test_a_step_past_the_rank_timeout_fails_its_requests_and_exits_non_zero():
    seen = Recorder()
    dog = StepWatchdog(Ranks(Group(2), timeout_s=0.3), exit=seen.exit)  # type: ignore[arg-type]
    started = time.monotonic()
    with dog.watch("an engine step", seen.tell):
        assert seen.exited.wait(5.0)  # the step "hangs" until the watchdog gives up
    waited = time.monotonic() - started
    assert 0.3 <= waited < 2.0
    assert seen.exits == [EXIT_STATUS] and EXIT_STATUS != 0
    [error] = seen.told
    assert isinstance(error, RanksLostError) and isinstance(error, EngineClosedError)  # the server's 503 / stream
    assert "no answer from rank 1 of 2" in str(error) and "rank timeout (0.3 s)" in str(error)


def test_a_step_that_raises_fails_its_requests_with_the_reason_and_exits_non_zero():
    seen = Recorder()
    dog = StepWatchdog(Ranks(Group(4), timeout_s=60), exit=seen.exit)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError), dog.watch("an engine step", seen.tell):
        raise RuntimeError("[ring] connection to a peer was lost")
    assert seen.exits == [EXIT_STATUS]
    [error] = seen.told
    assert "[ring] connection to a peer was lost" in str(error) and "one of ranks 1-3 (of 4)" in str(error)


def test_steps_within_the_bound_are_left_alone():
    seen = Recorder()
    dog = StepWatchdog(Ranks(Group(2), timeout_s=0.4), exit=seen.exit)  # type: ignore[arg-type]
    for _ in range(6):  # 6 x 0.2 s: longer than the bound in all, never in one step
        with dog.watch("an engine step", seen.tell):
            time.sleep(0.2)
    time.sleep(0.6)  # idle: no step in flight
    assert seen.told == [] and seen.exits == []


def test_give_up_everywhere_tells_the_step_in_flight():
    seen = Recorder()
    dog = StepWatchdog(Ranks(Group(2), timeout_s=60), exit=seen.exit)  # type: ignore[arg-type]
    with dog.watch("an engine step", seen.tell):
        watchdog.give_up_everywhere("mlx.launch stopped rank 0 (SIGTERM)", exit=seen.exit)
    assert seen.exits == [EXIT_STATUS]
    assert "mlx.launch stopped rank 0 (SIGTERM): rank 1 of 2 is gone" in str(seen.told[0])


def test_the_rank_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="rank timeout must be > 0 seconds, got 0"):
        Ranks(Group(2), timeout_s=0)  # type: ignore[arg-type]


def test_a_dropped_watchdog_no_longer_counts_as_an_engine_over_ranks():
    """(serve's SIGTERM means a lost rank only while an engine over ranks lives in the process)"""
    import gc

    dog = StepWatchdog(Ranks(Group(2), timeout_s=0.2), exit=Recorder().exit)  # type: ignore[arg-type]
    with dog.watch("an engine step", Recorder().tell):
        pass
    assert watchdog.over_ranks()
    del dog
    gc.collect()
    time.sleep(0.3)  # its thread notices
    assert not watchdog.over_ranks()


def test_a_follower_silent_rank_0_past_its_bound_exits_non_zero():
    seen = Recorder()
    watch = LeaderWatch(Ranks(Group(2), timeout_s=0.1), exit=seen.exit)  # type: ignore[arg-type]
    assert watch.bound == 0.2 + KEEP_ALIVE_S
    for _ in range(3):  # heard often enough: nothing happens
        time.sleep(0.1)
        watch.heard_from_leader()
    assert seen.exits == []
    watch.bound = 0.3  # (rather than wait out the keep-alive interval)
    assert seen.exited.wait(3.0) and seen.exits == [EXIT_STATUS]
    watch.close()


def test_giving_up_waits_until_the_server_has_ended_its_responses(monkeypatch):
    """The clients get their errors before the exit: give_up waits while the server counts responses in progress
    (not a fixed second, which a loaded machine's event loop may need more than), and the wait is bounded."""
    monkeypatch.setattr(watchdog, "FLUSH_MAX_S", 5.0)
    seen = Recorder()
    in_progress = [2]
    ended = threading.Event()

    def respond_later() -> None:  # the event loop writing the two errors, slowly
        for _ in range(2):
            time.sleep(0.3)
            in_progress[0] -= 1
        ended.set()

    monkeypatch.setattr(watchdog, "_giving_up", threading.Lock())
    watchdog.count_responses_with(lambda: in_progress[0])
    try:
        threading.Thread(target=respond_later, daemon=True).start()
        started = time.monotonic()
        watchdog.give_up("a rank is gone", seen.tell, exit=seen.exit)
        took = time.monotonic() - started
        assert ended.is_set() and seen.exits == [EXIT_STATUS] and 0.5 <= took < 3.0, took
        monkeypatch.setattr(watchdog, "FLUSH_MAX_S", 0.4)  # a response that never ends: the exit still comes
        in_progress[0] = 1
        started = time.monotonic()
        watchdog.give_up("a rank is gone", seen.tell, exit=seen.exit)
        assert seen.exits == [EXIT_STATUS] * 2 and 0.4 <= time.monotonic() - started < 2.0
    finally:
        watchdog.count_responses_with(None)
