"""`mlxpaged bench spec --drafter oracle`, `--drafter mtp`, `--draft-model NAME` and `--drafter dflash|eagle3
--draft-model PATH`: speculation at 1, 4 and 16 concurrent requests beside plain decoding, and for a draft model
mlx-lm's own `draft_model` path at batch 1 on the same pair.

The oracle drafts the plain run's own greedy continuation (recorded first) at no cost: every draft is kept, so it
measures the machinery (verify passes, bookkeeping, batching) apart from any drafter's quality. A draft model, or the
model's own MTP layers (a checkpoint that ships them), drafts as it would in use; its acceptance is printed. Every
request is greedy with a fixed length (EOS ignored); tok/s is all generated tokens over the wall time of the whole
batch (prefill included), runs alternate plain / speculative and the ratio quoted is the median of back-to-back pairs.
Outputs are compared token for token.
"""

from __future__ import annotations

import functools
import statistics
import time
from argparse import Namespace
from collections.abc import Sequence

TOPICS = (
    "a lighthouse keeper who finds a message in a bottle",
    "a cartographer mapping a city that changes every night",
    "two rival bakers in a mountain village",
    "a robot learning to paint",
    "the last train across a frozen lake",
    "a beekeeper and a very old queen bee",
    "a librarian who can hear books whisper",
    "a ship's cat on a long voyage",
    "a clockmaker repairing time itself",
    "a gardener growing a forest on a rooftop",
    "a detective solving a case of missing socks",
    "an astronomer who discovers a new colour",
    "a child who befriends a storm cloud",
    "a postman delivering letters to the past",
    "a chess game that lasts a hundred years",
    "a violinist lost in a desert",
)

DEFAULT_CONCURRENCY = (1, 4, 16)
DEFAULT_DRAFT_TOKENS = 4


class RecordedDrafter:
    """Drafts the recorded continuation of whichever recorded sequence `tokens` begins (the oracle)."""

    def __init__(self, sequences: Sequence[Sequence[int]]):
        self.sequences = [list(s) for s in sequences]

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        n = len(tokens)
        for full in self.sequences:
            if len(full) > n and full[:n] == list(tokens):
                return full[n : n + k]
        return []


def prompts_for(tokenizer, count: int) -> list[list[int]]:
    from mlxpaged.loading.loader import chat_prompt

    return [
        chat_prompt(tokenizer, [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}])
        for i in range(count)
    ]


