"""Issue 24: where a quantized batch-1 decode step's time goes, part by part, in one process: engines on the
embedded model, runs alternated, each run's process CPU time and wall time per decoded token (CPU time, so other
sessions' load counts less than in wall time; wall time, which `bench kv` reports). The settings switch one part
at a time: the K/V coordinates of 4-bit pages (MLXPAGED_KV_TRANSFORM, read at load), groups fitted by least
squares or mx.quantize's min-max (`group_fit.FITTED_BITS`, set before each engine runs: each compiled decode pass
is traced under it), and the 4-bit attention path at short contexts (`UNPACKED_4BIT_MIN_KEYS`: 0 forces the
unpacked form).

    python docs/design/scripts/issue24_decode_parts.py [RUNS] [TOKENS] [SETTING,SETTING,...]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from mlxpaged.cache import group_fit
from mlxpaged.engine.engine import Engine
from mlxpaged.kernels import quantized_attention
from mlxpaged.sampling_params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
THRESHOLD = quantized_attention.UNPACKED_4BIT_MIN_KEYS
# name: (kv_bits, coordinates on, fitted groups, unpacked 4-bit attention from this many keys)
SETTINGS = {
    "full": (None, True, (4,), THRESHOLD),
    "4-bit plain": (4, False, (), THRESHOLD),
    "4-bit coordinates": (4, True, (), THRESHOLD),
    "4-bit fitted": (4, False, (4,), THRESHOLD),
    "4-bit built": (4, True, (4,), THRESHOLD),
    "4-bit built unpacked": (4, True, (4,), 0),
    "8-bit": (8, True, (4,), THRESHOLD),
}


def ms_per_token(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per decoded token."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    stream = engine.stream(prompt, params)
    next(stream)  # the prefill's token: not a decode step
    cpu, wall, n = time.process_time(), time.perf_counter(), 0
    for delta in stream:
        n += delta.token_id is not None
    return (time.process_time() - cpu) * 1000 / n, (time.perf_counter() - wall) * 1000 / n


def main(argv: list[str]) -> None:
    runs = int(argv[0]) if argv else 3
    tokens = int(argv[1]) if len(argv) > 1 else 96
    names = argv[2].split(",") if len(argv) > 2 else list(SETTINGS)
    engines = {}
    for name in names:
        bits, coordinates, _, _ = SETTINGS[name]
        os.environ["MLXPAGED_KV_TRANSFORM"] = "1" if coordinates else "0"
        engines[name] = Engine.from_pretrained(None, enable_prefix_cache=False, kv_bits=bits)
    first = next(iter(engines.values()))
    prompt = first.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True
    )
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for run in range(runs + 1):  # run 0 warms up: compiles, allocations
        for name, engine in engines.items():
            _, _, group_fit.FITTED_BITS, quantized_attention.UNPACKED_4BIT_MIN_KEYS = SETTINGS[name]
            measured = ms_per_token(engine, prompt, tokens)
            if run:
                got[name].append(measured)
    for name, pairs in got.items():
        cpu = statistics.median(c for c, _ in pairs)
        wall = statistics.median(w for _, w in pairs)
        walls = [round(w, 1) for _, w in pairs]
        print(f"{name:22s} CPU {cpu:6.1f} ms/token, wall {wall:6.1f} ms/token (runs' wall: {walls})")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1:])
