"""`mlxpaged bench constraints`: what grammar masks cost per decode step, at batch 1 and 16.

Decode step time is the median gap between a request's consecutive tokens (its first token excluded).
Grammars: `json` (a JSON array of integers too long to finish, so every step is masked) and `lazy` (free text
until a tool-call marker, the tool_choice "auto" case). Constrained rows are sampled synchronously (no look-ahead),
so a batch with one constrained row loses pipelining: the `16, 1 json` row shows that cost apart from the masks.
"""

from __future__ import annotations

import itertools
import statistics
import time
from argparse import Namespace

from mlxpaged.platform.blas import blas_status

PROMPT = "List the first hundred prime numbers as a JSON array."
ENDLESS_JSON = {"type": "array", "items": {"type": "integer"}, "minItems": 10000}
CALL = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "arguments": {"type": "object"}},
    "required": ["name", "arguments"],
}


def grammars(engine) -> dict:
    from mlxpaged.constraints import json_schema_grammar, tagged_json_grammar

    compile_ = engine.grammar_compiler.compile
    return {
        "json": compile_(json_schema_grammar(ENDLESS_JSON)),
        "lazy": compile_(tagged_json_grammar("<tool_call>", "</tool_call>", CALL, lazy=True)),
    }


def step_gaps(engine, prompt: list[int], constraints: list, tokens: int) -> list[float]:
    """Submit one request per entry of `constraints` (None: unconstrained) at once; every token-to-token gap."""
    import queue

    from mlxpaged.sampling_params import SamplingParams

    eos = sorted(engine.tokenizer.eos_token_ids)
    sinks = []
    for constraint in constraints:  # EOS is biased away, not ignored: a grammar must stay free to end
        params = SamplingParams(
            temperature=0.0,
            max_tokens=tokens,
            constraint=constraint,
            logit_bias=dict.fromkeys(eos, -100.0),
            ignore_eos=constraint is None,
        )
        sink: queue.Queue = queue.Queue()
        engine.submit(prompt, params, lambda e, s=sink: s.put((time.perf_counter(), e)))
        sinks.append(sink)
    gaps = []
    for sink in sinks:
        stamps = []
        while True:
            stamp, event = sink.get()
            if isinstance(event, BaseException):
                raise event
            stamps.append(stamp)
            if event.finish_reason is not None:
                break
        gaps += [b - a for a, b in itertools.pairwise(stamps)]
    return gaps


def sampler_only(engine, constraints: list, repeats: int = 20) -> float:
    """Median seconds of one sample_batch call on random logits, isolating the mask from the model."""
    from mlxpaged.engine.request import Request
    from mlxpaged.runner.sampling import make_state, sample_batch
    from mlxpaged.sampling_params import SamplingParams

    import mlx.core as mx

    vocab = engine.grammar_compiler.vocab_size
    states = [
        make_state(SamplingParams(temperature=0.0, constraint=c), Request(f"r{i}", [1], 8))
        for i, c in enumerate(constraints)
    ]
    logits = mx.random.normal((len(states), vocab))
    mx.eval(logits)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sample_batch(logits, states)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_constraints(args: Namespace) -> int:
    """Decode step medians with and without grammar masks, batch 1 and 16 (runs alternate)."""
    from mlxpaged.engine.engine import Engine
    from mlxpaged.loading.loader import chat_prompt

    engine = Engine.from_pretrained(args.model, enable_prefix_cache=False, max_num_seqs=16)
    prompt = chat_prompt(engine.tokenizer, [{"role": "user", "content": PROMPT}])
    start = time.perf_counter()
    compiled = grammars(engine)
    print(
        f"model {engine.loaded.name}, BLAS {blas_status().name}, prompt {len(prompt)} tokens, {args.tokens} new "
        f"tokens, {args.runs} runs (+1 warm-up); tokenizer + 2 grammars compiled in {time.perf_counter() - start:.2f} s"
    )
    cases = {
        "1, none": [None],
        "1, json": [compiled["json"]],
        "1, lazy": [compiled["lazy"]],
        "16, none": [None] * 16,
        "16, json": [compiled["json"]] * 16,
        "16, lazy": [compiled["lazy"]] * 16,
        "16, 1 json": [compiled["json"]] + [None] * 15,
    }
    gaps: dict[str, list[float]] = {name: [] for name in cases}
    for run in range(args.runs + 1):
        for name, constraints in cases.items():
            got = step_gaps(engine, prompt, constraints, args.tokens)
            if run:  # the first run warms up allocations and compiled passes
                gaps[name] += got
    print("batch, grammar   median step   vs unconstrained   sampler only (random logits)")
    for name, values in gaps.items():
        base = statistics.median(gaps[name.split(",")[0] + ", none"])
        step = statistics.median(values)
        sampler = sampler_only(engine, cases[name])
        print(f"  {name:<12} {step * 1000:9.1f} ms   {step / base:6.3f}x   {sampler * 1000:8.2f} ms")
    engine.close()
    return 0
