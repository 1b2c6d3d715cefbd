"""Issue 21: the engine thread's host time per decode step with many requests, on the GPU's path.

A 24-layer, 64-wide llama (SmolLM2-1.7B's depth, compute next to nothing) under `backend.simulate("cuda")`:
`--batch` greedy requests of `--tokens` new tokens each go in at once (engine.generate, as `bench gpu`'s batch
rows do); every engine step on the engine thread is timed, and the steady decode steps (every request running,
none waiting) give the median wall and engine-thread CPU ms per step (CPU: time.thread_time, so waits for MLX's
stream are left out). mlx-lm's BatchGenerator runs the same prompts for comparison (`next_generated()` per step).
`--model DIR`: a real model on this machine's own backend instead (a GPU: a step's wall time far above its CPU
time means the device bounds it, not the host). `--profile` adds a cProfile of the engine thread's steps by CPU
time (MLX's nanobind calls show as the own time of the Python function calling them).

    python docs/design/scripts/issue21_batch_host.py [--batch 64] [--tokens 64] [--runs 3] [--profile]
    python docs/design/scripts/issue21_batch_host.py --model /tmp/models/1.7b --batch 64 --tokens 128 --runs 1
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.loading.loader import load_model
from mlxpaged.platform import backend
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_engine import tiny_engine
from tests.tiny_models import random_tokens, tiny_llama

from mlx_lm.generate import BatchGenerator


def mlx_lm_step_ms(model, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """Median (wall, thread CPU) ms of BatchGenerator's steps once every sequence decodes."""
    gen = BatchGenerator(model, stop_tokens=[], max_tokens=tokens, completion_batch_size=len(prompts))
    gen.insert(prompts, [tokens] * len(prompts))
    walls, cpus = [], []
    while True:
        start, start_cpu = time.perf_counter(), time.thread_time()
        responses = gen.next_generated()
        if not responses:
            break
        if len(responses) == len(prompts):
            walls.append(time.perf_counter() - start)
            cpus.append(time.thread_time() - start_cpu)
    gen.close()
    return statistics.median(walls[1:]) * 1000, statistics.median(cpus[1:]) * 1000


class StepTimer:
    """Wraps the core's step on the engine thread: its duration when every request runs and none waits."""

    def __init__(self, core, batch: int, profile: cProfile.Profile | None = None):
        self.core, self.batch, self.profile, self.times, self.cpu = core, batch, profile, [], []
        self.step = core.step
        core.step = self

    def __call__(self) -> None:
        scheduler = self.core.scheduler
        steady = len(scheduler.running) == self.batch and not scheduler.num_waiting
        start, start_cpu = time.perf_counter(), time.thread_time()
        if self.profile is not None and steady:
            self.profile.enable()
        try:
            self.step()
        finally:
            if self.profile is not None and steady:
                self.profile.disable()
            if steady:
                self.times.append(time.perf_counter() - start)
                self.cpu.append(time.thread_time() - start_cpu)


def build(args):
    """(engine, model, prompts, what): the tiny model under simulate("cuda"), or with --model a real one on
    this machine's own backend (bench gpu's batch prompts: 256-512 random tokens)."""
    if args.model is None:
        model = tiny_llama(num_layers=args.layers)
        prompts = [random_tokens(20 + i % 16, seed=i) for i in range(args.batch)]
        settings = {"max_num_seqs": max(8, args.batch), "cache_tokens": args.batch * (64 + args.tokens) + 512}
        engine = tiny_engine(model, load_model().tokenizer, max_batch_tokens=max(256, args.batch), **settings)
        return engine, model, prompts, f"{args.layers}-layer 64-wide llama (simulated cuda)"
    from mlxpaged.engine.engine import Engine
    from mlxpaged_app.bench.batch import random_prompts

    tokens = args.batch * (512 + args.tokens + 32)
    engine = Engine.from_pretrained(args.model, max_num_seqs=args.batch, cache_tokens=max(tokens, 16384))
    prompts = random_prompts(args.batch, 256, 512, engine.loaded.config["vocab_size"])
    return engine, engine.loaded.model, prompts, f"{engine.loaded.name} on {backend.describe()}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a model directory: time it on this machine's backend (a GPU run)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-mlx-lm", action="store_true", help="skip BatchGenerator")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--calls", action="store_true", help="also the top entries by call count")
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    # The simulation must hold while the engine runs, not only when it is built.
    with backend.simulate("cuda") if args.model is None else contextlib.nullcontext():
        engine, model, prompts, what = build(args)
        engine.generate(prompts, params)  # warm-up: every shape once
        timer = StepTimer(engine.core, args.batch)
        ours = []
        for _ in range(args.runs):
            timer.times, timer.cpu = [], []
            engine.pool.reset_prefix_cache()
            engine.generate(prompts, params)
            ours.append((statistics.median(timer.times) * 1000, statistics.median(timer.cpu) * 1000))
        if args.profile:
            # Timed by the thread's CPU clock: waits for the device (or MLX's CPU stream) are left out.
            profile = cProfile.Profile(time.thread_time)
            timer.profile = profile
            timer.times = []
            engine.pool.reset_prefix_cache()
            engine.generate(prompts, params)
            profiled_steps = len(timer.times)
        engine.close()
    rows = {"engine": ours}
    if not args.no_mlx_lm:
        mlx_lm_step_ms(model, prompts, args.tokens)  # warm-up
        rows["mlx-lm BatchGenerator"] = [mlx_lm_step_ms(model, prompts, args.tokens) for _ in range(args.runs)]
    print(f"{what}, batch {args.batch}, {args.tokens} tokens, {args.runs} runs, steady decode steps:")
    for name, values in rows.items():
        walls, cpus = [w for w, _ in values], [c for _, c in values]
        print(
            f"  {name:<24} wall {statistics.median(walls):6.2f} ms/step, engine-thread CPU "
            f"{statistics.median(cpus):6.2f} ms/step  (CPU per run: {', '.join(f'{v:.2f}' for v in cpus)})"
        )
    if args.profile:
        print(f"\nprofile of {profiled_steps} steady steps on the engine thread:")
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        if args.calls:
            stats.sort_stats("ncalls").print_stats(args.top)


if __name__ == "__main__":
    main()
