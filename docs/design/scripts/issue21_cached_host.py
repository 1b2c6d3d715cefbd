"""Issue 21: the host's part of a cached-prefix follow-up (`bench gpu --parts ttft`'s "cached" column).

`bench prefill` times a prompt cold, then FOLLOW_UPS follow-ups, each the previous prompt plus
APPENDED_TOKENS tokens: each is an 8k prefix-cache hit that computes only its new tokens. On an H200 that
took 39 ms at 8k where the model's work is ~1-2 ms, so the rest is host work that grows with the prompt.
This measures it on the path a GPU takes (platform/backend.py simulating CUDA) with a 24-layer, 64-wide
llama (SmolLM2-1.7B's depth, compute next to nothing), split into:

- caller: `Engine.submit` on the caller's thread (token checks, length checks; a text prompt would add
  its tokenizing);
- schedule: the scheduler's step (prefix matching, hashing, allocation, the chunk);
- build: the runner building the pass (block tables, views, the model graph) and launching it;
- compute: launching the pass (on the CPU backend mx.async_eval computes much of it) and waiting for its
  tokens: the model's work, which a GPU does in ~1-2 ms;
- add: the engine thread taking the request (Request, sampler state, text stream);
- update + process: computed counts, caching blocks, detokenizing, delivering the token;
- step_rest: the rest of the engine's steps;
- queue: the rest of submit -> first token (the command queue, the threads waking);
- sha256: block hashes computed per follow-up (calls of the hash function).

The cold prompt before the follow-ups runs under `simulate("cpu")` (NumPy attention): it only fills the
prefix cache, and the GPU path's attention is far slower on this CPU.

    python docs/design/scripts/issue21_cached_host.py [--sizes 2048,8192] [--layers 24] [--profile]
                                                      [--model DIR]

`--model DIR`: that model on the backend MLX really computes on (a GPU machine: the kit's /tmp/models/1.7b), no
simulation; the "compute" column is then the real device's work.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.loading.loader import load_model
from mlxpaged.platform import backend
from mlxpaged.runner import sampling
from mlxpaged.sampling_params import SamplingParams
from mlxpaged_app.bench.prefill import APPENDED_TOKENS, FOLLOW_UPS
from tests.engine.test_engine import tiny_engine
from tests.tiny_models import random_tokens, tiny_llama

PARTS = ("caller", "add", "schedule", "build", "compute", "update", "process", "step_rest")


class Timers:
    """Seconds per part of the current follow-up, summed over the engine thread's steps."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.in_follow_up = False  # the cold prompt before the follow-ups is not profiled

    def wrap(self, owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - start

        setattr(owner, name, timed)


def instrument(engine, timers: Timers) -> None:
    core = engine.core
    timers.wrap(engine, "submit", "caller")
    timers.wrap(core, "add_request", "add")  # the engine thread taking the request (Request, sampler, text)
    timers.wrap(core, "step", "step")  # the whole step; its parts below, the rest is "step_rest"
    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(core.runner, "step", "build")  # builds the passes
    timers.wrap(core.runner, "launch", "launch")  # mx.async_eval: on the CPU backend it computes too
    timers.wrap(core.scheduler, "update_from_output", "update")
    timers.wrap(core.outputs, "process", "process")
    # Reading the sampled tokens waits for the pass: the model's work.
    results = sampling.LazySample.results

    def timed_results(self):
        start = time.perf_counter()
        try:
            return results(self)
        finally:
            timers.spent["compute"] += time.perf_counter() - start

    sampling.LazySample.results = timed_results
    # Block hashes computed (sha256 calls): the manager's own hash function, or its BlockHashes' where it has one.
    manager = core.scheduler.kv_manager
    owner = getattr(manager, "hashes", manager)
    hash_fn = owner.hash_fn

    def counted(*args):
        timers.spent["sha256"] += 1
        return hash_fn(*args)

    owner.hash_fn = counted


def follow_ups(engine, size: int, seed: int, timers: Timers, simulated: bool = True) -> list[dict[str, float]]:
    """A cold prompt of `size - 1 - FOLLOW_UPS * APPENDED_TOKENS` tokens, then its follow-ups: each one's
    total and parts in ms."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    text = random_tokens(size - 1, seed=seed)
    prompt = text[: -APPENDED_TOKENS * FOLLOW_UPS]
    engine.pool.reset_prefix_cache()
    # The cold prefill only fills the cache: simulated, the CPU's own attention is faster for it.
    with backend.simulate("cpu") if simulated else contextlib.nullcontext():
        next(iter(engine.stream(prompt, params)))
    rows = []
    timers.in_follow_up = True
    for i in range(1, FOLLOW_UPS + 1):
        timers.spent.clear()
        start = time.perf_counter()
        delta = next(iter(engine.stream(text[: len(prompt) + APPENDED_TOKENS * i], params)))
        total = time.perf_counter() - start
        assert delta.token_id is not None
        spent = {part: 1000 * t for part, t in timers.spent.items()}
        row = {part: spent.get(part, 0.0) for part in PARTS}
        row["build"] -= spent.get("launch", 0.0)
        row["compute"] += spent.get("launch", 0.0)
        row["step_rest"] = spent["step"] - sum(row[p] for p in ("schedule", "build", "compute", "update", "process"))
        row["total"] = 1000 * total
        row["sha256"] = timers.spent.get("sha256", 0)
        row["queue"] = row["total"] - sum(row[p] for p in PARTS)
        rows.append(row)
    timers.in_follow_up = False
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="2048,8192")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile the engine thread's steps of the last size")
    parser.add_argument("--model", default=None, help="a model directory, on the real backend (no simulation)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    simulated = args.model is None
    with backend.simulate("cuda") if simulated else contextlib.nullcontext():
        settings = {"cache_tokens": 4 * max(sizes), "max_model_len": 2 * max(sizes), "max_num_seqs": 16}
        if simulated:
            engine = tiny_engine(
                tiny_llama(num_layers=args.layers), load_model().tokenizer, block_size=16, **settings
            )
        else:
            from mlxpaged.engine.engine import Engine

            engine = Engine.from_pretrained(args.model, **settings)
        timers = Timers()
        instrument(engine, timers)
        what = f"{args.layers}-layer tiny llama, simulated cuda" if simulated else args.model
        print(
            f"backend {backend.describe()}, {what}, medians in ms of "
            f"{args.runs} runs x {FOLLOW_UPS} follow-ups of {APPENDED_TOKENS} new tokens"
        )
        print(f"{'size':>6} {'total':>7} " + " ".join(f"{p:>8}" for p in (*PARTS, "queue", "sha256")))
        for size in sizes:
            follow_ups(engine, size, 1, timers, simulated)  # warm-up: shapes compile, caches fill
            rows = [
                row for run in range(args.runs) for row in follow_ups(engine, size, 100 + run, timers, simulated)
            ]
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(
                f"{size:>6} {med['total']:>7.2f} "
                + " ".join(f"{med[p]:>8.2f}" for p in (*PARTS, "queue"))
                + f" {med['sha256']:>8.0f}"
            )
        if args.profile:
            profile = cProfile.Profile()
            step = engine.core.step

            def profiled_step() -> None:
                if not timers.in_follow_up:
                    return step()
                profile.enable()
                try:
                    step()
                finally:
                    profile.disable()

            engine.core.step = profiled_step
            follow_ups(engine, sizes[-1], 7, timers, simulated)
            stats = pstats.Stats(profile)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(40)
        engine.close()


if __name__ == "__main__":
    main()
