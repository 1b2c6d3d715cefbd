"""Issue 24: what fitting 4-bit groups by least squares (cache/group_fit.py) costs a batch-1 decode step, against
`mx.quantize`'s min-max groups and full precision, in one process: three engines on the embedded model, runs
alternated, each run's process CPU time per decoded token (CPU time, so other sessions' load counts less than in
wall time). The fitting is switched per engine by `group_fit.FITTED_BITS`, set before each engine runs (the
compiled decode pass is traced under it).

    python docs/design/scripts/issue24_fit_cost.py [RUNS] [TOKENS]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from mlxpaged.cache import group_fit
from mlxpaged.engine.engine import Engine
from mlxpaged.sampling_params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SETTINGS = {"full": (None, (4,)), "4-bit min-max": (4, ()), "4-bit fitted": (4, (4,))}


def cpu_ms_per_token(engine: Engine, prompt: list[int], tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    stream = engine.stream(prompt, params)
    next(stream)  # the prefill's token: not a decode step
    start, n = time.process_time(), 0
    for delta in stream:
        n += delta.token_id is not None
    return (time.process_time() - start) * 1000 / n


def main(argv: list[str]) -> None:
    runs = int(argv[0]) if argv else 5
    tokens = int(argv[1]) if len(argv) > 1 else 128
    engines = {
        name: Engine.from_pretrained(None, enable_prefix_cache=False, kv_bits=bits)
        for name, (bits, _) in SETTINGS.items()
    }
    prompt = engines["full"].tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True
    )
    got: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for run in range(runs + 1):  # run 0 warms up: compiles, allocations
        for name, engine in engines.items():
            group_fit.FITTED_BITS = SETTINGS[name][1]
            ms = cpu_ms_per_token(engine, prompt, tokens)
            if run:
                got[name].append(ms)
        if run:
            print(f"run {run}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in got.items()) + " ms CPU/token", flush=True)
    full = got["full"]
    for name in list(SETTINGS)[1:]:
        ratios = [f / x for f, x in zip(full, got[name], strict=True)]
        print(
            f"{name}: median {statistics.median(got[name]):.1f} ms vs full {statistics.median(full):.1f}; "
            f"median paired speed ratio {statistics.median(ratios):.2f}x"
        )
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1:])
