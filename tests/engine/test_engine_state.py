"""A hybrid model with state layers (tiny Qwen 3.5: gated-delta linear attention + full attention) in the
engine, token for token against mlx-lm's generate_step: alone, batched, chunked, preempted, n = 2, aborted,
and a chat's second turn resuming from the first turn's state checkpoint. Pool and slots end empty."""

from __future__ import annotations

import dataclasses
import time

from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.engine.core import EngineCore
from mlxpaged.loading.probe import probe_layout
from mlxpaged.runner.routing import route_paged_attention
from tests.engine.test_core import run_to_completion, token_ids
from tests.engine.test_engine import GREEDY, assert_pool_empty, reference_tokens, tiny_engine
from tests.tiny_models import random_tokens, tiny_qwen3_5

import mlx.core as mx
import pytest

LONG = dataclasses.replace(GREEDY, max_tokens=24)


@pytest.fixture(scope="module")
def tokenizer(default_loaded):
    return default_loaded.tokenizer


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_5()


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    with tiny_engine(model, tokenizer) as eng:
        assert eng.scheduler.state is not None and eng.kv_manager.enable_prefix_cache
        yield eng
        assert_empty(eng)


def make_core(model, tokenizer, model_drafter=None, num_blocks: int = 64, **scheduling) -> EngineCore:
    """An EngineCore stepped by the test itself (no engine thread): 4 state slots, `num_blocks` blocks of 8;
    `scheduling`: more SchedulerConfig fields, `model_drafter`: a draft model's (test_speculative_state.py)."""
    route_paged_attention()  # as Engine does
    layout = probe_layout(model)
    kv = PagedKVCache.for_layout(layout, num_blocks, 8, mx.float32)
    return EngineCore.create(
        model,
        tokenizer,
        kv,
        CacheConfig(block_size=8),
        SchedulerConfig(**{"max_num_seqs": 4, **scheduling}),
        max_model_len=512,
        layout=layout,
        num_checkpoints=12,
        **({"model_drafter": model_drafter} if model_drafter is not None else {}),
    )


