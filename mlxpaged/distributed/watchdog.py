"""Rank 0 gives up on a broken group of ranks: it fails the requests in flight and ends its process, non-zero.

Why end the process: MLX's collectives block in C++ (no Python thread can interrupt them), and a rank that dies
or hangs mid-pass leaves rank 0 either raising from a collective ("[ring] connection to a peer was lost") or,
as seen here, waiting in one forever ("Too many send/recv errors. Failing pending tasks..." and no exception
within 40 s). Either way the ranks no longer run the same collectives in the same order, so no later step can
be trusted: the only sound way out is to tell every caller and exit (`os._exit`, since the engine thread may
be stuck in C++). `mlx.launch` then stops the other ranks (it signals them when a rank exits non-zero).

What is bounded: one engine step on rank 0 (its plan messages and its passes, each of which waits on the other
ranks' share of the model's all-reduces), and the stop message at close. The bound is on the whole step, not
the collectives alone, because the model's all-reduces sit inside the pass's graph: the wait for a dead rank
and the compute cannot be told apart from Python. So the default is generous (a long prefill chunk of a large
model on a slow machine, or a first Metal compile of a new shape, takes seconds, not minutes); a rank that is
*killed* is seen much sooner (the collective fails, or mlx.launch sends rank 0 SIGTERM: app/server/ranks.py).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator

from mlxpaged.distributed.ranks import Ranks
from mlxpaged.errors import EngineClosedError

# An idle rank 0 sends a keep-alive message at least this often (leader.py: every IDLE_TICK_S), so its followers
# can bound their wait.
KEEP_ALIVE_S = 5.0
# Between failing the requests in flight and exiting, the HTTP server writes each client its error. With a server
# that counts its responses in progress (`count_responses_with`), the exit waits until none is left, at most
# FLUSH_MAX_S (a client that reads slowly must not keep a broken server up), rather than a fixed second that a
# loaded machine's event loop may need more than. Without a server (no one to write to but queues), FLUSH_S.
FLUSH_S = 1.0
FLUSH_MAX_S = 10.0
FLUSH_POLL_S = 0.02
EXIT_STATUS = 1


class RanksLostError(EngineClosedError):
    """A rank of the group died or stopped answering: the engine over these ranks is closed, for good."""


Tell = Callable[[RanksLostError], None]
Exit = Callable[[int], None]


def others(ranks: Ranks) -> str:
    """The ranks rank 0 waits on, for messages: which one is gone cannot be told from rank 0 beyond two ranks
    (a ring collective fails or hangs as a whole)."""
    if ranks.size == 2:
        return "rank 1 of 2"
    return f"one of ranks 1-{ranks.size - 1} (of {ranks.size})"


_giving_up = threading.Lock()  # one give-up per process: the first reason is the one reported
_watchdogs: weakref.WeakSet[StepWatchdog] = weakref.WeakSet()
_responses_in_progress: Callable[[], int] | None = None


def count_responses_with(count: Callable[[], int] | None) -> None:
    """How the exit knows the clients have their errors: `count()` is the server's responses not yet ended (it is
    read from another thread; None: no server, wait FLUSH_S)."""
    global _responses_in_progress
    _responses_in_progress = count


def _flush() -> None:
    """Wait while the server writes the errors: until no response is in progress, or FLUSH_MAX_S."""
    count = _responses_in_progress
    if count is None:
        time.sleep(FLUSH_S)
        return
    deadline = time.monotonic() + FLUSH_MAX_S
    while count() > 0 and time.monotonic() < deadline:
        time.sleep(FLUSH_POLL_S)


def give_up(message: str, tell: Tell | None, exit: Exit = os._exit) -> None:
    """Fail the requests in flight with `message`, say it on stderr, let the server write the errors, exit
    non-zero. A second caller (another thread seeing the same failure) waits for the first one's exit."""
    if not _giving_up.acquire(blocking=False):
        while exit is os._exit:
            time.sleep(60)
        return
    error = RanksLostError(f"{message}; this server across mlx.launch ranks is exiting")
    if tell is not None:
        with contextlib.suppress(Exception):  # a sink's consumer may be gone: the exit goes on
            tell(error)
    try:
        say_on_stderr(f"mlxpaged: {message}; failed the requests in flight, exiting with status {EXIT_STATUS}")
        _flush()
    finally:
        exit(EXIT_STATUS)
    _giving_up.release()  # only an `exit` that returns (tests) gets here


