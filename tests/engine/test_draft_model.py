"""Speculative decoding with a draft model (runner/model_drafter.py): the target's own tokens, whatever the draft
proposes, alone and batched, seeded, with a prefix hit, after preemption, with n > 1 forks; every block free after.

Two drafts: another tiny random model of the same vocabulary (it proposes mostly wrong tokens: drafts are rolled back
nearly every step) and the target itself (every greedy draft is kept: the draft pages must then hold exactly what
the target's do, through catch-up, prefix hits and preemption, or drafts would start to fail).
"""

from __future__ import annotations

import dataclasses

from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.engine.core import EngineCore
from mlxpaged.runner.model_drafter import ModelDrafter
from mlxpaged.runner.model_runner import Runner
from mlxpaged.runner.routing import route_paged_attention
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_core import make_core, run_to_completion, token_ids
from tests.engine.test_engine import tokenizer  # noqa: F401  (the fixture, shared)
from tests.tiny_models import random_tokens, tiny_llama, tiny_qwen3

import pytest

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=30, ignore_eos=True)
PROMPTS = {"a": random_tokens(11, seed=1), "b": random_tokens(30, seed=2), "c": random_tokens(5, seed=3)}


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


@pytest.fixture(scope="module", params=["other", "itself"])
def draft(request, target):
    return tiny_qwen3(num_layers=1, seed=9) if request.param == "other" else target


def pages(model, num_blocks: int) -> PagedKVCache:
    args = model.args
    return PagedKVCache(
        num_layers=args.num_hidden_layers,
        num_blocks=num_blocks,
        block_size=8,
        num_kv_heads=args.num_key_value_heads,
        head_dim=args.head_dim,
    )


def draft_core(target, draft, tokenizer, num_blocks: int = 64, k: int = 4, **scheduling) -> EngineCore:
    """A core whose drafts come from `draft`, on pools of its own with the target's block count."""
    route_paged_attention()
    drafter = ModelDrafter(Runner(draft, pages(draft, num_blocks)), "draft", vocab_size=256)
    return EngineCore.create(
        target,
        tokenizer,
        pages(target, num_blocks),
        CacheConfig(block_size=8),
        SchedulerConfig(speculative="draft", num_speculative_tokens=k, **scheduling),
        max_model_len=512,
        model_drafter=drafter,
    )


def run(core, prompts: dict, params) -> dict:
    events = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, params, events[rid].append)
    run_to_completion(core)
    assert core.scheduler.kv_manager.stats().num_owned == 0  # rollbacks and finishes left no block owned
    return {rid: token_ids(e) for rid, e in events.items()}


def plain(target, tokenizer, prompts: dict, params, **scheduling) -> dict:
    return run(make_core(target, tokenizer, max_num_seqs=4, **scheduling), prompts, params)


def count_draft_tokens(core) -> list[int]:
    """A counter of the tokens the draft model is fed from now on (prefill chunks, catch-up, draft passes)."""
    runner, fed = core.speculator.model.runner, [0]
    step, decode = runner.step, runner.decode_ahead

    def counted_step(inputs):
        fed[0] += sum(len(x.token_ids) for x in inputs)
        return step(inputs)

    def counted_decode(inputs, tokens):
        fed[0] += len(inputs)
        return decode(inputs, tokens)

    runner.step, runner.decode_ahead = counted_step, counted_decode
    return fed


def acceptance(core) -> tuple[int, int]:
    stats = core.speculator.stats
    return stats.accepted_tokens, stats.draft_tokens


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_drafts_give_the_plain_tokens(target, draft, tokenizer, params):
    core = draft_core(target, draft, tokenizer, max_num_seqs=4)
    assert run(core, PROMPTS, params) == plain(target, tokenizer, PROMPTS, params)
    kept, drafted = acceptance(core)
    assert drafted > 0
    if draft is target and params is GREEDY:
        assert kept == drafted  # the target drafting for itself: its pages and the draft's agree at every step


