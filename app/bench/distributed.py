"""`mlxpaged bench distributed`: the paged engine in 1, 2 and 4 processes (`mlx.launch`, ring backend on
loopback): time to first token and batch-1 decode tok/s, the same prompts greedy in each, and whether every
process count gave the tokens one process gives. The comparison is 1 process vs N in the same run.

    mlxpaged bench distributed [--model M] [--processes 1,2,4] [--tokens 16] [--runs 1]

On one machine's CPU more processes are slower: each step adds all-reduces between processes (two per layer,
one for rank 0's plan) and they share the same cores. This bench is about correctness and the path to real
machines (one process per Mac over Thunderbolt), not speed on one box.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from argparse import ArgumentTypeError, Namespace
from pathlib import Path

from mlxpaged.distributed.launch import loopback_command, result_from
from mlxpaged.errors import ConfigError

DEFAULT_PROCESSES = (1, 2, 4)
PROMPTS = (
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Name three prime numbers and say why each is prime.",
)
RUN_TIMEOUT_S = 600
NOTE = (
    "On one machine's CPU more processes are slower: every step adds all-reduces between the processes "
    "(ring backend on loopback) and they share the same cores. The point is correctness (the same tokens) and "
    "the path to real machines: one process per Mac, `mlxpaged launch --hostfile hosts.json -- serve ...`."
)


def parse_processes(text: str) -> tuple[int, ...]:
    """`--processes 1,2,4`: 1 always runs first (the reference the others are compared with)."""
    try:
        counts = {int(part) for part in text.split(",") if part.strip()}
    except ValueError as exc:
        raise ArgumentTypeError(f"comma-separated process counts like 1,2,4, got {text!r}") from exc
    if not counts or min(counts) < 1:
        raise ArgumentTypeError(f"process counts must be at least 1, got {text!r}")
    return tuple(sorted(counts | {1}))


def run_processes(model: str, processes: int, tokens: int, runs: int) -> dict:
    """One launch of distributed_ranks.py in `processes` processes; rank 0's result."""
    script = [sys.executable, "-m", "mlxpaged_app.bench.distributed_ranks"]
    command = loopback_command([*script, model, str(tokens), str(runs), json.dumps(PROMPTS)], processes)
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(
            f"{processes} processes exited {done.returncode}:\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"
        )
    return result_from(done.stdout)


def table(results: dict[int, dict]) -> list[str]:
    """One row per process count: medians, the ratio to 1 process, and whether its tokens are 1 process's."""
    one = results[1]
    base = statistics.median(one["decode"])
    rows = [f"  {'processes':>9}  {'ready in':>8}  {'first token':>11}  {'decode tok/s':>12}  {'vs 1':>6}  same tokens"]
    for n, r in results.items():
        decode = statistics.median(r["decode"])
        same = "yes" if r["tokens"] == one["tokens"] else "NO"
        rows.append(
            f"  {n:>9}  {r['start_s']:>7.1f}s  {statistics.median(r['ttft']):>10.3f}s  {decode:>12.1f}  "
            f"{decode / base:>5.2f}x  {same if n > 1 else '(reference)'}"
        )
    return rows


def bench_distributed(args: Namespace) -> int:
    from mlxpaged_app.bench.random_model import describe, write_random_llama

    counts = args.processes or DEFAULT_PROCESSES
    if args.runs < 1 or args.tokens < 2:
        raise ConfigError(f"--runs must be at least 1 and --tokens at least 2, got {args.runs} and {args.tokens}")
    with tempfile.TemporaryDirectory(prefix="mlxpaged-bench-") as scratch:
        model, what = args.model, args.model
        if model is None:  # the default model's 3 KV heads do not split over 2 or 4 processes
            model, what = str(write_random_llama(Path(scratch) / "model")), describe()
        print(
            f"model {what}; {len(PROMPTS)} prompts, each greedy at batch 1, {args.tokens} new tokens, "
            f"{args.runs} timed round(s) after a short untimed one; processes {', '.join(map(str, counts))} "
            "(mlx.launch, ring backend on loopback)",
            flush=True,
        )
        results: dict[int, dict] = {}
        for n in counts:
            results[n] = run_processes(model, n, args.tokens, args.runs)
            r = results[n]
            print(
                f"  {n} process{'es' * (n > 1)}: decode {statistics.median(r['decode']):.1f} tok/s, "
                f"first token {statistics.median(r['ttft']):.3f} s",
                flush=True,
            )
    print("\n".join(["", *table(results), ""]))
    agree = all(r["tokens"] == results[1]["tokens"] for r in results.values())
    steady = all(r["same_every_round"] for r in results.values())
    print(
        "every process count gave the same tokens: "
        + ("yes" if agree else "NO (a bug: greedy decoding must not depend on the process count)")
        + ("" if steady else "; some rounds differed from their first")
    )
    print(NOTE)
    return 0 if agree and steady else 1
