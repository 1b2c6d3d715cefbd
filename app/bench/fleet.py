"""`mlxpaged bench fleet`: an agent fleet against `mlxpaged serve`, mlx_lm.server and mlx-vlm's server.

What a server meets when coding agents use it: N agents (default 8) share a long system prompt (instructions and
a tool list, a few thousand tokens), each works on its own task for M turns (default 4), and every turn resends
the whole conversation plus a tool result, streaming, through the official `openai` client. Each server runs as
a subprocess on a free loopback port, one after another, on the same model directory with the same BLAS and
malloc settings (bench/server.py), with its default settings. Reported per server: the fleet's wall time, time to
first token p50 / p95, inter-token latency p50 / p99 (between streamed content chunks), output tok/s, peak memory
(the server's processes' RSS, sampled), failed turns; then mlxpaged's ratios to the better of the others.

`--long`: one more agent sends a prompt of most of the context once the fleet is under way (a pasted file), and
the other agents' inter-token latency p99 is reported alone. `--soak DURATION`: `mlxpaged serve` alone runs the
fleet round after round for that long, each turn's client hanging up mid-reply one time in five, and the bench
reports the server's memory growth after the first round, the KV blocks still owned once it is idle, failed
turns and 5xx answers. Measured, never asserted.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import random
import sys
import tempfile
import threading
import time
from argparse import Namespace
from dataclasses import dataclass, field

from mlxpaged_app.bench.server import MLX_LM_SERVER, free_port, start_server, stop_server

import httpx

SERVERS = ("mlxpaged", "mlx_lm.server", "mlx-vlm")
MLX_VLM_SERVER = "import mlxpaged, runpy; runpy.run_module('mlx_vlm.server', run_name='__main__')"  # fast BLAS first
AGENTS, TURNS, MAX_TOKENS = 8, 4, 64
LONG_SHARE = 0.75  # of the model's context, the long agent's prompt
LONG_AFTER_S = 2.0  # the long agent starts once the fleet has been running this long
REQUEST_TIMEOUT = 1800.0
HANG_UP_SHARE = 0.2  # --soak: turns whose client hangs up mid-reply

TOOLS = [
    ("read_file", "Read a file of the repository and return its text.", "path"),
    ("write_file", "Write text to a file of the repository, replacing it.", "path, text"),
    ("list_dir", "List the entries of a directory of the repository.", "path"),
    ("grep", "Search the repository for lines matching a regular expression.", "pattern, path"),
    ("run_tests", "Run the test suite, or the tests matching a pattern, and return the report.", "pattern"),
    ("shell", "Run a shell command in the repository and return its output.", "command"),
    ("git_diff", "Show the working tree's changes against the last commit.", ""),
    ("git_commit", "Commit the working tree's changes with a message.", "message"),
]
RULES = [
    "Read the code before you change it, and change only what the task needs.",
    "Prefer small, reviewable edits; keep the style of the file you edit.",
    "After each change, run the tests that cover it and read their report.",
    "Never invent a file's contents: read it with read_file first.",
    "Explain each step in one sentence before you call a tool.",
    "When a test fails, read the failure, find its cause and fix the cause, not the test.",
    "Keep secrets out of the repository and out of your replies.",
    "When the task is done, summarize what changed and how it was checked.",
]
TASKS = [
    "Add a --verbose flag to the command-line tool and print each file it processes.",
    "Fix the off-by-one error in the pagination helper; its last page is empty.",
    "Write tests for the date parser, covering time zones and leap years.",
    "Rename the module utils.py to text_utils.py and update every import.",
    "Make the HTTP client retry on 503 responses with exponential backoff.",
    "Replace the hand-written CSV reader with the standard library's csv module.",
    "Add type hints to the storage layer and make mypy pass on it.",
    "Find why the cache grows without bound and cap it at 1,000 entries.",
    "Document the configuration file's options in the README.",
    "Speed up the slow test of the search index without losing its coverage.",
]


def system_prompt(words: int = 1500) -> str:
    """The fleet's shared system prompt: the agent's rules and its tools, repeated to about `words` words (the
    default model's tokenizer: ~2,000 tokens), the same for every agent and turn (a cacheable prefix)."""
    tools = "\n".join(f"- {name}({args}): {text}" for name, text, args in TOOLS)
    head = (
        "You are a coding agent working in a software repository. Call tools by writing a line "
        f"`CALL name(arguments)`. Your tools:\n{tools}\n\nRules:\n"
    )
    body, n = [], 0
    while len(" ".join(body).split()) < words:
        body.append(f"{n + 1}. {RULES[n % len(RULES)]}")
        n += 1
    return head + "\n".join(body)


def tool_result(agent: int, turn: int) -> str:
    """What the agent's tool call of `turn` returned (a listing and a test report, ~150 tokens)."""
    files = "\n".join(f"src/module_{agent}_{k}.py  {120 + 37 * k + turn} lines" for k in range(6))
    return (
        f"Tool result (turn {turn + 1}):\n{files}\n"
        f"tests: {40 + agent} passed, {turn % 3} failed in {1.5 + 0.25 * agent:.2f} s\n"
        f"FAILED tests/test_module_{agent}.py::test_case_{turn} - AssertionError: expected {turn}, got {turn + 1}"
    )


def long_prompt(tokens: int) -> str:
    """A pasted file of about `tokens` tokens (~0.75 words a token)."""
    line = "def handler(request, context):  # validate, authorize, dispatch and log the request\n"
    return "Review this file and list its problems:\n" + line * max(1, tokens // 20)


def warm_up_prompt(tokens: int) -> str:
    """A prompt of about `tokens` tokens that shares no prefix with the agents' prompts nor with the long one (whose
    prefill would otherwise come partly from the prefix cache)."""
    line = "class Store:  # keeps records, indexes them by key and expires the old ones\n"
    return "Summarize what this module does:\n" + line * max(1, tokens // 20)


@dataclass
class Turn:
    agent: int
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)  # seconds between streamed content chunks
    tokens: int = 0
    error: str | None = None
    status: int | None = None  # the HTTP status of a failed turn, when the server answered one
    hung_up: bool = False  # the client left mid-reply on purpose (--soak)


@dataclass
class FleetRun:
    server: str
    wall: float
    turns: list[Turn]
    peak_rss: int
    long_agent: int | None = None  # the agent index of the long prompt (--long)

    @property
    def ok(self) -> list[Turn]:
        return [t for t in self.turns if t.error is None and not t.hung_up]

    @property
    def complete(self) -> bool:
        """Every turn answered (or left on purpose)."""
        return all(t.error is None for t in self.turns)

    def ttft(self, q: float) -> float:
        return quantile([t.ttft for t in self.ok if t.agent != self.long_agent], q)

    @property
    def long_ttft(self) -> float:
        """The long prompt's time to its first token (nan without one, or when it failed)."""
        return next((t.ttft for t in self.ok if t.agent == self.long_agent), math.nan)

    def gap(self, q: float, others_only: bool = False) -> float:
        turns = [t for t in self.ok if not others_only or t.agent != self.long_agent]
        return quantile([g for t in turns for g in t.gaps], q)

    @property
    def tokens_per_s(self) -> float:
        return sum(t.tokens for t in self.ok) / self.wall


def quantile(values: list[float], q: float) -> float:
    """The `q` quantile of `values` by the nearest rank (NaN for none)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


async def stream_turn(
    client, model: str, messages: list[dict], max_tokens: int, agent: int, hang_up_after: int | None = None
) -> tuple[Turn, str]:
    """One streamed chat turn: its timings and the reply's text; the client hangs up after `hang_up_after`
    content chunks when given."""
    import openai

    turn, text, last = Turn(agent), [], None
    start = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = 0
        async for chunk in stream:
            if chunk.usage is not None:
                turn.tokens = chunk.usage.completion_tokens
            content = chunk.choices[0].delta.content if chunk.choices else None
            if not content:
                continue
            now = time.perf_counter()
            if last is None:
                turn.ttft = now - start
            else:
                turn.gaps.append(now - last)
            last, chunks = now, chunks + 1
            text.append(content)
            if hang_up_after is not None and chunks >= hang_up_after:
                await stream.close()  # the connection drops mid-reply, as a client that went away
                turn.hung_up = True
                break
        turn.tokens = turn.tokens or chunks
    except Exception as exc:  # a dropped connection, a 5xx, a timeout: counted as failed, not timed
        turn.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        turn.status = exc.status_code if isinstance(exc, openai.APIStatusError) else None
    return turn, "".join(text)


async def run_agent(
    client, model: str, agent: int, turns: int, max_tokens: int, system: str, hang_ups: random.Random | None = None
) -> list[Turn]:
    """An agent's turns: each resends the conversation so far plus the last tool result. With `hang_ups`, a turn
    in five hangs up after a few chunks, which ends the agent's conversation."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": TASKS[agent % len(TASKS)]}]
    done = []
    for t in range(turns):
        leave = hang_ups.randint(1, 3) if hang_ups is not None and hang_ups.random() < HANG_UP_SHARE else None
        turn, reply = await stream_turn(client, model, messages, max_tokens, agent, leave)
        done.append(turn)
        if turn.error is not None or turn.hung_up:
            break
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": tool_result(agent, t)}]
    return done


async def run_long_agent(client, model: str, agent: int, tokens: int, max_tokens: int) -> list[Turn]:
    await asyncio.sleep(LONG_AFTER_S)
    turn, _ = await stream_turn(client, model, [{"role": "user", "content": long_prompt(tokens)}], max_tokens, agent)
    return [turn]


async def run_fleet(url: str, model: str, fleet: Namespace, hang_ups: int | None = None) -> tuple[float, list[Turn]]:
    """(wall seconds, every turn) of the fleet against the server at `url`; `hang_ups`: the seed of the turns
    whose clients hang up (--soak), None for none."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT)
    system = system_prompt(fleet.system_words)
    # Warm-up, untimed: a prompt about as long as an agent's first turn that shares none of its prefix (a first
    # prefill of such a length compiles and allocates what the timed turns would otherwise pay for).
    warm = [{"role": "user", "content": warm_up_prompt(len(system.split()) * 4 // 3)}]
    await stream_turn(client, model, warm, 8, -1)
    start = time.perf_counter()
    work = [
        run_agent(
            client,
            model,
            i,
            fleet.turns,
            fleet.max_tokens,
            system,
            None if hang_ups is None else random.Random(hang_ups * 1000 + i),
        )
        for i in range(fleet.agents)
    ]
    if fleet.long_tokens:
        work.append(run_long_agent(client, model, fleet.agents, fleet.long_tokens, fleet.max_tokens))
    results = await asyncio.gather(*work)
    wall = time.perf_counter() - start
    await client.close()
    return wall, [turn for turns in results for turn in turns]


class PeakMemory:
    """The largest RSS of a process and its children, sampled every 0.2 s on a thread until `stop`."""

    def __init__(self, pid: int):
        import psutil

        self.peak, self._stop = 0, threading.Event()
        self._process = psutil.Process(pid)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, self.current())

    def current(self) -> int:
        """The processes' RSS now (0 once they are gone)."""
        import psutil

        try:
            return sum(p.memory_info().rss for p in [self._process, *self._process.children(recursive=True)])
        except psutil.Error:
            return 0

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def server_command(name: str, path: str, port: int, kv_disk: str | None = None) -> tuple[list[str], str]:
    """(the command that starts server `name` on `path` at `port`, the URL path that answers once it is ready).
    `mlxpaged serve` keeps its prefix cache's disk tier (on by default) in `kv_disk` when given."""
    if name == "mlxpaged":
        serve = ["-m", "mlxpaged_app.cli", "serve", "--model", path, "--port", str(port)]
        serve += ["--kv-disk", kv_disk] if kv_disk else []
        return [sys.executable, *serve, "--log-level", "warning", "--no-access-log"], "/health"
    if name == "mlx_lm.server":
        return [sys.executable, "-c", MLX_LM_SERVER, "--model", path, "--port", str(port)], "/v1/models"
    cmd = [sys.executable, "-c", MLX_VLM_SERVER, "--model", path, "--host", "127.0.0.1", "--port", str(port)]
    return cmd, "/health"


def served_name(url: str, fallback: str) -> str:
    """The model id the server lists first (each names a loaded model its own way), else `fallback`."""
    try:
        data = httpx.get(f"{url}/v1/models", timeout=10).json().get("data") or []
        return str(data[0]["id"]) if data else fallback
    except (httpx.HTTPError, ValueError, KeyError):
        return fallback


def cold_disk_tier() -> tempfile.TemporaryDirectory:
    """An empty directory for `mlxpaged serve`'s disk tier, for one run: the fleet's conversations are the same from
    run to run (greedy), so in the user's cache directory a run would find the prompts of the runs before it, the long
    one too, and measure the disk tier's hits instead of a cold server."""
    return tempfile.TemporaryDirectory(prefix="mlxpaged-fleet-kv-")


def run_server(name: str, path: str, fleet: Namespace) -> FleetRun:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with cold_disk_tier() as kv_disk:
        command, ready = server_command(name, path, port, kv_disk)
        process = start_server(command, f"{url}{ready}")
        try:
            model = served_name(url, path)
            memory = PeakMemory(process.pid)
            wall, turns = asyncio.run(run_fleet(url, model, fleet))
            peak = memory.stop()
        finally:
            stop_server(process)
    return FleetRun(name, wall, turns, peak, fleet.agents if fleet.long_tokens else None)


def kv_blocks_used(url: str) -> int | None:
    """`mlxpaged serve`'s KV blocks owned by requests (its /metrics, every model's), once no request runs (None:
    unread)."""
    import re

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        running = re.findall(r"^mlxpaged_requests_running(?:\{[^}]*\})? (\S+)$", metrics, re.M)
        used = re.findall(r'^mlxpaged_kv_blocks\{[^}]*state="used"[^}]*\} (\S+)$', metrics, re.M)
        if running and not any(float(v) for v in running):
            return int(sum(float(v) for v in used)) if used else None
        time.sleep(0.5)
    return None


def soak(path: str, fleet: Namespace, seconds: float) -> int:
    """`mlxpaged serve` under the fleet, round after round for `seconds`, clients hanging up at random."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    turns: list[Turn] = []
    with cold_disk_tier() as kv_disk:
        command, ready = server_command("mlxpaged", path, port, kv_disk)
        process = start_server(command, f"{url}{ready}")
        try:
            model, memory = served_name(url, path), PeakMemory(process.pid)
            end, rounds, after_first = time.monotonic() + seconds, 0, 0
            while rounds == 0 or time.monotonic() < end:
                _, done = asyncio.run(run_fleet(url, model, fleet, hang_ups=rounds))
                turns += done
                rounds += 1
                after_first = after_first or memory.current()
                print(f"  round {rounds}: {len(done)} turns, RSS {memory.current() / 2**20:,.0f} MiB", flush=True)
            last, peak, owned = memory.current(), memory.stop(), kv_blocks_used(url)
        finally:
            stop_server(process)
    failed = [t for t in turns if t.error is not None]
    fives = [t for t in failed if t.status is not None and t.status >= 500]
    growth = (last - after_first) / after_first if after_first else float("nan")
    print(
        f"soak: {rounds} rounds, {len(turns)} turns ({sum(t.hung_up for t in turns)} hung up on purpose), "
        f"{len(failed)} failed, {len(fives)} answered 5xx; RSS after the first round {after_first / 2**20:,.0f} MiB, "
        f"at the end {last / 2**20:,.0f} MiB ({growth:+.1%}), peak {peak / 2**20:,.0f} MiB; KV blocks still owned "
        f"once idle: {owned if owned is not None else 'unread'}"
    )
    for turn in failed[:3]:
        print(f"  failed: {turn.error}")
    return 0 if not failed and owned == 0 else 1


def available_servers(names: tuple[str, ...]) -> list[str]:
    """The servers of `names` this machine has (mlx-vlm only with its package)."""
    return [n for n in names if n != "mlx-vlm" or importlib.util.find_spec("mlx_vlm") is not None]


def print_runs(runs: list[FleetRun], fleet: Namespace) -> None:
    from mlxpaged.units import format_size

    print(
        f"\n{'server':<14} {'wall s':>7} {'TTFT p50':>9} {'TTFT p95':>9} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'tok/s':>6} {'peak mem':>9} {'failed':>6}" + ("  others' ITL p99  long TTFT" if fleet.long_tokens else "")
    )
    for r in runs:
        print(
            f"{r.server:<14} {r.wall:>7.1f} {r.ttft(0.5):>8.2f}s {r.ttft(0.95):>8.2f}s {r.gap(0.5):>7.3f}s "
            f"{r.gap(0.99):>7.3f}s {r.tokens_per_s:>6.1f} {format_size(r.peak_rss):>9} "
            f"{len(r.turns) - len(r.ok):>6}"
            + (f"  {r.gap(0.99, others_only=True):>15.3f}s {r.long_ttft:>9.1f}s" if fleet.long_tokens else "")
        )
    ours = next((r for r in runs if r.server == "mlxpaged" and r.complete), None)
    peers = [r for r in runs if r.server != "mlxpaged" and r.complete]  # a server that failed turns is no peer
    if ours is None or not peers:
        return
    best = min(peers, key=lambda r: r.wall)
    print(
        f"mlxpaged against the better peer ({best.server}): wall {best.wall / ours.wall:.2f}x faster, "
        f"TTFT p50 {best.ttft(0.5) / ours.ttft(0.5):.2f}x, p95 {best.ttft(0.95) / ours.ttft(0.95):.2f}x, "
        f"output tok/s {ours.tokens_per_s / best.tokens_per_s:.2f}x"
    )
    for peer in peers:
        if peer is not best:
            print(f"  against {peer.server}: wall {peer.wall / ours.wall:.2f}x faster")


def bench_fleet(args: Namespace) -> int:
    if importlib.util.find_spec("openai") is None:
        print("bench fleet drives the servers with the official OpenAI client: pip install 'mlxpaged[bench]'")
        return 2
    import json

    from mlxpaged.loading.loader import default_dtype
    from mlxpaged.loading.model_store import provision, resolve
    from mlxpaged.platform.model_facts import context_length

    path = provision(resolve(args.model), default_dtype())
    context = context_length(json.loads((path / "config.json").read_text())) or 8192
    fleet = Namespace(
        agents=args.agents or AGENTS,
        turns=args.turns or TURNS,
        max_tokens=args.tokens or MAX_TOKENS,
        system_words=getattr(args, "system_words", None) or 1500,
        long_tokens=int(LONG_SHARE * context) if args.long else 0,
    )
    if getattr(args, "soak", None):
        print(
            f"model {path.name}; soak of {args.soak:g} s: {fleet.agents} agents x {fleet.turns} turns a round, "
            f"{HANG_UP_SHARE:.0%} of turns hang up mid-reply; mlxpaged serve alone, default settings"
        )
        return soak(str(path), fleet, args.soak)
    servers = available_servers(tuple(args.servers or SERVERS))
    print(
        f"model {path.name}; {fleet.agents} agents x {fleet.turns} turns, a shared system prompt of "
        f"{fleet.system_words} words, up to {fleet.max_tokens} tokens a reply, greedy, streaming"
        + (f"; a long prompt of ~{fleet.long_tokens} tokens after {LONG_AFTER_S:g} s" if fleet.long_tokens else "")
        + f"; servers: {', '.join(servers)}, one after another, default settings"
    )
    runs = []
    for name in servers:
        run = run_server(name, str(path), fleet)
        failed = [t.error for t in run.turns if t.error]
        print(
            f"  {name:<14} wall {run.wall:.1f} s, TTFT p50 {run.ttft(0.5):.2f} s"
            + (f", {len(failed)} failed ({failed[0]})" if failed else ""),
            flush=True,
        )
        runs.append(run)
    print_runs(runs, fleet)
    return 0 if all(r.complete for r in runs) else 1
