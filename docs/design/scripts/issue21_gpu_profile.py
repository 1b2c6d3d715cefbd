"""Where the engine thread's time goes in a batch-1 decode on a GPU: one warm-up, then cProfile over one
256-token greedy reply (each engine step, on the engine's thread), the top functions by own time.
At 135M a GPU step is host-bound, so this is the list to shorten. Run alone, in one device call:

    python docs/design/scripts/issue21_gpu_profile.py MODEL_DIR [TOKENS] [BATCH]

BATCH > 1 profiles that many requests at once, prompts of 256-511 tokens (as `bench gpu --parts batch`).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import mlxpaged  # noqa: F401  (OpenBLAS before mlx where it applies)
from mlxpaged.engine.engine import Engine
from mlxpaged.platform import backend
from mlxpaged.sampling_params import SamplingParams


def main(model_dir: str, tokens: int, batch: int) -> None:
    engine = Engine.from_pretrained(model_dir, max_num_seqs=max(batch, 8), cache_tokens=max(32768, batch * 1024))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    if batch == 1:
        prompts = [[(13 * i) % 5000 + 10 for i in range(46)]]
    else:
        prompts = [[(13 * i + 7 * r) % 5000 + 10 for i in range(256 + (97 * r) % 256)] for r in range(batch)]
    engine.generate(prompts, params)  # warm-up: kernels for these shapes compile here
    start = time.perf_counter()
    engine.generate(prompts, params)
    plain = time.perf_counter() - start
    made = tokens * batch
    print(
        f"backend {backend.describe()}: {batch} requests x {tokens} tokens in {plain:.3f} s unprofiled "
        f"({made / plain:.1f} tok/s aggregate)"
    )
    # The engine thread runs the steps, and cProfile sees only the thread that enables it: profile each step there.
    profile = cProfile.Profile()
    core, step = engine.core, engine.core.step

    def profiled_step() -> None:
        profile.enable()
        try:
            step()
        finally:
            profile.disable()

    core.step = profiled_step
    engine.generate(prompts, params)
    engine.close()
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 256, int(sys.argv[3]) if len(sys.argv) > 3 else 1)
