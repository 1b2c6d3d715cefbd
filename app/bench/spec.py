"""`mlxpaged bench spec`: batch-1 greedy decode with and without prompt-lookup speculation, side by side
on repetitive tasks (the answer quotes the prompt) and on free text, outputs compared token for token."""

from __future__ import annotations

import statistics
import time
from argparse import Namespace

CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    averages = []
    total = sum(values[:window])
    averages.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages
'''

PASSAGE = (
    "The lighthouse at Vell stood on a rock a mile from the harbour. Every evening the keeper climbed "
    "the one hundred and twelve steps, trimmed the wick, wound the clockwork that turned the lens, and "
    "wrote the weather in a leather book. In forty years the light went dark only once, on the night "
    "of the great storm, when the keeper's daughter rowed out through the waves to relight it."
)

TASKS = {  # name -> (kind, user message)
    "code edit": (
        "repetitive",
        "Repeat this Python function exactly, but rename the variable `total` to "
        f"`running_sum`. Output only the code.\n\n```python\n{CODE}```",
    ),
    "quote summary": (
        "repetitive",
        f"Summarize this passage in two sentences, quoting its key sentence word for word.\n\n{PASSAGE}",
    ),
    "free text": ("free", "Write a long story about a lighthouse keeper who finds a message in a bottle."),
}


def time_decode(engine, prompt: list[int], tokens: int) -> tuple[list[int], float, float]:
    """(generated token ids, decode tok/s after the first token by the wall clock, and by this process's
    CPU time), batch 1, greedy, stopping at EOS. CPU time moves less with other processes' load."""
    from mlxpaged.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    ids, first = [], None
    for delta in engine.stream(prompt, params):
        if delta.token_id is not None:
            ids.append(delta.token_id)
        if first is None:
            first = (time.perf_counter(), time.process_time())
    wall, cpu = time.perf_counter() - first[0], time.process_time() - first[1]
    decoded = len(ids) - 1
    return ids, decoded / wall if decoded > 0 < wall else 0.0, decoded / cpu if decoded > 0 < cpu else 0.0


def bench_task(plain, spec, prompt: list[int], tokens: int, runs: int) -> dict:
    """Alternating runs (plain, speculative) after one warm-up each: median tok/s, per-run ratios,
    outputs equal in every run, the speculative engine's acceptance rate over these runs."""
    stats = spec.core.speculator.stats
    before = (stats.draft_tokens, stats.accepted_tokens)
    rates, cpu_ratios, equal, length = {"plain": [], "spec": []}, [], True, 0
    for run in range(runs + 1):
        ids_plain, rate_plain, cpu_plain = time_decode(plain, prompt, tokens)
        ids_spec, rate_spec, cpu_spec = time_decode(spec, prompt, tokens)
        equal &= ids_plain == ids_spec
        length = len(ids_plain)
        if run:  # the first run warms up allocations and compiled graphs
            rates["plain"].append(rate_plain)
            rates["spec"].append(rate_spec)
            cpu_ratios.append(cpu_spec / cpu_plain)
    drafted, kept = stats.draft_tokens - before[0], stats.accepted_tokens - before[1]
    # Each decode step yields one token plus its kept drafts: the load-independent part of the speed-up.
    steps = (length - 1, length - 1 - round(kept / (runs + 1)))
    return {
        "steps": steps,
        "cpu_ratio": statistics.median(cpu_ratios),
        "plain": statistics.median(rates["plain"]),
        "spec": statistics.median(rates["spec"]),
        "ratios": [s / p for s, p in zip(rates["spec"], rates["plain"], strict=True)],
        "equal": equal,
        "tokens": length,
        "acceptance": kept / drafted if drafted else None,
        "drafted": drafted,
    }


def bench_spec(args: Namespace) -> int:
    """Prompt lookup on the tasks above; `--drafter oracle` / `mtp` / `dflash` / `eagle3` or `--draft-model NAME`:
    spec_drafters.py."""
    if getattr(args, "drafter", None) in ("oracle", "mtp", "dflash", "eagle3") or getattr(args, "draft_model", None):
        from mlxpaged_app.bench.spec_drafters import bench_drafters

        return bench_drafters(args)
    from mlxpaged.config import CacheConfig, SchedulerConfig
    from mlxpaged.engine.engine import Engine
    from mlxpaged.loading.loader import chat_prompt, load_model
    from mlxpaged.platform.blas import blas_status

    loaded = load_model(args.model)
    cache = CacheConfig(cache_tokens=8192, enable_prefix_cache=False)  # every run computes its prompt
    plain = Engine(loaded, cache, SchedulerConfig())
    spec = Engine(loaded, cache, SchedulerConfig(speculative="ngram"))
    print(
        f"model {loaded.name} ({loaded.dtype}), BLAS {blas_status().name}, batch 1, greedy, up to {args.tokens} "
        f"new tokens, {args.runs} alternating runs each (+1 warm-up), k <= "
        f"{spec.scheduler_config.num_speculative_tokens}"
    )
    print(
        f"  {'task':<14} {'kind':<10} {'tokens':>6} {'plain tok/s':>11} {'ngram tok/s':>11} {'ratio':>6} "
        f"{'accepted':>8} {'decode steps':>12} {'cpu ratio':>9}  outputs"
    )
    try:
        for name, (kind, message) in TASKS.items():
            prompt = chat_prompt(loaded.tokenizer, [{"role": "user", "content": message}])
            r = bench_task(plain, spec, prompt, args.tokens, args.runs)
            accepted = f"{100 * r['acceptance']:.0f}%" if r["acceptance"] is not None else "-"
            # the median of back-to-back pairs: both runs of a pair share the machine's load
            print(
                f"  {name:<14} {kind:<10} {r['tokens']:>6} {r['plain']:>11.1f} {r['spec']:>11.1f} "
                f"{statistics.median(r['ratios']):>5.2f}x {accepted:>8} {'{} -> {}'.format(*r['steps']):>12} "
                f"{r['cpu_ratio']:>8.2f}x  "
                f"{'equal' if r['equal'] else 'DIFFER'}"
                f"  (per-run ratios {', '.join(f'{x:.2f}' for x in r['ratios'])}; {r['drafted']} drafted)"
            )
    finally:
        spec.close()
        plain.close()
    return 0
