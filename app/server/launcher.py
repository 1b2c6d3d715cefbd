"""The `mlxpaged serve` process: flags, safety checks, model load, uvicorn, and a clean stop.

Order: check the flags (a non-loopback bind needs an API key), bind the port (a clear error if it
is taken), load the model and size the cache (the plan is printed), warm the engine up with one
tiny request, then serve, and print "ready" only once uvicorn accepts connections. SIGINT /
SIGTERM: stop accepting, give in-flight requests --drain-timeout seconds, abort the rest, close
the engine (which restores the wired limit) and exit 0. A second Ctrl-C skips the wait.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import socket
import sys
import threading

from mlxpaged.distributed.ranks import follows, launched
from mlxpaged.errors import MlxpagedError, user_message
from mlxpaged_app.server.flags import ServeError, cache_settings, check_bind, server_config
from mlxpaged_app.server.ranks import distributed_settings, run_follower_rank

import uvicorn

ABORT_GRACE = 10.0  # at most this long between aborting in-flight requests and cancelling their tasks


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host.strip("[]"), port), family=family)
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def say(text: str) -> None:
    print(text, flush=True)


def load_engine(args: argparse.Namespace):
    """The model to serve: an Embedder for an embedding model (embedding/model_files.py says which are), else an
    Engine. The KV-cache flags do not apply to an embedder; --max-batch-tokens bounds its forward passes."""
    from mlxpaged.embedding.embedder import Embedder
    from mlxpaged.embedding.model_files import is_embedding_model
    from mlxpaged.engine.engine import Engine
    from mlxpaged.loading.loader import locate_model

    say(f"mlxpaged serve: loading {args.model or 'the default model'}...")
    if launched():  # rank 0 under mlx.launch: the other ranks hold shards and follow (server/ranks.py)
        from mlxpaged.distributed.start import start_engine

        engine = start_engine(args.model, **distributed_settings(args))
        assert engine is not None  # rank 0 gets the engine
        say(engine.plan.describe())
        say(f"mlxpaged serve: tensor parallel over {engine.ranks.size} processes (rank 0 serves)")
        return engine
    ref, path = locate_model(args.model)
    if is_embedding_model(path, ref.preset.options if ref.preset else None):
        embedder = Embedder.from_pretrained(args.model, max_batch_tokens=args.max_batch_tokens)
        say(f"mlxpaged serve: {embedder.describe()}; it answers /v1/embeddings and /api/embed")
        return embedder
    engine = Engine.from_pretrained(args.model, **cache_settings(args))
    say(engine.plan.describe())
    say(f"mlxpaged serve: {describe_disk_tier(engine.stats())}")
    return engine


def describe_disk_tier(stats: dict) -> str:
    """One line on the prefix cache's disk tier: where and how full, or why it is off."""
    from mlxpaged.units import format_size

    if stats.get("disk_tier"):
        return (
            f"prefix cache on disk in {stats['disk_dir']} ({format_size(stats['disk_used_bytes'])} of "
            f"{format_size(stats['disk_limit_bytes'])}; --no-kv-disk keeps it in memory only)"
        )
    return f"prefix cache in memory only ({stats.get('disk_tier_off') or '--no-kv-disk'})"


def is_embedder(served) -> bool:
    from mlxpaged.embedding.embedder import Embedder

    return isinstance(served, Embedder)


def with_sampling_defaults(config, engine, mode: str):
    """`config` with the defaults requests get (--generation-config): the model's, read once here, or none."""
    from mlxpaged.loading.generation_defaults import GenerationDefaults

    if is_embedder(engine):
        return config  # an embedding model samples nothing
    defaults = engine.generation_defaults if mode == "auto" else GenerationDefaults({}, "--generation-config none")
    say(f"mlxpaged serve: sampling defaults: {defaults.describe()}")
    return dataclasses.replace(config, sampling_defaults=defaults)


def warm_up(engine) -> None:
    """The first step allocates and compiles; pay for it before saying "ready"."""
    from mlxpaged.sampling_params import SamplingParams

    if is_embedder(engine):
        engine.embed(["Hello"])
        return
    engine.generate("Hello", SamplingParams(max_tokens=2, temperature=0.0))


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_serve(args: argparse.Namespace) -> int:
    """`mlxpaged serve`: exit 0 after SIGINT / SIGTERM, 1 when it cannot start (the reason on stderr)."""
    if follows():  # a rank other than 0 under mlx.launch: no port, no HTTP
        return run_follower_rank(args)
    try:
        check_bind(args.host, args.api_key, args.allow_no_key)
        config = server_config(args)
        sock = bind_socket(args.host, args.port)
    except (ServeError, ValueError) as exc:
        print(f"mlxpaged serve: {user_message(exc, 'cli')}", file=sys.stderr)
        return 1
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main else None  # until uvicorn takes over
    try:
        with contextlib.closing(sock):
            return _load_and_serve(args, config, sock)
    except KeyboardInterrupt:
        say("mlxpaged serve: interrupted before it was ready; stopped")
        return 0
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def _load_and_serve(args: argparse.Namespace, config, sock: socket.socket) -> int:
    try:
        engine = load_engine(args)
    except (ValueError, MlxpagedError) as exc:  # settings, memory, model: one line naming the flag
        print(f"mlxpaged serve: {user_message(exc, 'cli')}", file=sys.stderr)
        return 1
    try:
        config = with_sampling_defaults(config, engine, args.generation_config)
    except (ValueError, MlxpagedError) as exc:  # a generation_config.json with bad values: named, with the file
        engine.close()
        print(f"mlxpaged serve: {user_message(exc, 'cli')}; --generation-config none ignores it", file=sys.stderr)
        return 1
    try:
        warm_up(engine)
        serve_until_signal(engine, config, sock, args)
    finally:
        engine.close()  # aborts whatever is left and restores the wired limit
    say("mlxpaged serve: stopped")
    return 0


def serve_until_signal(engine, config, sock: socket.socket, args: argparse.Namespace) -> None:
    from mlxpaged_app.server.api_server import create_app
    from mlxpaged_app.server.server_log import configure

    configure(args.log_level)
    app = create_app(engine, config)
    uv_config = uvicorn.Config(
        app,
        lifespan="off",
        log_level=args.log_level,
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=args.drain_timeout + ABORT_GRACE,
        server_header=False,
    )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    auth = "API key required" if config.api_key else "no API key"
    kind = "embedding model" if is_embedder(engine) else "model"
    server = GracefulServer(
        uv_config,
        app.state.server,
        args.drain_timeout,
        on_ready=lambda: say(
            f"mlxpaged serve: ready at {url}/v1 ({kind} {engine.loaded.name}, {auth}; Ctrl-C to stop)"
        ),
    )
    server.run(sockets=[sock])


class GracefulServer(uvicorn.Server):
    """uvicorn's Server without re-raising the signal after shutdown (so the process exits 0), and
    with the app told to refuse new work (503, /health draining) from the first signal on."""

    def __init__(self, config, state, drain_timeout: float, on_ready) -> None:
        super().__init__(config)
        self.state, self.drain_timeout, self.on_ready = state, drain_timeout, on_ready

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's drain, with our deadline first: at it, in-flight requests are aborted and their
        streams end with finish_reason "abort" and [DONE]; uvicorn cancels what is left after the grace."""
        deadline = asyncio.get_running_loop().call_later(self.drain_timeout, self.state.abort_all)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            deadline.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        self.state.draining = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for in-flight requests
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            self.on_ready()
