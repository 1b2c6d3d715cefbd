"""`mlxpaged bench`: measured, never asserted. Prints medians and ratios."""

from __future__ import annotations

import json
import statistics
import time
from argparse import Namespace

from mlxpaged.blas import blas_status
from mlxpaged.model import baseline_stream, chat_prompt

DECODE_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def time_mlx_lm(loaded, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(time to first token, decode tok/s) of mlx-lm's stream_generate, greedy, EOS ignored."""
    start = time.perf_counter()
    first = None
    for n, last in enumerate(baseline_stream(loaded, prompt, max_tokens=tokens, ignore_eos=True), 1):
        if first is None:
            first = time.perf_counter()
    return first - start, (n - 1) / (time.perf_counter() - first)


def time_engine(engine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(time to first token, decode tok/s) of the paged engine, batch 1, greedy, EOS ignored."""
    from mlxpaged.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    first, n = None, 0
    for delta in engine.stream(prompt, params):
        n += delta.token_id is not None
        if first is None:
            first = time.perf_counter()
    return first - start, (n - 1) / (time.perf_counter() - first)


def bench_decode(args: Namespace) -> int:
    """Batch-1 decode tok/s: mlx-lm stream_generate vs the paged engine, alternating runs."""
    from mlxpaged.engine import Engine

    engine = Engine.from_pretrained(args.model, enable_prefix_cache=False)
    loaded = engine.loaded
    prompt = chat_prompt(loaded.tokenizer, [{"role": "user", "content": DECODE_PROMPT}])
    print(f"model {loaded.name} ({loaded.dtype}), BLAS {blas_status().name}, "
          f"prompt {len(prompt)} tokens, {args.tokens} new tokens, {args.runs} runs each (+1 warm-up)")
    ref, ours = [], []
    for run in range(args.runs + 1):
        r, o = time_mlx_lm(loaded, prompt, args.tokens), time_engine(engine, prompt, args.tokens)
        if run:  # the first run warms up allocations
            ref.append(r[1])
            ours.append(o[1])
            print(f"  run {run}: mlx-lm {r[1]:6.1f} tok/s   mlxpaged {o[1]:6.1f} tok/s")
    engine.close()
    mr, mo = statistics.median(ref), statistics.median(ours)
    print(f"median decode: mlx-lm {mr:.1f} tok/s, mlxpaged {mo:.1f} tok/s, ratio {mo / mr:.2f}x")
    paired = [o / r for o, r in zip(ours, ref)]  # back-to-back runs share the machine's load
    print(f"paired runs: mlxpaged faster in {sum(p > 1 for p in paired)} of {len(paired)}, "
          f"median per-run ratio {statistics.median(paired):.2f}x")
    return 0


def kv_shape(model_name: str | None) -> tuple[int, int, int, int]:
    """(layers, kv heads, head dim, dtype bytes) of a model, from its config only (float32 KV)."""
    from mlxpaged.memory import ModelFacts
    from mlxpaged.model import default_dtype
    from mlxpaged.models import provision, resolve

    config = json.loads((provision(resolve(model_name), default_dtype()) / "config.json").read_text())
    kv = ModelFacts.from_config(config, weight_bytes=0, kv_dtype_bytes=4).kv
    return kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype_bytes


def mlx_lm_batch_cache_bytes(prompt_lens: list[int], new_tokens: int, heads: int, head_dim: int) -> int:
    """Bytes one layer of mlx-lm's BatchKVCache holds for these requests (left-padded batch)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    longest = max(prompt_lens)
    cache = BatchKVCache(left_padding=[longest - n for n in prompt_lens])
    batch = len(prompt_lens)
    cache.update_and_fetch(mx.zeros((batch, heads, longest, head_dim)), mx.zeros((batch, heads, longest, head_dim)))
    step = mx.zeros((batch, heads, 1, head_dim))
    for _ in range(new_tokens):
        cache.update_and_fetch(step, step)
    return cache.nbytes


def paged_blocks(prompts: list[list[int]], new_tokens: int, block_size: int, prefix_cache: bool) -> int:
    """Blocks owned once every request has its prompt and `new_tokens` generated tokens."""
    from mlxpaged.blocks import BlockPool

    pool = BlockPool(num_blocks=100_000, block_size=block_size, enable_prefix_cache=prefix_cache)
    for rid, prompt in enumerate(prompts):
        pool.allocate(rid, prompt)
        pool.mark_computed(rid, len(prompt))  # prefilled: full blocks become shareable
        for t in range(new_tokens):
            pool.append_slot(rid, 1 + t)
    return pool.stats().num_owned


def bench_memory(args: Namespace) -> int:
    """KV bytes reserved for 16 ragged requests, paged vs mlx-lm's batch cache; prefix sharing."""
    import random

    layers, heads, head_dim, dtype_bytes = kv_shape(args.model)
    per_token = 2 * layers * heads * head_dim * dtype_bytes
    rng = random.Random(0)
    lens = [rng.randint(32, 1024) for _ in range(16)]
    new, block = 128, 16
    needed = sum(n + new for n in lens) * per_token
    paged = paged_blocks([[rng.randrange(50, 40000) for _ in range(n)] for n in lens], new, block, True)
    paged_bytes = paged * block * per_token
    batch_bytes = mlx_lm_batch_cache_bytes(lens, new, heads, head_dim) * layers
    print(f"KV per token {per_token} B ({layers} layers x {heads} kv heads x {head_dim} x {dtype_bytes} B x K,V)")
    print(f"16 ragged requests, prompts {min(lens)}-{max(lens)} tokens, {new} new tokens each:")
    print(f"  tokens need            {mb(needed):>10}")
    print(f"  paged (block {block})      {mb(paged_bytes):>10}  {paged_bytes / needed:.3f}x of need")
    print(f"  mlx-lm BatchKVCache    {mb(batch_bytes):>10}  {batch_bytes / needed:.3f}x of need "
          f"(measured nbytes of one layer x {layers})")
    prefix = [rng.randrange(50, 40000) for _ in range(1024)]
    shared = [prefix + [rng.randrange(50, 40000) for _ in range(rng.randint(20, 200))] for _ in range(8)]
    cold = paged_blocks(shared, new, block, False) * block * per_token
    warm = paged_blocks(shared, new, block, True) * block * per_token
    print("8 requests sharing a 1,024-token prefix (+20-200 own tokens, 128 new):")
    print(f"  without prefix cache   {mb(cold):>10}")
    print(f"  with prefix cache      {mb(warm):>10}  saves {mb(cold - warm)} ({1 - warm / cold:.0%})")
    return 0


def mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def random_prompts(count: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def run_mlx_lm_batch(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """(wall seconds, tokens generated) of mlx-lm's BatchGenerator, greedy, no stop tokens."""
    from mlx_lm.generate import BatchGenerator

    start = time.perf_counter()
    gen = BatchGenerator(model, stop_tokens=[], max_tokens=new_tokens)
    gen.insert(prompts, [new_tokens] * len(prompts))
    generated = 0
    while responses := gen.next_generated():
        generated += len(responses)
    gen.close()
    return time.perf_counter() - start, generated


def run_engine_batch(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    from mlxpaged.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    return time.perf_counter() - start, sum(len(c.token_ids) for c in done)


def bench_batch(args: Namespace) -> int:
    """16 concurrent requests (prompts 256-512 tokens, 128 new each): mlxpaged vs mlx-lm batch_generate."""
    import mlx.core as mx

    from mlxpaged.engine import Engine

    engine = Engine.from_pretrained(args.model, enable_prefix_cache=False, max_num_seqs=16)
    prompts = random_prompts(16, 256, 512, engine.loaded.config["vocab_size"])
    print(f"model {engine.loaded.name}, 16 requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, {args.tokens} new tokens each, BLAS {blas_status().name}")
    rows = []
    for name, run in (("mlx-lm batch", lambda: run_mlx_lm_batch(engine.model, prompts, args.tokens)),
                      ("mlxpaged", lambda: run_engine_batch(engine, prompts, args.tokens))):
        mx.reset_peak_memory()
        wall, generated = run()
        rows.append((name, wall, generated / wall, mx.get_peak_memory()))
        print(f"  {name:<13} {wall:6.1f} s  {generated / wall:6.1f} tok/s aggregate  peak {mb(rows[-1][3])}")
    engine.close()
    print(f"ratio (mlxpaged / mlx-lm): throughput {rows[1][2] / rows[0][2]:.2f}x, "
          f"wall {rows[0][1] / rows[1][1]:.2f}x faster, peak memory {rows[1][3] / rows[0][3]:.2f}x")
    return 0


PREFIX_QUESTIONS = ["Summarize the document in one sentence.", "What is the main topic?",
                    "List two facts from the document."]


def long_document(tokenizer, target_tokens: int) -> str:
    sentences = [f"Section {i}: the harbour town of Vell{i % 7} keeps {i * 3} boats, a lighthouse, and a "
                 f"market that opens at {6 + i % 5} in the morning." for i in range(400)]
    text = ""
    for sentence in sentences:
        if len(tokenizer.encode(text + sentence)) > target_tokens:
            break
        text += sentence + " "
    return text


def time_to_first_token(engine, messages: list[dict]) -> tuple[float, int]:
    from mlxpaged.sampling import SamplingParams

    start = time.perf_counter()
    for delta in engine.stream(engine.chat_tokens(messages), SamplingParams(temperature=0.0, max_tokens=8)):
        first = time.perf_counter() - start
        break
    return first, len(engine.chat_tokens(messages))


def bench_prefix(args: Namespace) -> int:
    """Time to first token with a ~2,000-token system prompt: cold vs cached prefix."""
    from mlxpaged.engine import Engine

    engine = Engine.from_pretrained(args.model)
    system = long_document(engine.tokenizer, 2000)
    ask = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
    cold, warm = [], []
    for question in PREFIX_QUESTIONS:
        engine.pool.reset_prefix_cache()
        cold.append(time_to_first_token(engine, ask(question)))
        warm.append(time_to_first_token(engine, ask(question + " Be brief.")))
        print(f"  prompt {cold[-1][1]} tokens: cold {cold[-1][0]:6.2f} s   cached prefix {warm[-1][0]:6.3f} s")
    engine.close()
    c, w = statistics.median(t for t, _ in cold), statistics.median(t for t, _ in warm)
    print(f"median time to first token: cold {c:.2f} s, cached {w:.3f} s, {c / w:.0f}x faster")
    return 0


def bench_kernel(args: Namespace) -> int:
    """Paged attention (reference path on CPU; kernel too on a Mac) vs contiguous SDPA, contexts 512-8192."""
    from mlxpaged.kernels.bench import print_kernel_bench, run_kernel_bench

    print_kernel_bench(run_kernel_bench([512, 1024, 2048, 4096, 8192], [1, 4, 16]))
    return 0


def bench_server(args: Namespace) -> int:
    """mlxpaged serve vs mlx_lm.server: throughput and time to first token at 1, 8 and 32 clients."""
    from mlxpaged_app.bench.server import run_server_bench

    return run_server_bench(args)


BENCHES = {"decode": bench_decode, "memory": bench_memory, "batch": bench_batch, "prefix": bench_prefix,
           "kernel": bench_kernel, "server": bench_server}


def run_bench(args: Namespace) -> int:
    return BENCHES[args.what](args)
