"""The `mlxpaged serve` process: flags, safety checks, model load, uvicorn, and a clean stop.

Order: check the flags (a non-loopback bind needs an API key), bind the port (a clear error if it
is taken), load --model (the default model without it) and every --pin (an Embedder for an embedding model, an
Engine otherwise), each sized by the memory plan (the plan is printed) within --max-memory and warmed up with one
tiny request, then serve (other models load on demand: model_registry.py), and print "ready" only once uvicorn
accepts connections. SIGINT /
SIGTERM: stop accepting, give in-flight requests --drain-timeout seconds, abort the rest, close
every engine (which restores the wired limit) and exit 0. A second Ctrl-C skips the wait.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import signal
import socket
import sys
import threading

from mlxpaged.distributed.launch import launched_alone
from mlxpaged.distributed.ranks import follows, join_group, launched
from mlxpaged.errors import MlxpagedError, user_message
from mlxpaged_app.server.flags import ServeError, cache_settings, check_bind, lora_flags, server_config
from mlxpaged_app.server.ranks import (
    distributed_settings,
    join_group_then_watch_for_term,
    parallel_setting,
    run_follower_rank,
    stopped_by_launcher,
)

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


def build_registry(args: argparse.Namespace, config):
    """The model registry, with --model (None: the default model) and every --pin loaded before serving: they are
    provisioned here (a hub model may download), checked against the budget, loaded and warmed up."""
    across_ranks = launched()  # rank 0 under mlx.launch: the other ranks hold shards of its one model and follow
    if across_ranks:
        join_group()  # before importing the engine or provisioning anything: the ranks must join together
    from mlxpaged_app.server.model_catalog import ModelCatalog
    from mlxpaged_app.server.model_loading import EngineSettings, build_model, estimate_cost
    from mlxpaged_app.server.model_registry import ModelRegistry, RegistryPolicy

    if across_ranks and args.pin:
        raise ServeError("--pin: a server across mlx.launch ranks serves the one model every rank holds a shard of")
    adapters = lora_flags(args.lora)
    if across_ranks and adapters:
        raise ServeError("--lora: adapters across mlx.launch ranks are not supported yet")
    if args.pipeline and not across_ranks:
        raise ServeError("--pipeline splits the model over the processes mlx.launch starts; this server runs alone")
    settings = EngineSettings(
        distributed_settings(args) if across_ranks else cache_settings(args),
        args.generation_config,
        parallel=parallel_setting(args),
        rank_timeout_s=args.rank_timeout if across_ranks else None,
    )
    catalog = ModelCatalog(use_store=not across_ranks)  # across ranks: no other model loads on demand
    first = _given(catalog, args.model)
    if adapters:  # before it loads: its engine is built with them
        first = catalog.adapters.add_given(first, adapters)
    if args.draft_model is not None:
        if args.speculative not in (None, "dflash", "eagle3"):  # the draft model is a DFlash / EAGLE-3 drafter
            raise ServeError(f"--draft-model drafts with the draft model; drop --speculative {args.speculative}")
        first = _with_draft(catalog, first, args.draft_model, across_ranks)
    pinned = [_given(catalog, name) for name in args.pin]
    policy = RegistryPolicy(
        memory_budget(args.max_memory),
        keep_alive_flag(args.keep_alive),
        frozenset(name for entry in pinned for name in entry.names),
        args.load_timeout,
    )
    registry = ModelRegistry(
        catalog,
        config,
        policy,
        estimate=functools.partial(estimate_cost, settings=settings),
        build=functools.partial(build_model, settings=settings),
    )
    try:
        for entry in {e.name: e for e in (first, *pinned)}.values():
            _preload(registry, entry, settings)
    except BaseException:
        registry.close()
        raise
    return registry


def _with_draft(catalog, entry, draft: str, across_ranks: bool):
    """--draft-model: `entry` (--model) drafts with it; provisioned now, as --model is, and checked with the model
    before either is read (estimate_cost: the pair's memory; the engine's build: the tokenizers)."""
    import dataclasses

    from mlxpaged.loading.loader import locate_model
    from mlxpaged_app.server.model_catalog import ModelNotServable

    if across_ranks:
        raise ServeError("--draft-model: a draft model across mlx.launch ranks is not supported yet")
    try:
        found = catalog.find(draft)  # a store directory by its base name too, as --model
        where = (found.ref, found.path) if found.ref is not None else locate_model(draft)
    except ModelNotServable:
        where = locate_model(draft)  # not here yet: provisioned as `mlxpaged pull` would
    entry = dataclasses.replace(entry, draft=where)
    catalog.replace_given(entry)
    return entry


def _given(catalog, name: str | None):
    """A model named on the command line, provisioned now (as `mlxpaged pull` would) and added to the catalog."""
    from mlxpaged.loading.loader import locate_model
    from mlxpaged_app.server.model_catalog import ModelNotServable, canonical_name

    if name is not None:
        try:
            found = catalog.find(name)  # already here: a store directory by its base name too
            return catalog.add_given(found.name, found.ref, found.path, found.description)
        except ModelNotServable:
            pass  # not here yet, or a directory outside the store: provision it as `mlxpaged pull` would
    ref, path = locate_model(name)
    return catalog.add_given(canonical_name(ref, path), ref, path, ref.preset.description if ref.preset else "")


def _preload(registry, entry, settings) -> None:
    """Load `entry` before serving: an Engine, or an Embedder for an embedding model (embedding/model_files.py says
    which are; the KV-cache flags do not apply to it, --max-batch-tokens bounds its forward passes)."""
    from mlxpaged.units import format_size
    from mlxpaged_app.server.model_loading import build_model, estimate_cost

    say(f"mlxpaged serve: loading {entry.name}...")
    cost, budget = estimate_cost(entry, settings), registry.policy.budget_bytes
    if budget is not None and registry.held_bytes() + cost.total > budget:
        raise ServeError(
            f"{entry.name} needs {cost.describe()} but {format_size(budget - registry.held_bytes())} of the "
            f"{format_size(budget)} memory budget (--max-memory) is left; raise --max-memory or pin fewer models"
        )
    model, defaults, cost = build_model(entry, settings)
    if entry.kind == "embed":
        say(f"mlxpaged serve: {model.describe()}; it answers /v1/embeddings and /api/embed")
    else:
        say(model.plan.describe())
        if model.ranks is not None:
            say(f"mlxpaged serve: {model.ranks.parallel} parallel over {model.ranks.size} processes (rank 0 serves)")
        say(f"mlxpaged serve: {describe_disk_tier(model.stats())}")
        say(f"mlxpaged serve: sampling defaults: {defaults.describe()}")
    registry.add_loaded(entry, model, defaults, cost)


def describe_disk_tier(stats: dict) -> str:
    """One line on the prefix cache's disk tier: where and how full, or why it is off."""
    from mlxpaged.units import format_size

    if stats.get("disk_tier"):
        return (
            f"prefix cache on disk in {stats['disk_dir']} ({format_size(stats['disk_used_bytes'])} of "
            f"{format_size(stats['disk_limit_bytes'])}; --no-kv-disk keeps it in memory only)"
        )
    return f"prefix cache in memory only ({stats.get('disk_tier_off') or '--no-kv-disk'})"


