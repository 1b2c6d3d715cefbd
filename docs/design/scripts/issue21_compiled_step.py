"""Issue 21 on a GPU: does compiling a whole many-row decode step pay there?

Two parts, each printing ms per decode step (median, pipelined as mlx-lm's generate_step: the next step queued
before the current one is read) and the host's `mx.async_eval` time of a step (GPU idle first):

- `plain`: mlx-lm's own model at batch 1, 16 and 64 (400-token contexts). "eager" is mlx-lm's KVCache step;
  "compiled" is the same model through `mx.compile` over fixed-capacity K/V buffers (written with a dynamic
  `slice_update`, attended under a mask over the capacity), the shape of a compiled engine pass.
- `engine`: `bench gpu`'s batch rows (16 and 64 requests of 256-512 random tokens, 128 new each, aggregate
  tok/s) through the engine as it is, and with the compiled paged decode pass (runner/decode_pass.py) allowed
  at every batch size (`Tuning.compiled_decode_max_batch` 64, launched after the read: `queue_before_read` off).

    python docs/design/scripts/issue21_compiled_step.py MODEL_DIR [plain] [engine]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.platform import backend

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

CONTEXT, CAPACITY = 400, 640


class StaticCache:
    """One layer's K/V in a buffer of CAPACITY columns, every row at the same position (traced arrays)."""

    def __init__(self, keys: mx.array, values: mx.array, position: mx.array, mask: mx.array):
        self.keys, self.values, self.position, self.mask = keys, values, position, mask

    @property
    def offset(self) -> mx.array:
        return self.position

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        return self.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.position.reshape(1), axes=(2,))
        self.values = mx.slice_update(self.values, values, self.position.reshape(1), axes=(2,))
        return self.keys, self.values


def timed_steps(step, token: mx.array, steps: int = 24) -> tuple[float, float]:
    """(median ms of async_eval with the GPU idle, ms per step pipelined)."""
    encode = []
    for _ in range(6):
        mx.synchronize()
        t0 = time.perf_counter()
        out = step(token)
        mx.async_eval(out)
        encode.append((time.perf_counter() - t0) * 1e3)
        mx.eval(out)
    mx.synchronize()
    t0 = time.perf_counter()
    out = step(token)
    mx.async_eval(out)
    for _ in range(steps):
        nxt = step(out)
        mx.async_eval(nxt)
        out.tolist()
        out = nxt
    out.tolist()
    return statistics.median(encode[2:]), (time.perf_counter() - t0) * 1e3 / (steps + 1)


def plain(model) -> None:
    layers = len(model.layers)
    for batch in (1, 16, 64):
        cache = make_prompt_cache(model)
        prompt = mx.array([[(7 * i + r) % 1000 + 10 for i in range(CONTEXT)] for r in range(batch)])
        mx.eval(model(prompt, cache=cache))
        for c in cache:
            c.step = 1024  # room for every timed step without a reallocation mid-run

        def eager(token, cache=cache):
            logits = model(token.reshape(-1, 1), cache=cache)
            return mx.argmax(logits[:, -1, :], axis=-1).astype(mx.int32)

        e_enc, e_step = timed_steps(eager, mx.zeros((batch,), mx.int32))

        # The same K/V in fixed buffers, written at a traced position.
        keys = [mx.zeros((batch, *c.keys.shape[1:2], CAPACITY, c.keys.shape[3]), c.keys.dtype) for c in cache]
        values = [mx.zeros((batch, *c.values.shape[1:2], CAPACITY, c.values.shape[3]), c.values.dtype) for c in cache]
        for j, c in enumerate(cache):
            keys[j][..., :CONTEXT, :] = c.keys[..., :CONTEXT, :]
            values[j][..., :CONTEXT, :] = c.values[..., :CONTEXT, :]
        mx.eval(keys, values)

        def forward(token, position, *kv):
            mask = (mx.arange(CAPACITY) <= position)[None, None, None, :]
            caches = [StaticCache(kv[j], kv[layers + j], position, mask) for j in range(layers)]
            logits = model(token.reshape(-1, 1), cache=caches)
            token = mx.argmax(logits[:, -1, :], axis=-1).astype(mx.int32)
            return (token, *[c.keys for c in caches], *[c.values for c in caches])

        compiled = mx.compile(forward)
        state = {"kv": keys + values, "position": CONTEXT}

        def compiled_step(token, state=state):
            out = compiled(token, mx.array(state["position"], dtype=mx.int32), *state["kv"])
            state["kv"] = list(out[1:])
            state["position"] = min(state["position"] + 1, CAPACITY - 1)
            return out[0]

        mx.eval(compiled_step(mx.zeros((batch,), mx.int32)))  # trace and compile
        c_enc, c_step = timed_steps(compiled_step, mx.zeros((batch,), mx.int32))
        print(
            f"plain mlx-lm, batch {batch:2d}: eager {e_step:6.2f} ms/step (async_eval {e_enc:5.2f}); "
            f"compiled {c_step:6.2f} ms/step (async_eval {c_enc:5.2f}); {e_step / c_step:.2f}x",
            flush=True,
        )


def engine_rows(model_dir: str) -> None:
    from mlxpaged.engine.engine import Engine
    from mlxpaged_app.bench.batch import median_tok_s, random_prompts, run_engine_batch

    default = backend.TUNINGS["cuda"]
    variants = {
        "as is": default,
        "compiled <= 64": dataclasses.replace(default, compiled_decode_max_batch=64, queue_before_read=False),
    }
    for name, tuning in variants.items():
        backend.TUNINGS["cuda"] = tuning
        try:
            with Engine.from_pretrained(model_dir, max_num_seqs=64, cache_tokens=64 * 700) as engine:
                for count in (16, 64):
                    prompts = random_prompts(count, 256, 512, engine.loaded.config["vocab_size"])
                    t0 = time.perf_counter()
                    tok_s = median_tok_s(lambda prompts=prompts: run_engine_batch(engine, prompts, 128), 2)
                    print(
                        f"engine {name:<15} {count:2d} requests: {tok_s:7.1f} tok/s aggregate "
                        f"({time.perf_counter() - t0:.1f} s with the warm-up)",
                        flush=True,
                    )
        finally:
            backend.TUNINGS["cuda"] = default


def main() -> None:
    path, parts = sys.argv[1], sys.argv[2:] or ["plain", "engine"]
    print(f"{path}: device {mx.default_device()}, backend {backend.describe()}", flush=True)
    if "plain" in parts:
        model, _ = load(path)
        plain(model)
        del model
    if "engine" in parts:
        engine_rows(path)


if __name__ == "__main__":
    main()
