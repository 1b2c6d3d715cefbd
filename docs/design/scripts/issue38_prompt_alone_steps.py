"""How long each step of a ~6,500-token prompt alone takes on the embedded model (the step budget's defaults):
what a client that hangs up waits for at most.

    MALLOC_MMAP_THRESHOLD_=2000000000 MALLOC_TRIM_THRESHOLD_=4000000000 .venv/bin/python \
        docs/design/scripts/issue38_prompt_alone_steps.py

Run 0 is the engine's first prompt (nothing measured yet), run 1 the next.
"""

from __future__ import annotations

import time

from mlxpaged import Engine, SamplingParams
from mlxpaged.engine.core import EngineCore

LINE = "The quick brown fox jumps over the lazy dog while the committee reviews chapter {i} of the report. "


def main() -> None:
    steps: list[float] = []
    step = EngineCore.step

    def timed(self) -> None:
        started = time.perf_counter()
        step(self)
        steps.append(time.perf_counter() - started)

    EngineCore.step = timed  # type: ignore[method-assign]
    with Engine.from_pretrained() as engine:
        for run in range(2):
            ids = engine.tokenizer.encode(f"Run {run} {time.time()}: " + "".join(LINE.format(i=i) for i in range(300)))
            steps.clear()
            started = time.perf_counter()
            engine.generate([ids], SamplingParams(max_tokens=1))
            took = time.perf_counter() - started
            print(f"run {run}: {len(ids)} tokens in {took:.1f} s; steps (s): " + " ".join(f"{s:.2f}" for s in steps))


if __name__ == "__main__":
    main()
