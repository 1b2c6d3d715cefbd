"""The step budget's two sides on the embedded model (issue 38): streams beside a long prompt, and a prompt alone.

    python docs/design/scripts/issue38_step_budget.py beside 750     # or off: no budget (2,048-token chunks)
    python docs/design/scripts/issue38_step_budget.py alone 750

beside: three streams decode; 3 s later a 4,000-token prompt arrives; prints its time to first token and the
streams' longest and median gap between two tokens while it prefilled. alone: a 5,000-token prompt, twice.
Run with MALLOC_MMAP_THRESHOLD_=2000000000 MALLOC_TRIM_THRESHOLD_=4000000000 on the CPU (DESIGN.md).
"""

from __future__ import annotations

import itertools
import sys
import threading
import time

from mlxpaged import Engine, SamplingParams
from mlxpaged_app.bench.kv import held_out_text


def beside(engine: Engine, words: list[str]) -> str:
    long_prompt = engine.tokenizer.encode(" ".join((words * 3)[:4000]))[:4000]
    engine.generate(long_prompt[:600], SamplingParams(temperature=0, max_tokens=2))  # warm, and a first measurement
    stamps: dict[int, list[float]] = {i: [] for i in range(3)}

    def stream(i: int) -> None:
        prompt = engine.tokenizer.encode(" ".join(words[i * 50 : i * 50 + 40]))
        for _ in engine.stream(prompt, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)):
            stamps[i].append(time.perf_counter())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(3)
    sent = time.perf_counter()
    first = None
    for _ in engine.stream(long_prompt, SamplingParams(temperature=0, max_tokens=1)):
        first = first or time.perf_counter()
    assert first is not None
    gaps = sorted(b - a for s in stamps.values() for a, b in itertools.pairwise(s) if sent <= a <= first)
    for thread in threads:
        thread.join()
    return (
        f"time to first token of the 4,000-token prompt {first - sent:.1f} s; the streams' gaps meanwhile: "
        f"max {gaps[-1]:.2f} s, median {gaps[len(gaps) // 2]:.2f} s ({len(gaps)} gaps)"
    )


def alone(engine: Engine, words: list[str]) -> str:
    prompt = engine.tokenizer.encode(" ".join((words * 3)[:4200]))[:5000]
    engine.generate(prompt[:600], SamplingParams(temperature=0, max_tokens=1))
    times = []
    for _ in range(2):
        started = time.perf_counter()
        engine.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
        times.append(time.perf_counter() - started)
    return f"{len(prompt)} tokens alone: " + ", ".join(f"{t:.1f} s" for t in times)


def main() -> None:
    part, budget = sys.argv[1], sys.argv[2]
    step_budget_ms = None if budget == "off" else float(budget)
    with Engine.from_pretrained(cache_tokens=8192, step_budget_ms=step_budget_ms, enable_prefix_cache=False) as engine:
        print(f"step budget {budget}: {(beside if part == 'beside' else alone)(engine, held_out_text().split())}")


if __name__ == "__main__":
    main()
