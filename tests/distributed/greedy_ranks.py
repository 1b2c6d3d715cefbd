"""Run over several ranks (tests/distributed/launch.py sets them up as mlx.launch does) or alone: greedy
completions of the prompts in argv[2] (JSON), alone then batched, then the first again (a prefix-cache hit); rank 0
prints them as one JSON line. argv[4]: the engine's settings (JSON). test_distributed_greedy.py compares 1 and N
processes (1 process in the test's own, through `completions`)."""

import json
import sys

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.sampling_params import SamplingParams


def completions(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """What the test compares, as JSON types: the engine's greedy tokens in each scenario, and its pools and plan."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    alone = [engine.generate(p, params)[0] for p in prompts]
    batched = engine.generate(prompts, params)
    again = engine.generate(prompts[0], params)[0]  # the prompt's full blocks are prefix-cache hits now
    # n = 2 forks after the first token: the fork's copy-on-write block copy goes to the followers too
    forked = engine.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=2))
    result = {
        "alone": [c.token_ids for c in alone],
        "batched": [c.token_ids for c in batched],
        "again": again.token_ids,
        "again_cached": again.cached_tokens,
        "forked": [c.token_ids for c in forked],
        "pool_shape": engine.kv.pools[0].shape,
        "pools": len(engine.kv.pools),
        "parallel": None if engine.ranks is None else engine.ranks.parallel,
        "num_blocks": engine.plan.num_blocks,
        "preemptions": engine.stats()["preemptions"],
    }
    return json.loads(json.dumps(result))


def main(argv: list[str]) -> None:
    from mlxpaged.distributed.start import start_engine

    model_dir, prompts, max_tokens, settings = argv[0], json.loads(argv[1]), int(argv[2]), json.loads(argv[3])
    engine = start_engine(model_dir, **settings)
    if engine is not None:
        with engine:
            result = completions(engine, prompts, max_tokens)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
