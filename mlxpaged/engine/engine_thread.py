"""The thread that drives one Engine: it owns MLX for it and holds it only weakly.

Holding the engine only while working on it lets an engine dropped without `close()` be
collected; its finalizer queues a close command, which ends this thread. At interpreter exit,
shutdown.py closes the engines still open.
"""

from __future__ import annotations

import queue
import threading
import weakref

import mlx.core as mx

from mlxpaged.engine.output_processor import EngineClosedError
from mlxpaged.platform.memory import wired_limit
from mlxpaged.engine import shutdown

IDLE_WAIT_S = 0.5  # how long an idle engine thread waits for a command before looking again


def start(engine, commands: queue.SimpleQueue) -> threading.Thread:
    """Start `engine`'s thread, reading `commands`; close it when it is collected or at exit."""
    ref = weakref.ref(engine)
    thread = threading.Thread(target=_serve, name="mlxpaged-engine", daemon=True,
                              args=(ref, commands, engine.core, engine.plan, engine.cache_config.wire))
    weakref.finalize(engine, commands.put, ("close",)).atexit = False  # shutdown.py handles exit
    shutdown.track(engine)
    thread.start()
    return thread


def _serve(ref: weakref.ref, commands: queue.SimpleQueue, core, plan, wire: bool) -> None:
    stream = mx.new_stream(mx.default_device())  # MLX streams belong to the thread that made them
    try:
        with mx.stream(stream), wired_limit(plan, enabled=wire, streams=[stream]):
            engine = ref()
            if engine is not None:
                engine._warm_up()
            del engine
            while _turn(ref, commands):
                pass
        closed = EngineClosedError("the engine was closed")
        core.fail_all(closed)
        _fail_queued(commands, closed)
    finally:
        # MLX requires a thread to release its streams before it ends, or the process can
        # abort at exit ("terminate called without an active exception").
        mx.clear_streams()


def _turn(ref: weakref.ref, commands: queue.SimpleQueue) -> bool:
    """One pass of the engine loop; False when the engine must stop. While idle it waits for a
    command holding no reference to the engine, so that dropping the engine can collect it."""
    engine = ref()
    if engine is None:
        return False
    if not engine.core.has_unfinished:
        del engine
        try:
            command = commands.get(timeout=IDLE_WAIT_S)
        except queue.Empty:
            return True
        engine = ref()
        if engine is None or not engine._apply(command):
            return False
    return engine._work()


def _fail_queued(commands: queue.SimpleQueue, exc: EngineClosedError) -> None:
    """Requests submitted but not yet admitted when the engine stopped: their callers must not wait forever."""
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            return
        if command[0] == "add":
            try:
                command[-1](exc)  # the request's sink
            except Exception:
                pass  # its consumer is gone (e.g. a closed event loop): nobody is left to tell