def with_sampling_defaults(config, engine, mode: str):
    """`config` with the defaults requests to `engine` get (--generation-config): the model's, or none."""
    from mlxpaged_app.server.model_loading import sampling_defaults

    return dataclasses.replace(config, sampling_defaults=sampling_defaults(engine, mode))


def memory_budget(text: str | None) -> int:
    """--max-memory in bytes; by default what the memory plan allows all models: the device limit (on CPU the
    memory available now, before any model is loaded) less the OS reserve."""
    from mlxpaged.platform.memory import DeviceFacts, os_reserve_bytes
    from mlxpaged.units import parse_size

    if text is not None:
        return parse_size(text, param="max_memory")
    device = DeviceFacts.detect()
    return max(device.limit_bytes - os_reserve_bytes(device.total_bytes), 0)


def keep_alive_flag(text: str) -> float | None:
    from mlxpaged_app.server.keep_alive import KeepAliveError, parse_keep_alive

    try:
        return parse_keep_alive(text)
    except KeepAliveError as exc:
        raise ServeError(f"--keep-alive: {exc}") from None


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
    across = launched() and not launched_alone()  # `mlx.launch -n 1` is one process
    if main and across:  # SIGTERM: another rank failed; rank 0 may be waiting in a collective (ranks.py)
        try:
            join_group_then_watch_for_term("rank 0")
        except MlxpagedError as exc:
            print(f"mlxpaged serve: {user_message(exc, 'cli')}", file=sys.stderr)
            return 1
    previous = signal.signal(signal.SIGTERM, _interrupt) if main and not across else None  # until uvicorn
    try:
        with contextlib.closing(sock):
            return _load_and_serve(args, config, sock)
    except KeyboardInterrupt:
        say("mlxpaged serve: interrupted before it was ready; stopped")
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _load_and_serve(args: argparse.Namespace, config, sock: socket.socket) -> int:
    try:
        registry = build_registry(args, config)
    except (ValueError, MlxpagedError, ServeError) as exc:  # settings, memory, model: one line naming the flag
        print(f"mlxpaged serve: {user_message(exc, 'cli')}", file=sys.stderr)
        return 1
    try:
        serve_until_signal(registry, config, sock, args)
    finally:
        registry.close()  # closes every engine: aborts whatever is left and restores the wired limit
    say("mlxpaged serve: stopped")
    return 0


def serve_until_signal(registry, config, sock: socket.socket, args: argparse.Namespace) -> None:
    from mlxpaged.distributed.watchdog import count_responses_with
    from mlxpaged.units import format_size
    from mlxpaged_app.server.api_server import create_app
    from mlxpaged_app.server.keep_alive import describe_keep_alive
    from mlxpaged_app.server.server_log import configure

    configure(args.log_level)
    app = create_app(registry, config)
    # Across ranks, rank 0 giving up on a lost rank exits once the clients have their errors (watchdog.py).
    count_responses_with(lambda: app.state.server.responses_in_progress)
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
    policy = registry.policy
    models = (
        f"model {registry.default_name}; other models load on demand within {format_size(policy.budget_bytes)}, "
        f"{describe_keep_alive(policy.keep_alive)}"
    )
    server = GracefulServer(
        uv_config,
        app.state.server,
        args.drain_timeout,
        on_ready=lambda: say(f"mlxpaged serve: ready at {url}/v1 ({models}; {auth}; Ctrl-C to stop)"),
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
        if stopped_by_launcher(sig):  # across mlx.launch ranks: another rank failed, rank 0 exits non-zero
            return
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for in-flight requests
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            self.state.registry.start()  # idle timers of the models loaded before the loop ran
            self.on_ready()