def test_alone_equals_plain(target, draft, tokenizer):
    prompts = {"b": PROMPTS["b"]}
    core = draft_core(target, draft, tokenizer, k=3)
    assert run(core, prompts, GREEDY) == plain(target, tokenizer, prompts, GREEDY)


def test_a_prefix_hit_skips_both_prefills_and_drafts_from_the_cached_pages(target, tokenizer):
    """The second request hits the first's prompt blocks: its draft pages come from the cache too (the target
    drafting for itself keeps every draft only if they hold the prompt's K/V)."""
    core = draft_core(target, target, tokenizer)
    prompt = random_tokens(40, seed=5)
    first = run(core, {"first": prompt}, GREEDY)
    before = core.scheduler.kv_manager.stats().hit_tokens
    fed = count_draft_tokens(core)
    second = run(core, {"second": prompt}, GREEDY)
    assert core.scheduler.kv_manager.stats().hit_tokens - before >= 32  # four full blocks of the prompt
    assert fed[0] <= 8 + GREEDY.max_tokens + 8, fed  # the prompt's last partial block, about a token per reply token
    assert second["second"] == first["first"] == plain(target, tokenizer, {"p": prompt}, GREEDY)["p"]
    kept, drafted = acceptance(core)
    assert kept == drafted > 0


def test_preempted_sequences_resume_with_the_plain_tokens(target, draft, tokenizer):
    """A pool too small for all three: sequences are preempted and recomputed, the draft's pages with them."""
    core = draft_core(target, draft, tokenizer, num_blocks=14, max_num_seqs=3)
    params = dataclasses.replace(GREEDY, max_tokens=40)
    assert run(core, PROMPTS, params) == plain(target, tokenizer, PROMPTS, params)
    assert core.stats.preemptions > 0
    if draft is target:
        kept, drafted = acceptance(core)
        assert kept == drafted > 0


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_n_sequences_fork_the_draft_pages_too(target, tokenizer, params):
    """The forks' copy-on-write copies are made in the draft's pools too: the target drafting for itself keeps every
    greedy draft of every sequence."""
    params = dataclasses.replace(params, n=3)
    prompts = {"a": PROMPTS["b"]}
    core = draft_core(target, target, tokenizer)
    events = {"a": []}
    core.add_request("a", prompts["a"], params, events["a"].append)
    run_to_completion(core)
    reference = make_core(target, tokenizer, max_num_seqs=4)
    expected = []
    reference.add_request("a", prompts["a"], params, expected.append)
    run_to_completion(reference)

    def by_sequence(evs) -> dict:
        out: dict = {}
        for e in evs:
            if e.token_id is not None:
                out.setdefault(e.index, []).append(e.token_id)
        return out

    assert by_sequence(events["a"]) == by_sequence(expected)
    assert core.scheduler.kv_manager.stats().num_owned == 0
    kept, drafted = acceptance(core)
    assert drafted > 0 and (kept == drafted or params.temperature > 0)


def test_rows_that_cannot_draft_decode_plainly_beside_drafting_ones(target, draft, tokenizer):
    """A logits processor may keep state: that row is verified one token at a time; the others draft, a penalized
    one too."""
    params = {
        "a": dataclasses.replace(GREEDY, logits_processors=[lambda tokens, row: row * 1.5]),
        "b": dataclasses.replace(GREEDY, repetition_penalty=1.3),
        "c": GREEDY,
    }
    core = draft_core(target, draft, tokenizer, max_num_seqs=4)
    events = {rid: [] for rid in PROMPTS}
    for rid, prompt in PROMPTS.items():
        core.add_request(rid, prompt, params[rid], events[rid].append)
    run_to_completion(core)
    reference = make_core(target, tokenizer, max_num_seqs=4)
    expected = {rid: [] for rid in PROMPTS}
    for rid, prompt in PROMPTS.items():
        reference.add_request(rid, prompt, params[rid], expected[rid].append)
    run_to_completion(reference)
    assert {r: token_ids(e) for r, e in events.items()} == {r: token_ids(e) for r, e in expected.items()}
    assert acceptance(core)[1] > 0
