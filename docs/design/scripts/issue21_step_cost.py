"""Issue 21 on a GPU: what a decode step's time is made of, and what shortens it.

Parts (each prints ms per decode step, median, pipelined as mlx-lm's generate_step: the next step queued before
the current one is read, and the host's time to build and `mx.async_eval` a step with the GPU idle):

- `plain`: mlx-lm's own model at batch 1, 16 and 64 (400-token contexts): "eager" is mlx-lm's KVCache step;
  "fused" the same after loading/fused_projections.py; "compiled" the model through `mx.compile` over
  fixed-capacity K/V buffers (written with a dynamic `slice_update`, attended under a mask over the capacity),
  the shape of a compiled engine pass.
- `engine`: `bench gpu`'s batch rows (16 and 64 requests of 256-512 random tokens, 128 new each, aggregate
  tok/s) and an 8k prompt's cold and cached (+ 8 tokens) time to first token, through the engine with each
  `Tuning` variant in VARIANTS.
- `sdpa_shapes`: one layer's attention of an 8-token chunk over an ~8k cached prefix (the cached follow-up of
  `bench gpu --parts ttft`), mask "causal": every call a new key length (as follow-ups are), the same length
  repeated, new lengths through plain matmuls and softmax, and new lengths padded to one bucketed length under a
  mask.

    python docs/design/scripts/issue21_step_cost.py MODEL_DIR [plain] [compiled] [engine] [sdpa_shapes]
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
# The engine's Tuning variants the `engine` part runs. Session 13's GPU runs (H200) tried two more, both dropped:
# the compiled paged pass at every batch size, launched after the read (868 / 1110 tok/s at 16 / 64 requests
# against 1155 / 2716 as it was), and short prefill chunks attending pages gathered to a bucketed key length under a
# mask (cuDNN plans reused; 8k cached + 8 tokens 30.5 ms against 24.4 ms at exact lengths, 16 requests 1235 against
# 1683 tok/s: a plan per chunk length and bucket, and a masked plan is slower).
VARIANTS: dict[str, dict] = {"projections apart": {"fused_projections": False}, "as is": {}}


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


def plain(model, with_compiled: bool) -> None:
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
        print(
            f"plain mlx-lm, batch {batch:2d}: eager {e_step:6.2f} ms/step (build + async_eval {e_enc:5.2f})", flush=True
        )
        if not with_compiled:
            continue

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
            f"plain mlx-lm, batch {batch:2d}: compiled {c_step:6.2f} ms/step (build + async_eval {c_enc:5.2f}); "
            f"{e_step / c_step:.2f}x eager",
            flush=True,
        )


def engine_rows(model_dir: str) -> None:
    from mlxpaged.engine.engine import Engine
    from mlxpaged_app.bench.batch import median_tok_s, random_prompts, run_engine_batch
    from mlxpaged_app.bench.prefill import measure_size

    default = backend.TUNINGS["cuda"]
    for name, changes in VARIANTS.items():
        backend.TUNINGS["cuda"] = dataclasses.replace(default, **changes)
        try:
            with Engine.from_pretrained(model_dir, max_num_seqs=64, cache_tokens=64 * 700) as engine:
                for count in (16, 64):
                    prompts = random_prompts(count, 256, 512, engine.loaded.config["vocab_size"])
                    t0 = time.perf_counter()
                    tok_s = median_tok_s(lambda prompts=prompts: run_engine_batch(engine, prompts, 128), 2)
                    print(
                        f"engine {name:<28} {count:2d} requests: {tok_s:7.1f} tok/s aggregate "
                        f"({time.perf_counter() - t0:.1f} s with the warm-up)",
                        flush=True,
                    )
                row = measure_size(engine, 8192, 1)
                print(
                    f"engine {name:<28} 8k prompt: cold {row.cold_s * 1e3:6.1f} ms, cached + 8 "
                    f"{row.cached_s * 1e3:5.1f} ms ({100 * row.cached_s / row.cold_s:.1f}%)",
                    flush=True,
                )
        finally:
            backend.TUNINGS["cuda"] = default


def sdpa_shapes(model) -> None:
    args = model.args
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    dim = args.hidden_size // heads
    scale = dim**-0.5
    q = mx.random.normal((1, heads, 8, dim)).astype(mx.bfloat16)
    big = mx.random.normal((1, kv_heads, 9000, dim)).astype(mx.bfloat16)
    mx.eval(q, big)

    def composed(q, k, v):  # the chunk's 8 queries through plain ops; causal within the last 8 keys
        groups = heads // kv_heads
        qg = q.reshape(1, kv_heads, groups * 8, dim) * scale
        scores = (qg @ k.swapaxes(-1, -2)).astype(mx.float32).reshape(1, kv_heads, groups, 8, -1)
        n = k.shape[2]
        keep = mx.arange(n)[None, :] <= (mx.arange(8) + n - 8)[:, None]
        weights = mx.softmax(mx.where(keep, scores, -mx.inf), axis=-1).astype(v.dtype)
        return (weights.reshape(1, kv_heads, groups * 8, n) @ v).reshape(1, heads, 8, dim)

    def fast(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")

    def bucketed(q, k, v):  # the keys padded to 8704 (a bucket), the padding masked (tried in the engine, dropped)
        n = k.shape[2]
        padded = mx.concatenate([k, mx.zeros((1, kv_heads, 8704 - n, dim), k.dtype)], axis=2)
        keep = mx.arange(8704)[None, :] <= (mx.arange(8) + n - 8)[:, None]
        return mx.fast.scaled_dot_product_attention(q, padded, padded, scale=scale, mask=keep)

    for name, fn, growing in (
        ("fused, new lengths", fast, True),
        ("fused, same length", fast, False),
        ("composed, new lengths", composed, True),
        ("bucketed, new lengths", bucketed, True),
    ):
        times = []
        for i in range(12):
            n = 8192 + (8 * (i + 1) if growing else 0)
            k = mx.contiguous(big[:, :, :n])
            mx.eval(k)
            mx.synchronize()
            t0 = time.perf_counter()
            mx.eval(fn(q, k, k))
            times.append((time.perf_counter() - t0) * 1e3)
        print(
            f"sdpa 8 queries over ~8k keys, {name:<22}: median {statistics.median(times[2:]):6.2f} ms, "
            f"first {times[0]:6.2f} ms",
            flush=True,
        )


def main() -> None:
    path, parts = sys.argv[1], sys.argv[2:] or ["plain", "engine"]
    print(f"{path}: device {mx.default_device()}, backend {backend.describe()}", flush=True)
    if "plain" in parts or "compiled" in parts or "sdpa_shapes" in parts:
        model, _ = load(path)
        if "sdpa_shapes" in parts:
            sdpa_shapes(model)
        if "plain" in parts or "compiled" in parts:
            plain(model, "compiled" in parts)
            if "plain" in parts:
                from mlxpaged.loading.fused_projections import fuse_projections

                print(f"fused {fuse_projections(model)} groups:", flush=True)
                plain(model, False)
        del model
    if "engine" in parts:
        engine_rows(path)


if __name__ == "__main__":
    main()
