"""Engines still open when the interpreter exits are closed first, so the process exits cleanly.

An engine's thread owns MLX streams. If it is still alive when Python finalizes (a script that
forgets `close()`, `sys.exit` mid-generation, Ctrl-C), the daemon thread is frozen and the process
aborts ("terminate called without an active exception", exit 134). So at exit every open engine
is told to stop at its next step boundary, and we wait (bounded) for its thread to end: the thread
then releases its streams and restores the wired limit itself, as on `close()`.

The hook is `atexit.register`, not `threading._register_atexit`: it runs after Python has joined
non-daemon threads (one still using an engine finishes its work) and before daemon threads are
frozen (checked on CPython 3.10-3.13). Engines are held weakly: the registry never keeps one alive.
"""

from __future__ import annotations

import atexit
import sys
import time
import weakref

# Longest wait for an engine thread to reach its step boundary (a full prefill chunk of a large
# model on a CPU takes seconds, not minutes); past it the process exits anyway.
STEP_TIMEOUT_S = 60.0

_open_engines: weakref.WeakSet = weakref.WeakSet()


def track(engine) -> None:
    """Close `engine` at interpreter exit if it is still open then."""
    _open_engines.add(engine)


def close_open_engines(timeout: float = STEP_TIMEOUT_S) -> None:
    """Tell every open engine to stop, then wait for them together (one timeout, not one each)."""
    engines = list(_open_engines)
    for engine in engines:
        engine.begin_close()
    deadline = time.monotonic() + timeout
    for engine in engines:
        _wait_through_interrupts(engine, deadline)
    stuck = sum(engine.running for engine in engines)
    if stuck:
        sys.stderr.write(f"mlxpaged: {stuck} engine thread(s) still mid-step after {timeout:.0f} s; exiting anyway\n")


def _wait_through_interrupts(engine, deadline: float) -> None:
    """Wait for the engine thread until `deadline`; a second Ctrl-C must not cut the wait short,
    since leaving with the thread mid-step is exactly the abort this module prevents."""
    while engine.running and (left := deadline - time.monotonic()) > 0:
        try:
            engine.close(timeout=left)
        except KeyboardInterrupt:
            continue


atexit.register(close_open_engines)
