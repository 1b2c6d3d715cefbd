"""The thread that drives one engine's core: it owns MLX for it, applies the commands callers queue and
steps the core (EngineCore's public API only). It holds the Engine only weakly.

Holding no reference to the engine lets an engine dropped without `close()` be collected; its finalizer
queues a close command, which ends this thread. At interpreter exit, shutdown.py closes the engines still open.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from mlxpaged.engine import shutdown
from mlxpaged.engine.core import EngineCore
from mlxpaged.engine.request import ImageSpan
from mlxpaged.errors import EngineClosedError
from mlxpaged.platform.memory import MemoryPlan, wired_limit
from mlxpaged.runner import recorder
from mlxpaged.sampling_params import SamplingParams

import mlx.core as mx

IDLE_WAIT_S = 0.5  # how long an idle engine thread waits for a command before looking again


@dataclass(frozen=True)
class Add:
    """Start a request; its events (StreamDelta, or an exception) go to `sink`. A prompt with images: where they
    are and what its prefill is fed (engine/request.py)."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    sink: Callable[[object], None]
    images: tuple[ImageSpan, ...] = ()
    multimodal: object | None = None
    adapter: str | None = None  # the id of the adapter it runs with (adapters/), None: the base model
    both_ways: tuple[tuple[int, int], ...] = ()  # prompt spans attended both ways (engine/request.py)


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Flush:
    """Hand every block the disk tier still holds in RAM only to its writer, then set `done`."""

    done: threading.Event


@dataclass(frozen=True)
class Close:
    """Stop at the next step boundary."""


@dataclass(frozen=True)
class Call:
    """Run `fn` on the engine thread between steps (what changes the model, such as attaching an adapter, must not
    run while a pass is being built) and put its result, or its exception, in `result`."""

    fn: Callable[[], object]
    result: concurrent.futures.Future


Command = Add | Abort | Flush | Close | Call


def start(engine, commands: queue.SimpleQueue, core: EngineCore, plan: MemoryPlan, wire: bool) -> threading.Thread:
    """Start the thread stepping `core` and reading `commands`; close it when `engine` is collected or at exit."""
    ref = weakref.ref(engine)
    thread = threading.Thread(
        target=_serve, name="mlxpaged-engine", daemon=True, args=(ref, commands, core, plan, wire)
    )
    weakref.finalize(engine, commands.put, Close()).atexit = False  # shutdown.py handles exit
    shutdown.track(engine)
    thread.start()
    return thread


def _serve(ref: weakref.ref, commands: queue.SimpleQueue, core: EngineCore, plan: MemoryPlan, wire: bool) -> None:
    # MLX streams belong to the thread that made them; with a recorder thread (runner/recorder.py) it evaluates
    # what this one builds, so the stream is one any thread may use.
    recording = recorder.wanted()
    device = mx.default_device()
    stream = mx.new_thread_unsafe_stream(device) if recording else mx.new_stream(device)
    try:
        with mx.stream(stream), wired_limit(plan, enabled=wire, streams=[stream]):
            if recording:
                core.runner.recorder = recorder.Recorder()
            if ref() is not None:
                core.warm_up()
            while _turn(ref, commands, core):
                pass
            closed = EngineClosedError("the engine was closed")
            core.fail_all(closed)
            _fail_queued(commands, closed)
            core.close()  # on this thread's stream: the disk tier copies its last blocks out of the pools
    finally:
        if core.runner.recorder is not None:
            core.runner.recorder.close()
            core.runner.recorder = None
        # MLX requires a thread to release its streams before it ends, or the process can
        # abort at exit ("terminate called without an active exception").
        mx.clear_streams()


def _turn(ref: weakref.ref, commands: queue.SimpleQueue, core: EngineCore) -> bool:
    """One pass of the engine loop; False when the engine must stop (closed, or collected). While idle
    it waits for a command."""
    if ref() is None:
        return False
    if not core.has_unfinished:
        core.idle()
        try:
            command = commands.get(timeout=core.idle_wait_s or IDLE_WAIT_S)
        except queue.Empty:
            return True
        if ref() is None or not apply(core, command):
            return False
    return work(core, commands)


def work(core: EngineCore, commands: queue.SimpleQueue) -> bool:
    """Apply the queued commands, then run one step if a request is unfinished; False to stop."""
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            break
        if not apply(core, command):
            return False
    if core.has_unfinished:
        try:
            with _watched(core, commands):
                core.step()
        except Exception as exc:  # a failed step fails its requests, not the engine
            core.fail_all(exc)
    return True


def _watched(core: EngineCore, commands: queue.SimpleQueue) -> contextlib.AbstractContextManager[None]:
    """Across processes (distributed/leader.py) the other ranks may fail or hang a step: the mirror then fails
    the requests in flight, and those queued, from whichever thread sees it (this one may be stuck in MLX), and
    ends the process. It touches no MLX: the requests' sinks, the scheduler's tables, the queue."""
    mirror = core.runner.mirror
    if mirror is None:
        return contextlib.nullcontext()

    def tell(exc: Exception) -> None:
        core.outputs.fail_all(exc)
        _fail_queued(commands, exc)

    return mirror.watch(tell)


def apply(core: EngineCore, command: Command) -> bool:
    """Apply one command to the core; False for Close. A request the core refuses gets the error in its sink."""
    core.runner.settle_recording(quiet=True)  # a command may evaluate (a Call) or stop the run; a failure is the step's
    if isinstance(command, Close):
        return False
    if isinstance(command, Add):
        try:
            core.add_request(
                command.request_id,
                command.token_ids,
                command.params,
                command.sink,
                command.images,
                command.multimodal,
                command.adapter,
                command.both_ways,
            )
        except Exception as exc:
            command.sink(exc)
    elif isinstance(command, Abort):
        core.abort(command.request_id)
    elif isinstance(command, Flush):
        try:
            core.idle()
        finally:
            command.done.set()
    elif isinstance(command, Call):
        try:
            command.result.set_result(command.fn())
        except Exception as exc:
            command.result.set_exception(exc)
    return True


def _fail_queued(commands: queue.SimpleQueue, exc: Exception) -> None:
    """Requests submitted but not yet admitted when the engine stopped: their callers must not wait forever."""
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            return
        if isinstance(command, Add):
            with contextlib.suppress(Exception):  # its consumer is gone (e.g. a closed event loop): nobody to tell
                command.sink(exc)
        elif isinstance(command, Call):
            command.result.set_exception(exc)
