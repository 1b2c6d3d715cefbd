"""Speculative decoding combined with the engine's other features: n > 1 forks (drafting on a one-token last
prefill chunk), a serial model (one sequence per pass), partial-block reuse of a speculated block, look-ahead
pipelining of replies with nothing to draft, and pools of several geometries (tokens stay mlx-lm's)."""

from __future__ import annotations

import dataclasses

from tests.engine.test_core import run_to_completion
from tests.engine.test_engine import tokenizer  # noqa: F401  (the fixture, shared)
from tests.engine.test_speculative import PROMPTS, SEEDED, oracle, run
from tests.tiny_models import tiny_llama

import pytest


def replies(events) -> list[list[int]]:
    return [[e.token_id for e in events if e.index == i and e.token_id is not None] for i in range(2)]


def test_n_sequences_whose_last_prompt_chunk_is_one_token_fork_with_drafts(tokenizer, monkeypatch):
    """A repeated prompt hits the prefix cache (full blocks + the partial last block) up to its last
    token, so its last prefill chunk is one token: the speculator then drafts on it. The n = 2 forks
    sample their first token from that chunk's logits and must get the plain run's tokens."""
    model = tiny_llama()
    params = dataclasses.replace(SEEDED, n=2, max_tokens=12)
    prompt = PROMPTS["b"]
    plain, _ = run(model, tokenizer, {"r": prompt}, params)
    oracle(monkeypatch, [prompt + reply for reply in replies(plain["r"])], wrong_every=10**6)
    from tests.engine.test_core import make_core

    core = make_core(model, tokenizer, max_num_seqs=4, speculative="ngram")
    warm, events = [], []
    core.add_request("warm", prompt, dataclasses.replace(SEEDED, max_tokens=1), warm.append)
    run_to_completion(core)
    core.add_request("r", prompt, params, events.append)
    run_to_completion(core)
    assert core.speculator.stats.draft_tokens > 0
    assert replies(events) == replies(plain["r"])
    assert core.scheduler.kv_manager.stats().num_owned == 0


def test_a_serial_model_verifies_drafts_one_sequence_per_pass(tokenizer, monkeypatch):
    """Runner(serial=True) runs each chunk alone, drafting chunks too (num_logits > 1 per pass): the
    tokens are plain batched decoding's."""
    from mlxpaged.cache.kv_cache import PagedKVCache
    from mlxpaged.config import CacheConfig, SchedulerConfig
    from mlxpaged.engine.core import EngineCore
    from mlxpaged.runner.routing import route_paged_attention
    from tests.engine.test_core import token_ids
    from tests.engine.test_speculative import GREEDY, full_sequences

    model = tiny_llama()
    plain, _ = run(model, tokenizer, PROMPTS, GREEDY)
    oracle(monkeypatch, full_sequences(PROMPTS, plain))
    route_paged_attention()
    args = model.args
    kv = PagedKVCache(
        num_layers=args.num_hidden_layers,
        num_blocks=64,
        block_size=8,
        num_kv_heads=args.num_key_value_heads,
        head_dim=args.head_dim,
    )
    core = EngineCore.create(
        model,
        tokenizer,
        kv,
        CacheConfig(block_size=8),
        SchedulerConfig(max_num_seqs=4, speculative="ngram"),
        max_model_len=512,
        serial=True,
    )
    events = {rid: [] for rid in PROMPTS}
    for rid, prompt in PROMPTS.items():
        core.add_request(rid, prompt, GREEDY, events[rid].append)
    run_to_completion(core)
    assert 0 < core.speculator.stats.accepted_tokens < core.speculator.stats.draft_tokens
    assert {rid: token_ids(e) for rid, e in events.items()} == {rid: token_ids(e) for rid, e in plain.items()}
    assert core.scheduler.kv_manager.stats().num_owned == 0


