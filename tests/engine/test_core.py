"""EngineCore.step() driven directly, without the engine's thread, against mlx-lm's generate_step."""

from __future__ import annotations

import dataclasses

from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.engine.core import EngineCore
from mlxpaged.outputs import StreamDelta
from mlxpaged.runner.model_runner import Lookahead
from mlxpaged.runner.routing import route_paged_attention
from tests.engine.test_engine import GREEDY, reference_tokens, tokenizer  # noqa: F401  (the fixture, shared)
from tests.tiny_models import random_tokens, tiny_llama

import pytest

PROMPTS = {"a": 5, "b": 19, "c": 40}  # request id -> prompt length


def make_core(model, tokenizer, num_blocks: int = 64, **scheduling) -> EngineCore:
    route_paged_attention()  # as Engine does: mlx-lm's attention reads the paged views
    args = model.args
    kv = PagedKVCache(
        num_layers=args.num_hidden_layers,
        num_blocks=num_blocks,
        block_size=8,
        num_kv_heads=args.num_key_value_heads,
        head_dim=args.head_dim,
    )
    return EngineCore.create(
        model, tokenizer, kv, CacheConfig(block_size=8), SchedulerConfig(**scheduling), max_model_len=512
    )


def run_to_completion(core: EngineCore, max_steps: int = 500) -> int:
    steps = 0
    while core.has_unfinished:
        core.step()
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def token_ids(events: list) -> list[int]:
    assert all(isinstance(e, StreamDelta) for e in events), events
    return [e.token_id for e in events if e.token_id is not None]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.mark.parametrize("max_batch_tokens", [2048, 16])  # one chunk per prompt, or chunked prefill
def test_stepping_the_core_matches_mlx_lm_token_for_token(model, tokenizer, max_batch_tokens):
    core = make_core(model, tokenizer, max_batch_tokens=max_batch_tokens, max_num_seqs=4)
    events = {rid: [] for rid in PROMPTS}
    prompts = {rid: random_tokens(n, seed=n) for rid, n in PROMPTS.items()}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, GREEDY, events[rid].append)
    steps = run_to_completion(core)
    for rid, prompt in prompts.items():
        assert token_ids(events[rid]) == reference_tokens(model, prompt, GREEDY.max_tokens), rid
        assert events[rid][-1].finish_reason == "length"
    assert steps >= GREEDY.max_tokens and core.scheduler.kv_manager.stats().num_owned == 0


def test_a_tight_pool_preempts_and_still_matches(model, tokenizer):
    core = make_core(model, tokenizer, num_blocks=8, max_num_seqs=4)  # 3 x 40 tokens need 15 blocks
    params = dataclasses.replace(GREEDY, max_tokens=24)
    prompts = {rid: random_tokens(16, seed=i) for i, rid in enumerate("xyz")}
    events = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, params, events[rid].append)
    run_to_completion(core)
    assert core.stats.preemptions > 0
    for rid, prompt in prompts.items():
        assert token_ids(events[rid]) == reference_tokens(model, prompt, params.max_tokens), rid


def test_n_sequences_fork_in_the_step_and_each_finishes(model, tokenizer):
    core = make_core(model, tokenizer)
    events: list = []
    core.add_request("r", random_tokens(21, seed=5), dataclasses.replace(GREEDY, n=3, max_tokens=8), events.append)
    run_to_completion(core)
    ends = [e for e in events if e.finish_reason is not None]
    assert sorted(e.index for e in ends) == [0, 1, 2] and {e.completion_tokens for e in ends} == {8}
    by_index = [[e.token_id for e in events if e.index == i and e.token_id is not None] for i in range(3)]
    assert by_index[0] == by_index[1] == by_index[2]  # greedy: the forks continue their parent's prompt


def test_a_sink_that_raises_is_aborted_at_the_next_step_and_others_go_on(model, tokenizer):
    core = make_core(model, tokenizer)
    good: list = []

    def broken(event):
        raise RuntimeError("consumer gone")

    core.add_request("bad", random_tokens(9, seed=1), GREEDY, broken)
    core.add_request("good", random_tokens(12, seed=2), GREEDY, good.append)
    core.step()  # prefill: both sample, the broken sink raises
    assert core.outputs.pending_aborts == ["bad"] and core.scheduler.get("bad") is not None
    core.step()
    assert core.scheduler.get("bad") is None and core.scheduler.get("good") is not None
    run_to_completion(core)
    assert good[-1].finish_reason == "length" and len(token_ids(good)) == GREEDY.max_tokens


def test_the_step_pipelines_steady_decoding_without_a_thread(model, tokenizer, monkeypatch):
    core = make_core(model, tokenizer)
    monkeypatch.setattr(core.runner, "decoder", None)  # compiled batch-1 passes are not pipelined
    adopted = []
    covers = Lookahead.covers
    monkeypatch.setattr(Lookahead, "covers", lambda self, chunks: adopted.append(covers(self, chunks)) or adopted[-1])
    events: list = []
    prompt = random_tokens(7, seed=7)
    core.add_request("p", prompt, GREEDY, events.append)
    run_to_completion(core)
    assert sum(adopted) >= GREEDY.max_tokens - 3
    assert token_ids(events) == reference_tokens(model, prompt, GREEDY.max_tokens)
