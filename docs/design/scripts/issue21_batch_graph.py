"""Issue 21: what a many-request decode step queues, engine vs mlx-lm's BatchGenerator, and how many steps the
`bench gpu` batch takes. Two counts, no timing (safe on a busy machine):

1. The bench's batch (`--batch` prompts of 256-512 random tokens, 128 new tokens each) through the engine on a
   2-layer tiny llama under simulate("cuda"): steps by kind and look-ahead passes adopted.
2. The graph each side hands to `mx.async_eval` per steady decode step at `--batch` rows (24-layer tiny llama):
   primitive nodes by name, from `mx.export_to_dot`. On the CPU the fused ops (RoPE, RMSNorm, SDPA) show
   decomposed on both sides; the difference between the sides is what to read.

    python docs/design/scripts/issue21_batch_graph.py [--batch 64]
"""

from __future__ import annotations

import argparse
import collections
import io
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.loading.loader import load_model
from mlxpaged.platform import backend
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_engine import tiny_engine
from tests.tiny_models import random_tokens, tiny_llama

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

NEW_TOKENS = 128


def bench_steps(tokenizer, count: int) -> str:
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 256) for _ in range(rng.randint(256, 512))] for _ in range(count)]
    kinds: collections.Counter = collections.Counter()
    adopted = 0
    with backend.simulate("cuda"):
        engine = tiny_engine(
            tiny_llama(num_layers=2), tokenizer, max_num_seqs=count, cache_tokens=count * 672, max_model_len=1024
        )
        core = engine.core
        schedule, execute = core.scheduler.schedule, core.runner.execute

        def counted_schedule():
            out = schedule()
            prefill = any(len(c.token_ids) > 1 for c in out.chunks)
            decode = any(len(c.token_ids) == 1 for c in out.chunks)
            kinds[" + ".join(k for k, on in (("prefill", prefill), ("decode", decode)) if on) or "empty"] += 1
            return out

        def counted_execute(chunks, rows, planner):
            nonlocal adopted
            adopted += core.runner._ahead is not None and core.runner._ahead.covers(chunks)
            return execute(chunks, rows, planner)

        core.scheduler.schedule, core.runner.execute = counted_schedule, counted_execute
        engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
        engine.close()
    return f"{count} requests: {sum(kinds.values())} steps {dict(kinds)}, {adopted} adopted look-aheads"


def graph_nodes(tokenizer, batch: int, tokens: int = 24) -> dict[str, collections.Counter]:
    """Nodes of each side's steady decode graph (its most frequent size), by primitive."""
    model = tiny_llama(num_layers=24)
    prompts = [random_tokens(20 + i % 16, seed=i) for i in range(batch)]
    graphs: list[collections.Counter] = []
    queue_graph = mx.async_eval

    def counting(*arrays):
        dot = io.StringIO()
        mx.export_to_dot(dot, *arrays)
        labels = re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue())
        graphs.append(collections.Counter(label.split(" ")[0] for label in labels))
        return queue_graph(*arrays)

    def steady() -> collections.Counter:
        """The pass size seen most often: a steady decode step (not one that starts a run: it gathers pages)."""
        passes = [g for g in graphs if sum(g.values()) > 100]
        graphs.clear()
        most = collections.Counter(sum(g.values()) for g in passes).most_common(1)[0][0]
        return next(g for g in passes if sum(g.values()) == most)

    mx.async_eval = counting
    try:
        with backend.simulate("cuda"):
            engine = tiny_engine(
                model, tokenizer, max_batch_tokens=max(256, batch), max_num_seqs=max(8, batch), cache_tokens=batch * 96
            )
            graphs.clear()
            engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
            engine.close()
        ours = steady()
        generator = BatchGenerator(model, stop_tokens=[], max_tokens=tokens, completion_batch_size=batch)
        generator.insert(prompts, [tokens] * batch)
        while generator.next_generated():
            pass
        generator.close()
        return {"engine (simulated cuda)": ours, "mlx-lm BatchGenerator": steady()}
    finally:
        mx.async_eval = queue_graph


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    tokenizer = load_model().tokenizer
    print(bench_steps(tokenizer, args.batch))
    for name, nodes in graph_nodes(tokenizer, args.batch).items():
        print(f"{name}, batch {args.batch}: {sum(nodes.values())} nodes per decode step")
        print("   ", ", ".join(f"{k} {v}" for k, v in nodes.most_common(24)))


if __name__ == "__main__":
    main()
