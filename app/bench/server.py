"""`mlxpaged bench server`: `mlxpaged serve` against `mlx_lm.server`, same model, same run.

Both servers run as subprocesses on free loopback ports (nothing else is contacted), with the
same OpenBLAS preload and malloc settings. For each
concurrency level, C clients each stream one chat completion (distinct prompts, greedy, the same
max_tokens) through the OpenAI HTTP API; C = 1 runs three requests one after another. Reported:
aggregate generated tokens per second over the level's wall time, and time to first token
(request sent -> first content chunk), median and p90. Measured, never asserted.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from dataclasses import dataclass

import httpx

LEVELS = (1, 8, 32)
SEQUENTIAL_RUNS = 3  # requests at concurrency 1
START_TIMEOUT = 300.0
REQUEST_TIMEOUT = 600.0
TOPICS = [
    "a lighthouse keeper",
    "a lost robot",
    "a desert caravan",
    "a deep-sea diver",
    "a mountain village",
    "a clockmaker",
    "a dragon who fears fire",
    "a space station cook",
    "a river pilot",
    "a night market",
    "a beekeeper",
    "a glass city",
    "an old library",
    "a storm chaser",
    "a chess prodigy",
    "a forest ranger",
    "a tiny island",
    "a broken violin",
    "a train across Siberia",
    "a map of the moon",
    "a retired spy",
    "a garden on Mars",
    "a polar expedition",
    "a street musician",
    "a haunted radio",
    "a paper airplane",
    "a sunken ship",
    "a volcano observatory",
    "a snow leopard",
    "a time-traveling cat",
    "a desert well",
    "a carnival at midnight",
]
# `python -m mlx_lm.server`, with the same fast BLAS loaded first (as `import mlxpaged` does for us):
# without it MLX's CPU wheel uses a reference BLAS ~20x slower, which would not be a fair peer.
MLX_LM_SERVER = "import mlxpaged, runpy; runpy.run_module('mlx_lm.server', run_name='__main__')"
# The CPU backend re-faults large temporaries every step unless glibc keeps them (mlxpaged/platform/malloc.py).
BENCH_ENV = {"MALLOC_MMAP_THRESHOLD_": "2000000000", "MALLOC_TRIM_THRESHOLD_": "4000000000"}


@dataclass
class Sample:
    ttft: float
    tokens: int
    seconds: float
    error: str | None = None  # the request failed (a dropped connection, a 5xx): counted, not timed


@dataclass
class Level:
    server: str
    concurrency: int
    samples: list[Sample]
    wall: float

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.error is None]

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.ok) / self.wall

    def ttft(self, quantile: float) -> float:
        values = sorted(s.ttft for s in self.ok) or [float("nan")]
        return values[min(len(values) - 1, int(quantile * len(values)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(command: list[str], ready_url: str) -> subprocess.Popen:
    """Start a server (its output to a temporary file, so no pipe can fill) and wait until
    `ready_url` answers 200; fail with the end of its output."""
    log = tempfile.TemporaryFile()  # noqa: SIM115  (it outlives this call: stop_server closes it)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **BENCH_ENV})
    process.log = log
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    stop_server(process)
    log.seek(0)
    raise RuntimeError(f"{' '.join(command[:4])} did not start: {log.read().decode(errors='replace')[-2000:]}")


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    process.log.close()


def chat_body(topic: str, max_tokens: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"Write a long, detailed story about {topic}."}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_one(client: httpx.AsyncClient, body: dict) -> Sample:
    start = time.perf_counter()
    try:
        return await _stream(client, body, start)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Sample(0.0, 0, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")


async def _stream(client: httpx.AsyncClient, body: dict, start: float) -> Sample:
    first, chunks, usage = None, 0, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            usage = event.get("usage") or usage
            if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                chunks += 1
                first = first or time.perf_counter()
    tokens = usage["completion_tokens"] if usage else chunks
    return Sample((first or time.perf_counter()) - start, tokens, time.perf_counter() - start)


async def run_level(url: str, name: str, concurrency: int, max_tokens: int) -> Level:
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT, limits=limits) as client:
        await stream_one(client, chat_body("warming up", 4))
        start = time.perf_counter()
        if concurrency == 1:
            samples = [await stream_one(client, chat_body(TOPICS[i], max_tokens)) for i in range(SEQUENTIAL_RUNS)]
        else:
            bodies = [chat_body(TOPICS[i % len(TOPICS)], max_tokens) for i in range(concurrency)]
            samples = list(await asyncio.gather(*(stream_one(client, b) for b in bodies)))
    return Level(name, concurrency, samples, time.perf_counter() - start)


def print_results(results: list[Level], max_tokens: int) -> None:
    print(
        f"\n{'server':<14} {'clients':>7} {'requests':>8} {'failed':>6} {'tokens':>7} {'wall s':>7} {'tok/s':>7} "
        f"{'TTFT p50':>9} {'TTFT p90':>9}"
    )
    for level in results:
        print(
            f"{level.server:<14} {level.concurrency:>7} {len(level.samples):>8} "
            f"{len(level.samples) - len(level.ok):>6} {sum(s.tokens for s in level.ok):>7} {level.wall:>7.1f} "
            f"{level.tokens_per_s:>7.1f} {level.ttft(0.5):>8.2f}s {level.ttft(0.9):>8.2f}s"
        )
    by_key = {(r.server, r.concurrency): r for r in results}
    for c in sorted({r.concurrency for r in results}):
        ours, ref = by_key.get(("mlxpaged", c)), by_key.get(("mlx_lm.server", c))
        if ours and ref:
            print(
                f"  {c:>2} clients: throughput {ours.tokens_per_s / ref.tokens_per_s:.2f}x, "
                f"TTFT p50 {ref.ttft(0.5) / ours.ttft(0.5):.2f}x faster"
            )
    print(f"(greedy chat, up to {max_tokens} tokens each; tok/s = all generated tokens / wall time)")


def run_server_bench(args: Namespace) -> int:
    from mlxpaged.loading.loader import default_dtype
    from mlxpaged.loading.model_store import provision, resolve

    levels = tuple(getattr(args, "concurrency", None) or LEVELS)
    max_tokens = getattr(args, "tokens", None) or 64
    path = provision(resolve(getattr(args, "model", None)), default_dtype())
    ours_port, ref_port = free_port(), free_port()
    ours_cmd = [
        sys.executable,
        "-m",
        "mlxpaged_app.cli",
        "serve",
        "--model",
        str(path),
        "--port",
        str(ours_port),
        "--max-num-seqs",
        str(max(levels)),
        "--log-level",
        "warning",
        "--no-access-log",
        *getattr(args, "serve_args", []),
    ]  # e.g. ["--max-batch-tokens", "512"] to trade throughput for TTFT
    ref_cmd = [
        sys.executable,
        "-c",
        MLX_LM_SERVER,
        "--model",
        str(path),
        "--port",
        str(ref_port),
        "--log-level",
        "WARNING",
        "--decode-concurrency",
        str(max(levels)),
    ]
    print(
        f"model {path.name}; levels {levels}; {max_tokens} max tokens per request; servers on 127.0.0.1; "
        f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    servers = []
    try:
        for name, port, command in (("mlxpaged", ours_port, ours_cmd), ("mlx_lm.server", ref_port, ref_cmd)):
            url = f"http://127.0.0.1:{port}"
            servers.append((name, url, start_server(command, f"{url}/health")))
        results = [level for i, c in enumerate(levels) for level in _run_pair(servers, i, c, max_tokens)]
    finally:
        for _, _, process in servers:
            stop_server(process)
    print_results(results, max_tokens)
    return 0


def _run_pair(servers: list, i: int, concurrency: int, max_tokens: int) -> list[Level]:
    levels = []
    for name, url, _ in servers if i % 2 == 0 else servers[::-1]:  # alternate who goes first
        level = asyncio.run(run_level(url, name, concurrency, max_tokens))
        failed = [s.error for s in level.samples if s.error]
        print(
            f"  {name:<14} {concurrency:>2} clients: {level.tokens_per_s:6.1f} tok/s, TTFT p50 "
            f"{level.ttft(0.5):.2f}s" + (f", {len(failed)} failed ({failed[0]})" if failed else ""),
            flush=True,
        )
        levels.append(level)
    return levels


if __name__ == "__main__":
    # python -m mlxpaged_app.bench.server [TOKENS [extra `mlxpaged serve` flags...]]
    sys.exit(
        run_server_bench(
            Namespace(model=None, tokens=int(sys.argv[1]) if len(sys.argv) > 1 else 64, serve_args=sys.argv[2:])
        )
    )