def say_on_stderr(line: str) -> None:
    """Print `line` to stderr if anyone still reads it. Under mlx.launch stdout and stderr are pipes to the
    launcher: stopped with the rest of its process group it may be gone already, and the BrokenPipeError of a print
    would end the thread that was to exit the process (seen: both ranks left running, orphaned, 1 run in 4)."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()


def over_ranks() -> bool:
    """True while this process runs rank 0 of an engine over several ranks."""
    return len(_watchdogs) > 0


def give_up_everywhere(message: str, exit: Exit = os._exit) -> None:
    """Give up on every engine of this process over ranks (mlx.launch's SIGTERM): the step in flight, if any,
    gets `message` and which ranks may be gone. Call it from a thread of its own so the event loop can write
    the errors meanwhile."""
    dogs = list(_watchdogs)
    tells = [w.in_flight for w in dogs if w.in_flight is not None]
    if dogs:
        message = f"{message}: {others(dogs[0].ranks)} is gone"

    def tell_all(error: RanksLostError) -> None:
        for tell in tells:
            tell(error)

    give_up(message, tell_all, exit)


class StepWatchdog:
    """Bounds how long rank 0 stays inside one step across the ranks (`watch`). A step that raises, or is still
    in flight after `ranks.timeout_s`, makes the process give up (`give_up`): a thread does it when the step
    hangs, since the thread running the step is then stuck in a collective."""

    def __init__(self, ranks: Ranks, exit: Exit = os._exit):
        self.ranks, self.exit = ranks, exit
        self.in_flight: Tell | None = None  # how to tell the requests of the step in flight; None: no step
        self._since = 0.0
        self._what = ""
        self._thread: threading.Thread | None = None
        _watchdogs.add(self)

    @contextlib.contextmanager
    def watch(self, what: str, tell: Tell) -> Iterator[None]:
        """Around one step (`what` names it in messages); `tell` fails its requests. Not reentrant."""
        self._start()
        self._since, self._what, self.in_flight = time.monotonic(), what, tell
        try:
            yield
        except Exception as exc:
            self.in_flight = None
            give_up(
                f"{what} failed on rank 0 ({type(exc).__name__}: {exc}); {others(self.ranks)} is gone or missed"
                " its share of the step, and the ranks cannot be brought back in step",
                tell,
                self.exit,
            )
            raise
        finally:
            self.in_flight = None

    def _start(self) -> None:
        if self._thread is None:  # the thread holds the watchdog weakly: it ends with its engine's sender
            self._thread = threading.Thread(
                target=_patrol, args=(weakref.ref(self),), name="mlxpaged-rank-watchdog", daemon=True
            )
            self._thread.start()

    def check(self) -> bool:
        """Give up if the step in flight outlasted the bound (True then)."""
        tell, bound = self.in_flight, self.ranks.timeout_s
        waited = time.monotonic() - self._since
        if tell is None or waited <= bound:
            return False
        give_up(
            f"no answer from {others(self.ranks)} in {waited:.0f} s: {self._what} on rank 0 waited on it"
            f" longer than the rank timeout ({bound:g} s); the rank is hung or gone",
            tell,
            self.exit,
        )
        return True


def _patrol(ref: weakref.ref[StepWatchdog]) -> None:
    while (dog := ref()) is not None:
        pause = min(1.0, dog.ranks.timeout_s / 4)
        if dog.check():
            return
        del dog
        time.sleep(pause)


class LeaderWatch:
    """A follower's bound on rank 0's silence: it hears a message at least every step (which rank 0 gives up on
    past the rank timeout) and every KEEP_ALIVE_S while idle. Silence for twice the rank timeout plus that
    means rank 0 hangs outside a step (deadlocked, stopped): the follower exits non-zero (its receive waits
    in C++, hence os._exit), and mlx.launch then stops rank 0 (SIGTERM). A rank 0 that dies is seen sooner:
    the receive fails (follower.py)."""

    def __init__(self, ranks: Ranks, exit: Exit = os._exit):
        self.ranks, self.exit = ranks, exit
        self.bound = 2 * ranks.timeout_s + KEEP_ALIVE_S
        self.heard = time.monotonic()
        self.done = threading.Event()
        threading.Thread(target=self._run, name="mlxpaged-leader-watch", daemon=True).start()

    def heard_from_leader(self) -> None:
        self.heard = time.monotonic()

    def close(self) -> None:
        self.done.set()

    def _run(self) -> None:
        while not self.done.wait(min(1.0, self.bound / 8)):
            silent = time.monotonic() - self.heard
            if silent > self.bound:
                print(
                    f"mlxpaged (follower rank {self.ranks.rank}): rank 0 sent nothing for {silent:.0f} s (it sends"
                    f" a message every step, at most {self.ranks.timeout_s:g} s, and a keep-alive at least every"
                    f" {KEEP_ALIVE_S:g} s when idle): rank 0 hangs; exiting with status {EXIT_STATUS}",
                    file=sys.stderr,
                    flush=True,
                )
                self.exit(EXIT_STATUS)
                return
