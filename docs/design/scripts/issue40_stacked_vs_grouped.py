"""Issue 40: 16 concurrent requests over N LoRA adapters, decode-heavy (8-12-token prompts, 96 new tokens), the
adapted layers applying them group by group or stacked (layers.STACK_MIN_GROUPS), alternating in one process.

    MALLOC_MMAP_THRESHOLD_=2000000000 MALLOC_TRIM_THRESHOLD_=4000000000 python docs/design/scripts/issue40_stacked_vs_grouped.py 4
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged import Engine, SamplingParams
from mlxpaged.adapters import layers
from mlxpaged_app.bench.batch import random_prompts
from mlxpaged_app.bench.lora import write_adapter

count = int(sys.argv[1]) if len(sys.argv) > 1 else 4
tmp = Path(tempfile.mkdtemp())
probe = Engine.from_pretrained(max_num_seqs=16)
paths = {f"l{i}": write_adapter(probe.model, tmp / f"l{i}", i) for i in range(count)}
probe.close()
engine = Engine.from_pretrained(adapters=paths, max_num_seqs=16)
prompts = random_prompts(16, 8, 12, engine.loaded.config["vocab_size"])
params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
names = [f"l{i % count}" for i in range(16)]


def run() -> float:
    engine.pool.reset_prefix_cache()
    start = time.perf_counter()
    done = engine.generate(prompts, params, adapter=names)
    return sum(len(c.token_ids) for c in done) / (time.perf_counter() - start)


results = {"stacked": [], "grouped": []}
run()  # warm-up
for _ in range(4):
    for mode in results:
        layers.STACK_MIN_GROUPS = 3 if mode == "stacked" else 10**9
        results[mode].append(run())
for mode, values in results.items():
    print(mode, [round(v, 1) for v in values], "median", round(statistics.median(values), 1), "tok/s")
