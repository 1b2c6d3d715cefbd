"""`mlxpaged bench restart`: time to first token of one long prompt cold, from the RAM prefix cache, and from the
disk tier after a real process restart.

Two worker processes share a fresh disk-tier directory: the first prefills the prompt cold, asks it again (a RAM
hit), and exits (its engine writes what the writer has not yet); the second, a new process, asks it once more and
reads the prefix from disk. Each worker first runs a short prompt of its own, untimed, so compiling is not timed.
Targets (issue 24): disk hit <= 3x the RAM hit, and >= 10x faster than cold.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from argparse import Namespace

DEFAULT_PROMPT_TOKENS = 8000  # the default model's context is 8192: the prompt and one reply token fit
WARM_UP_TOKENS = 64
DISK_TARGET, COLD_TARGET = 3.0, 10.0


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    """A fixed pseudo-random prompt: the prefix cache keys on token ids, the timings do not care what they say."""
    rng = random.Random(seed)
    low = min(1000, vocab // 4)
    return [rng.randrange(low, vocab) for _ in range(n)]


def time_to_first_token(engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token and how many prompt tokens were not prefilled."""
    from mlxpaged.sampling_params import SamplingParams

    start = time.perf_counter()
    out = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0]
    return time.perf_counter() - start, out.cached_tokens


def run_worker(phase: str, model: str | None, disk: str, prompt_tokens: int) -> dict:
    """One process's half: 'first' (cold, then a RAM hit) or 'restarted' (a disk hit)."""
    from mlxpaged.engine.engine import Engine

    engine = Engine.from_pretrained(model, kv_disk=disk)
    vocab = engine.facts.vocab_size or len(engine.tokenizer.vocab)
    prompt = prompt_ids(prompt_tokens, 0, vocab)
    time_to_first_token(engine, prompt_ids(WARM_UP_TOKENS, 1 if phase == "first" else 2, vocab))  # compiles
    result: dict = {"prompt_tokens": len(prompt), "model": engine.loaded.name}
    if phase == "first":
        result["cold"] = time_to_first_token(engine, prompt)
        start = time.perf_counter()
        engine.wait_disk_writes()  # the RAM hit is timed alone, not beside the writer
        result["writer_seconds"] = time.perf_counter() - start
        result["ram"] = time_to_first_token(engine, prompt)
    else:
        result["disk"] = time_to_first_token(engine, prompt)
    stats = engine.stats()
    start = time.perf_counter()
    engine.close()  # the writer finishes its queue: the next process finds every block
    result.update(
        close_seconds=time.perf_counter() - start,
        disk_read_seconds=stats["disk_read_seconds"],
        disk_read_bytes=stats["disk_read_bytes"],
        disk_snapshot_seconds=stats["disk_snapshot_seconds"],
        written_bytes=engine.stats()["disk_written_bytes"],
        written_per_prompt_token=engine.stats()["disk_written_bytes_per_prompt_token"],
    )
    return result


def _spawn(phase: str, args: Namespace, disk: str) -> dict:
    command = [sys.executable, "-m", "mlxpaged_app.bench.restart", phase, disk, str(args.prompt_tokens)]
    if args.model:
        command += ["--model", args.model]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {phase} worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_restart(args: Namespace) -> int:
    from mlxpaged.units import format_size

    args.prompt_tokens = getattr(args, "prompt_tokens", None) or DEFAULT_PROMPT_TOKENS
    disk = tempfile.mkdtemp(prefix="mlxpaged-bench-restart-")
    try:
        print(f"bench restart: {args.prompt_tokens}-token prompt; disk tier in {disk} (fresh); two processes")
        first = _spawn("first", args, disk)
        second = _spawn("restarted", args, disk)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    (cold, _), (ram, ram_cached), (hit, disk_cached) = first["cold"], first["ram"], second["disk"]
    n = first["prompt_tokens"]
    print(f"  model {first['model']}, time to first token (1 reply token, greedy):")
    print(f"  cold                       {cold:8.3f} s")
    print(f"  RAM hit (same process)     {ram:8.3f} s   {ram_cached:,} of {n:,} tokens cached")
    print(f"  disk hit (after restart)   {hit:8.3f} s   {disk_cached:,} of {n:,} tokens from disk")
    print(
        f"  disk read into the pool    {second['disk_read_seconds']:8.3f} s   "
        f"{format_size(second['disk_read_bytes'])} read"
    )
    print(
        f"  written                    {format_size(first['written_bytes'])} "
        f"({first['written_per_prompt_token'] / 1024:.1f} KiB per prompt token computed, each block once); "
        f"steps copying pages out {first['disk_snapshot_seconds']:.3f} s; the writer finished "
        f"{first['writer_seconds']:.2f} s after the first token; close {first['close_seconds']:.2f} s"
    )
    disk_vs_ram, cold_vs_disk = hit / ram, cold / hit
    print(
        f"  disk hit / RAM hit  {disk_vs_ram:5.2f}x  (target <= {DISK_TARGET:.0f}x: "
        f"{'met' if disk_vs_ram <= DISK_TARGET else 'missed'})"
    )
    print(
        f"  cold / disk hit     {cold_vs_disk:5.1f}x  (target >= {COLD_TARGET:.0f}x: "
        f"{'met' if cold_vs_disk >= COLD_TARGET else 'missed'})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a worker of `mlxpaged bench restart`")
    parser.add_argument("phase", choices=["first", "restarted"])
    parser.add_argument("disk")
    parser.add_argument("prompt_tokens", type=int)
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    print(json.dumps(run_worker(args.phase, args.model, args.disk, args.prompt_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
