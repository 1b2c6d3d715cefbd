"""Issue 21 on a GPU: how long `mx.async_eval` of one decode step takes on the host (building the GPU's command
stream) against the step's whole time, for plain mlx-lm at batch 1 and 16; and the same step with each layer's
MLP compiled (mx.compile fuses its elementwise ops: fewer kernels to launch). Tells whether a step is bound by
launching kernels (then fewer ops or compiled parts pay) or by the GPU's work.

    python docs/design/scripts/issue21_encode_cost.py MODEL_DIR
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def step_times(model, batch: int, steps: int = 20) -> tuple[float, float]:
    """Median ms of async_eval alone (GPU idle first) and of the whole step, over `steps` decode steps."""
    cache = make_prompt_cache(model)
    prompt = mx.array([[(7 * i + r) % 1000 + 10 for i in range(400)] for r in range(batch)])
    mx.eval(model(prompt, cache=cache))
    token = mx.zeros((batch, 1), dtype=mx.int32)
    encode, whole = [], []
    for _ in range(steps + 3):
        mx.synchronize()
        t0 = time.perf_counter()
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1, :], axis=-1, keepdims=True).astype(mx.int32)
        t1 = time.perf_counter()
        mx.async_eval(token)
        t2 = time.perf_counter()
        mx.eval(token)
        t3 = time.perf_counter()
        encode.append((t2 - t1) * 1e3)
        whole.append((t3 - t0) * 1e3)
    return statistics.median(encode[3:]), statistics.median(whole[3:])


def main(path: str) -> None:
    model, _ = load(path)
    print(f"{sys.argv[1]}: {len(model.layers)} layers, device {mx.default_device()}")
    for batch in (1, 16):
        encode, whole = step_times(model, batch)
        print(f"batch {batch:2d} eager:        async_eval {encode:6.2f} ms of a {whole:6.2f} ms step (GPU idle first)")
    for layer in model.layers:
        layer.mlp = _compiled(layer.mlp)
    for batch in (1, 16):
        encode, whole = step_times(model, batch)
        print(f"batch {batch:2d} compiled MLP: async_eval {encode:6.2f} ms of a {whole:6.2f} ms step (GPU idle first)")


def _compiled(mlp):
    fn = mx.compile(mlp.__call__)

    class Compiled:
        def __call__(self, x):
            return fn(x)

    return Compiled()


if __name__ == "__main__":
    main(sys.argv[1])