def timed_batch(engine, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """(each prompt's generated ids, tok/s over the batch's wall time)."""
    from mlxpaged.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    outputs = [c.token_ids for c in done]
    return outputs, sum(map(len, outputs)) / seconds


def bench_drafters(args: Namespace) -> int:
    from mlxpaged.config import CacheConfig, SchedulerConfig
    from mlxpaged.engine.engine import Engine
    from mlxpaged.loading.draft_model import DrafterCheckpoint
    from mlxpaged.loading.loader import load_model, locate_model
    from mlxpaged.platform.blas import blas_status

    levels = tuple(args.concurrency or DEFAULT_CONCURRENCY)
    k = args.num_draft_tokens or DEFAULT_DRAFT_TOKENS
    loaded = load_model(args.model)
    checkpoint = args.drafter in ("dflash", "eagle3")  # --draft-model is a drafter checkpoint, not an mlx-lm model
    if checkpoint and not args.draft_model:
        raise SystemExit(f"bench spec --drafter {args.drafter} needs --draft-model (a drafter published for --model)")
    draft = load_model(args.draft_model) if args.draft_model and not checkpoint else None
    # Every run computes its prompt (no prefix hits), pools for the largest batch.
    cache = CacheConfig(cache_tokens=max(8192, max(levels) * (args.tokens + 128)), enable_prefix_cache=False)
    seqs = max(levels)
    plain = Engine(loaded, cache, SchedulerConfig(max_num_seqs=seqs))
    if args.drafter == "mtp" and draft is None:
        spec = Engine(loaded, cache, SchedulerConfig(max_num_seqs=seqs, speculative="mtp", num_speculative_tokens=k))
        what = "the model's MTP layers"
    elif checkpoint:
        source = DrafterCheckpoint(locate_model(args.draft_model)[1], args.draft_model)
        scheduling = SchedulerConfig(max_num_seqs=seqs, speculative=args.drafter, num_speculative_tokens=k)
        spec = Engine(loaded, cache, scheduling, draft=source)
        what = f"{'DFlash drafter' if args.drafter == 'dflash' else 'EAGLE-3 head'} {args.draft_model}"
    elif draft is None:
        spec = Engine(loaded, cache, SchedulerConfig(max_num_seqs=seqs, speculative="ngram", num_speculative_tokens=k))
        what = "oracle (the plain run's own next tokens, drafted at no cost)"
    else:
        spec = Engine(
            loaded,
            cache,
            SchedulerConfig(max_num_seqs=seqs, speculative="draft", num_speculative_tokens=k),
            draft=draft,
        )
        what = f"draft model {draft.name} ({draft.dtype})"
    print(
        f"model {loaded.name} ({loaded.dtype}), BLAS {blas_status().name}, drafter: {what}, k <= {k}, greedy, "
        f"{args.tokens} tokens per request, {args.runs} alternating runs (+1 warm-up) per level"
    )
    print(
        f"  {'concurrent':>10} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} {'accepted':>8}  outputs  "
        "(per-run ratios)"
    )
    try:
        for level in levels:
            prompts = prompts_for(loaded.tokenizer, level)
            oracle = args.drafter == "oracle" and draft is None
            r = _level(plain, spec, prompts, args.tokens, args.runs, oracle=oracle)
            accepted = f"{100 * r['acceptance']:.0f}%" if r["acceptance"] is not None else "-"
            print(
                f"  {level:>10} {r['plain']:>11.1f} {r['spec']:>10.1f} {statistics.median(r['ratios']):>5.2f}x "
                f"{accepted:>8}  {'equal' if r['equal'] else 'DIFFER'}  "
                f"({', '.join(f'{x:.2f}' for x in r['ratios'])})"
            )
        if draft is not None:
            _batch1_line(plain, spec, loaded, draft, prompts_for(loaded.tokenizer, 1)[0], args.tokens, args.runs, k)
    finally:
        spec.close()
        plain.close()
    return 0


def _level(plain, spec, prompts: list[list[int]], tokens: int, runs: int, oracle: bool) -> dict:
    stats = spec.core.speculator.stats
    rates: dict[str, list[float]] = {"plain": [], "spec": []}
    equal, before = True, (stats.draft_tokens, stats.accepted_tokens)
    for run in range(runs + 1):  # the first run of each side warms up
        outputs, rate_plain = timed_batch(plain, prompts, tokens)
        if oracle:
            recorded = [p + o for p, o in zip(prompts, outputs, strict=True)]
            spec.core.speculator.new_drafter = functools.partial(RecordedDrafter, recorded)
        spec_outputs, rate_spec = timed_batch(spec, prompts, tokens)
        equal &= spec_outputs == outputs
        if run:
            rates["plain"].append(rate_plain)
            rates["spec"].append(rate_spec)
    drafted, kept = stats.draft_tokens - before[0], stats.accepted_tokens - before[1]
    return {
        "plain": statistics.median(rates["plain"]),
        "spec": statistics.median(rates["spec"]),
        "ratios": [s / p for s, p in zip(rates["spec"], rates["plain"], strict=True)],
        "equal": equal,
        "acceptance": kept / drafted if drafted else None,
    }


def _batch1_line(plain, spec, loaded, draft, prompt: list[int], tokens: int, runs: int, k: int) -> None:
    """Batch 1 as mlx-lm measures it (decode tok/s after the first token, stopping at EOS): mlxpaged plain and with
    the draft, and mlx-lm's stream_generate plain and with its `draft_model` on the same pair (its speculative path
    runs one sequence), the four alternating after a warm-up each."""
    from mlxpaged_app.bench.spec import time_decode

    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    def mlx_lm(with_draft: bool) -> tuple[list[int], float]:
        extra = {"draft_model": draft.model, "num_draft_tokens": k} if with_draft else {}
        ids, last = [], None
        for last in stream_generate(
            loaded.model, loaded.tokenizer, mx.array(prompt), max_tokens=tokens, sampler=make_sampler(0.0), **extra
        ):
            ids.append(last.token)
        return ids, last.generation_tps if last is not None else 0.0

    sides = {
        "mlxpaged": lambda: time_decode(plain, prompt, tokens)[:2],
        "mlxpaged draft": lambda: time_decode(spec, prompt, tokens)[:2],
        "mlx-lm": lambda: mlx_lm(False),
        "mlx-lm draft": lambda: mlx_lm(True),
    }
    rates: dict[str, list[float]] = {name: [] for name in sides}
    outputs: dict[str, list[int]] = {}
    equal = True
    for run in range(runs + 1):
        for name, side in sides.items():
            ids, rate = side()
            equal &= outputs.setdefault("first", ids) == ids
            if run:
                rates[name].append(rate)
    ours = [a / b for a, b in zip(rates["mlxpaged draft"], rates["mlx-lm draft"], strict=True)]
    print(
        "  batch 1, decode tok/s after the first token (stops at EOS): "
        + ", ".join(f"{name} {statistics.median(r):.1f}" for name, r in rates.items())
        + f"; mlxpaged draft / mlx-lm draft {statistics.median(ours):.2f}x ({', '.join(f'{x:.2f}' for x in ours)})"
        + f"  {'equal' if equal else 'DIFFER'}"
    )
