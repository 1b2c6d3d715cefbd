"""`mlxpaged bench prefix`: time to first token behind a long system prompt, cold vs cached prefix."""

from __future__ import annotations

import statistics
import time
from argparse import Namespace

PREFIX_QUESTIONS = [
    "Summarize the document in one sentence.",
    "What is the main topic?",
    "List two facts from the document.",
]
WARM_UP_QUESTION = "Which town is named first?"  # a prompt of the timed ones' shape, never timed


def long_document(tokenizer, target_tokens: int) -> str:
    sentences = [
        f"Section {i}: the harbour town of Vell{i % 7} keeps {i * 3} boats, a lighthouse, and a "
        f"market that opens at {6 + i % 5} in the morning."
        for i in range(400)
    ]
    text = ""
    for sentence in sentences:
        if len(tokenizer.encode(text + sentence)) > target_tokens:
            break
        text += sentence + " "
    return text


def time_to_first_token(engine, messages: list[dict]) -> tuple[float, int]:
    from mlxpaged.sampling_params import SamplingParams

    start = time.perf_counter()
    for _ in engine.stream(engine.chat_tokens(messages), SamplingParams(temperature=0.0, max_tokens=8)):
        first = time.perf_counter() - start
        break
    return first, len(engine.chat_tokens(messages))


def bench_prefix(args: Namespace) -> int:
    """Time to first token with a ~2,000-token system prompt: cold vs cached prefix."""
    from mlxpaged.engine.engine import Engine

    engine = Engine.from_pretrained(args.model)
    system = long_document(engine.tokenizer, 2000)

    def ask(question: str) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    cold, warm = [], []
    for prompt in (ask(WARM_UP_QUESTION), ask(WARM_UP_QUESTION + " Be brief.")):
        time_to_first_token(engine, prompt)  # untimed: the cold and cached paths' first calls compile
    for question in PREFIX_QUESTIONS:
        engine.pool.reset_prefix_cache()
        cold.append(time_to_first_token(engine, ask(question)))
        warm.append(time_to_first_token(engine, ask(question + " Be brief.")))
        print(f"  prompt {cold[-1][1]} tokens: cold {cold[-1][0]:6.2f} s   cached prefix {warm[-1][0]:6.3f} s")
    engine.close()
    c, w = statistics.median(t for t, _ in cold), statistics.median(t for t, _ in warm)
    print(f"median time to first token: cold {c:.2f} s, cached {w:.3f} s, {c / w:.0f}x faster")
    return 0