def assert_empty(engine) -> None:
    """No block and no state slot held once every request is over."""
    assert_pool_empty(engine)
    deadline = time.monotonic() + 2.0
    while engine.stats()["state_slots_used"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats()["state_slots_used"] == 0


@pytest.mark.parametrize("length", [1, 7, 8, 30])
def test_alone_matches_mlx_lm(engine, length):
    prompt = random_tokens(length, seed=100 + length)
    assert engine.generate([prompt], LONG)[0].token_ids == reference_tokens(engine.model, prompt, LONG.max_tokens)
    assert_empty(engine)


def test_batched_prompts_of_different_lengths(engine):
    prompts = [random_tokens(n, seed=n) for n in (3, 17, 40, 9)]
    got = engine.generate(prompts, LONG)
    assert [c.token_ids for c in got] == [reference_tokens(engine.model, p, LONG.max_tokens) for p in prompts]
    assert_empty(engine)


def test_chunked_prefill_and_preemption(model, tokenizer):
    """Chunks of 8 tokens carry the state across passes; a pool of 12 blocks for 3 requests of up to 64
    tokens preempts, and the preempted request recomputes its state from 0 or a checkpoint."""
    prompts = [random_tokens(n, seed=200 + n) for n in (30, 21, 36)]
    want = [reference_tokens(model, p, LONG.max_tokens) for p in prompts]
    with tiny_engine(model, tokenizer, max_batch_tokens=8, max_num_seqs=4, cache_tokens=64) as eng:
        assert eng.kv.num_blocks < sum(-(-(len(p) + LONG.max_tokens) // 8) for p in prompts)
        got = eng.generate(prompts, LONG)
        assert [c.token_ids for c in got] == want
        assert eng.stats()["preemptions"] > 0
        assert_empty(eng)


def test_n2_forks_share_the_parent_state(engine):
    prompt = random_tokens(19, seed=5)
    got = engine.generate([prompt], dataclasses.replace(LONG, n=2))
    want = reference_tokens(engine.model, prompt, LONG.max_tokens)
    assert [c.token_ids for c in got] == [want, want]
    assert_empty(engine)


def test_abort_frees_the_slot(model, tokenizer):
    core = make_core(model, tokenizer)
    core.add_request("a", random_tokens(12, seed=6), LONG, lambda event: None)
    core.step()
    core.step()
    assert core.scheduler.state.num_free == 3
    core.abort("a")
    assert core.scheduler.state.num_free == 4 and not core.has_unfinished


def test_second_chat_turn_resumes_from_the_first_turns_checkpoint(model, tokenizer):
    """Turn 2 = turn 1's prompt + reply + a new message: it re-prefills only from the last checkpoint
    (cached tokens > 0), and its reply equals a cold run's."""
    turn1 = random_tokens(21, seed=7)
    with tiny_engine(model, tokenizer) as eng:
        reply = eng.generate([turn1], LONG)[0].token_ids
        turn2 = turn1 + reply + random_tokens(13, seed=8)
        warm = eng.generate([turn2], LONG)[0]
        assert_empty(eng)
    boundary = (len(turn1) + len(reply) - 1) // 8 * 8  # the reply's last computed block boundary
    assert warm.cached_tokens == boundary > len(turn1)
    assert warm.token_ids == reference_tokens(model, turn2, LONG.max_tokens)


def test_same_prompt_again_resumes_from_the_prompt_checkpoint(engine):
    prompt = random_tokens(27, seed=909)  # shares no block with the other tests' prompts
    cold = engine.generate([prompt], LONG)[0]
    warm = engine.generate([prompt], LONG)[0]
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 24)  # the prompt's last boundary before token 27
    assert warm.token_ids == cold.token_ids == reference_tokens(engine.model, prompt, LONG.max_tokens)


def test_stats_and_plan_report_state_memory_apart_from_kv(engine):
    stats = engine.stats()
    plan = stats["memory_plan"]
    per_sequence = engine.layout.state_bytes_per_sequence
    assert per_sequence == 2 * 4 * (2 * 128 + 4 * 16 * 16)  # 2 state layers, float32 conv + gated-delta state
    assert stats["state_bytes"] == plan.state_bytes == (plan.num_state_slots + plan.num_checkpoints) * per_sequence
    assert plan.num_state_slots == stats["state_slots_total"] == engine.scheduler_config.max_num_seqs
    assert stats["kv_bytes"] == plan.kv_bytes == plan.num_blocks * plan.block_bytes
    assert "state:" in plan.describe() and any(label.startswith("state (") for label, _ in plan.breakdown)


def test_a_pass_built_ahead_and_dropped_leaves_the_state_as_it_was(model, tokenizer):
    """The runner builds the next decode pass before a step is scheduled; when a new request makes the
    step differ, that pass is dropped, and its state rows must not have been stored."""
    core = make_core(model, tokenizer)
    prompts = {"a": random_tokens(15, seed=11), "b": random_tokens(6, seed=12)}
    events = {rid: [] for rid in prompts}
    core.add_request("a", prompts["a"], LONG, events["a"].append)
    for _ in range(4):
        core.step()
    assert core.runner._ahead is not None and core.runner._ahead.state_pass is not None  # built on a's state
    core.add_request("b", prompts["b"], LONG, events["b"].append)  # the next step is not the one built ahead
    run_to_completion(core)
    for rid, prompt in prompts.items():
        assert token_ids(events[rid]) == reference_tokens(model, prompt, LONG.max_tokens), rid
    assert core.scheduler.state.num_free == 4


@pytest.mark.parametrize("module", ["mamba2", "rwkv7"])
def test_state_only_models_batched_and_on_a_second_turn(module, tokenizer):
    """No attention layer at all: blocks only number the tokens (prefix hashes, checkpoints)."""
    from tests.archs.harness import build

    model = build(module)
    prompts = [random_tokens(n, seed=300 + n) for n in (5, 19)]
    want = [reference_tokens(model, p, GREEDY.max_tokens) for p in prompts]
    with tiny_engine(model, tokenizer) as eng:
        assert [c.token_ids for c in eng.generate(prompts, GREEDY)] == want
        turn2 = prompts[1] + want[1] + random_tokens(4, seed=301)
        warm = eng.generate([turn2], GREEDY)[0]
        assert warm.cached_tokens > len(prompts[1])
        assert warm.token_ids == reference_tokens(model, turn2, GREEDY.max_tokens)
        assert_empty(eng)