def test_a_partial_block_written_by_speculation_is_reused_with_the_kept_tokens_only(tokenizer, monkeypatch):
    """A speculating request's last, partly computed block (rejected drafts were written past its kept
    tokens) is cached as partial when it ends; a prompt extending the reply mid-block reuses it."""
    from tests.engine.test_core import make_core, token_ids
    from tests.engine.test_speculative import GREEDY, full_sequences

    model = tiny_llama()
    plain, _ = run(model, tokenizer, PROMPTS, GREEDY)
    oracle(monkeypatch, full_sequences(PROMPTS, plain), wrong_every=5)
    core = make_core(model, tokenizer, max_num_seqs=4, speculative="ngram")
    first, follow_up = [], []
    core.add_request("r", PROMPTS["b"], GREEDY, first.append)  # 30 + 40 tokens: 69 computed, block 8 partial
    run_to_completion(core)
    assert core.speculator.stats.accepted_tokens < core.speculator.stats.draft_tokens  # some rolled back
    extended = PROMPTS["b"] + token_ids(first)[:39]  # 69 tokens: 8 full blocks + 4 of the partial one
    core.add_request("s", extended, dataclasses.replace(GREEDY, max_tokens=8), follow_up.append)
    run_to_completion(core)
    fresh, _ = run(model, tokenizer, {"s": extended}, dataclasses.replace(GREEDY, max_tokens=8))
    assert follow_up[-1].cached_tokens == 68
    assert token_ids(follow_up) == token_ids(fresh["s"])


def count_pipelined_steps(model, tokenizer, monkeypatch, **scheduling) -> int:
    """Steps of two greedy replies (batch 2: eager, pipelined) whose next decode pass was queued ahead."""
    from mlxpaged.runner.model_runner import Runner
    from tests.engine.test_core import make_core
    from tests.engine.test_speculative import GREEDY

    built = []
    real = Runner._look_ahead
    monkeypatch.setattr(Runner, "_look_ahead", lambda self, *a: built.append(real(self, *a)) or built[-1])
    core = make_core(model, tokenizer, max_num_seqs=4, **scheduling)
    for rid in ("a", "b"):
        core.add_request(rid, PROMPTS[rid], GREEDY, lambda event: None)
    run_to_completion(core)
    monkeypatch.setattr(Runner, "_look_ahead", real)
    return sum(ahead is not None for ahead in built)


def test_a_reply_with_nothing_to_draft_pipelines_as_without_speculation(tokenizer, monkeypatch):
    from mlxpaged.runner.ngram_drafter import NgramDrafter

    model = tiny_llama()
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, tokens, k: [])  # free text: no n-gram repeats
    plain = count_pipelined_steps(model, tokenizer, monkeypatch)
    spec = count_pipelined_steps(model, tokenizer, monkeypatch, speculative="ngram")
    # Drafting pauses after two empty lookups and retries after 2, 4, 8, ... steps (drafting.py): only
    # the retry steps are not pipelined, a few in a reply (before the pause: none were, 0 of 38).
    assert plain > 30 and spec >= 0.75 * plain, (plain, spec)


@pytest.mark.parametrize("module", ["deepseek_v32", "longcat_flash"])
def test_drafts_on_multi_geometry_cache_lists_keep_mlx_lms_greedy_tokens(module, tokenizer, monkeypatch):
    """Speculation on pools of several geometries (DSA's K-is-V indexer in a CacheList; two MLA caches per
    layer): batched drafting passes (rows of different starts and lengths) verify to mlx-lm's tokens."""
    from mlxpaged.sampling_params import SamplingParams
    from tests.archs.harness import _vocab, build, prompts, reference
    from tests.archs.scenarios import BLOCK_SIZE, compare
    from tests.engine.test_engine import assert_pool_empty, tiny_engine

    model = build(module)
    cases = [reference(model, p) for p in prompts(_vocab(model))]
    oracle(monkeypatch, [c.prompt + c.tokens for c in cases], wrong_every=2)
    params = SamplingParams(temperature=0.0, max_tokens=min(len(c.tokens) for c in cases), ignore_eos=True)
    with tiny_engine(model, tokenizer, cache_tokens=512, block_size=BLOCK_SIZE, speculative="ngram") as engine:
        got = engine.generate([c.prompt for c in cases], params)
        stats = engine.stats()
        assert_pool_empty(engine)
    assert 0 < stats["spec_accepted_tokens_total"] < stats["spec_draft_tokens_total"]
    for completion, case in zip(got, cases, strict=True):
        assert compare(list(completion.token_ids), case) is None
