"""The step budget (engine/step_budget.py): prefill chunks sized by what steps were measured to cost, so decoding
streams keep getting tokens beside a long prompt and a hang-up is let go within one step."""

from __future__ import annotations

import itertools
import threading
import time

from mlxpaged.engine.step_budget import FIRST_CHUNK, MIN_CHUNK, MIN_LATER_CHUNK, TAIL_TOKENS, Chunk, StepBudget
from mlxpaged.errors import ConfigError
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_core import make_core, token_ids
from tests.engine.test_engine import reference_tokens, tiny_engine, tokenizer  # noqa: F401  (the fixture, shared)
from tests.tiny_models import random_tokens, tiny_llama

import pytest

TOKEN_S = 2**-9  # seconds per prefill token in the made-up measurements (exact in binary)


def measured(budget_s: float = 0.5, decode_s: float = 0.25) -> StepBudget:
    """A budget that saw a step decode alone in `decode_s`, then one that also prefilled 128 tokens at TOKEN_S each."""
    budget = StepBudget(budget_s)
    budget.record(decode_s, decoding=True, prefills=[])
    budget.record(decode_s + 128 * TOKEN_S, decoding=True, prefills=[Chunk(0, 128)])
    return budget


def test_before_anything_is_measured_a_prompt_takes_a_first_chunk_alone_or_beside_streams():
    assert StepBudget(0.5).plan(decoding=False).take(0, 2048) == FIRST_CHUNK  # the first prompt of an engine's life
    assert StepBudget(0.5).plan(decoding=True).take(0, 2048) == FIRST_CHUNK
    assert StepBudget(0.5).plan(decoding=False).take(0, 100) == 100


def test_a_chunk_beside_streams_takes_what_their_part_leaves_of_the_budget():
    budget = measured()
    beside = budget.plan(decoding=True)
    assert beside.take(100, 2048) == 64  # (0.5 x PLAN_SHARE - 0.25) s / TOKEN_S
    assert not beside.has_time_for(long_prompt=False)  # a second prompt waits for the next step
    assert budget.plan(decoding=False).take(100, 2048) == 192  # alone: the whole budget's planned share
    assert budget.plan(decoding=False).take(100, 150) == 150  # never more than the scheduler allows


def test_a_long_prompts_chunk_beside_streams_takes_what_their_part_leaves_of_the_long_prompts_budget():
    budget = StepBudget(1.0, long_prompt_s=0.375)
    budget.record(0.25, decoding=True, prefills=[])
    budget.record(0.25 + 128 * TOKEN_S, decoding=True, prefills=[Chunk(0, 128)])
    beside = budget.plan(decoding=True)
    assert beside.take(100, 2048, long_prompt=True) == 16  # (0.375 x PLAN_SHARE - 0.25) s / TOKEN_S
    assert beside.take(200, 2048) == 240  # a short prompt beside it gets the rest of the whole budget
    assert not beside.has_time_for(long_prompt=False)
    assert budget.plan(decoding=True).take(100, 2048) == 256  # a short prompt alone beside streams: the budget
    assert budget.plan(decoding=False).take(100, 2048, long_prompt=True) == 384  # no streams: the whole budget
    assert StepBudget(0.5, long_prompt_s=2.0).long_prompt_s == 0.5  # never above the budget


def test_a_chunk_that_would_leave_a_few_tokens_takes_them_and_a_later_one_too_small_for_its_pass_waits():
    budget = measured()  # beside the streams: 64 tokens' time
    assert budget.plan(decoding=True).take(100, 64 + TAIL_TOKENS) == 64 + TAIL_TOKENS  # its first token this step
    assert budget.plan(decoding=True).take(100, 65 + TAIL_TOKENS) == 64  # more than a tail left: priced as before
    alone = budget.plan(decoding=False)  # 192 tokens' time
    assert alone.take(100, 150) == 150
    assert alone.take(300, 400) == 0  # 42 tokens' time left: under MIN_LATER_CHUNK, and it would not finish
    assert alone.num_chunks == 1 and alone.take(300, 30) == 30  # one that finishes its prompt still goes
    assert MIN_LATER_CHUNK > TAIL_TOKENS


def test_a_prompt_that_arrived_behind_the_streams_keeps_to_their_budget_one_ahead_of_them_to_the_whole():
    budget = StepBudget(1.0, long_prompt_s=0.375, streams_s=0.5)
    budget.record(0.25, decoding=True, prefills=[])
    budget.record(0.25 + 128 * TOKEN_S, decoding=True, prefills=[Chunk(0, 128)])
    behind = budget.plan(decoding=True)
    assert behind.take(100, 2048, behind_streams=True) == 64  # (0.5 x PLAN_SHARE - 0.25) s / TOKEN_S
    assert not behind.has_time_for(long_prompt=False, behind_streams=True)
    assert behind.has_time_for(long_prompt=False)  # one ahead of the streams may come: 192 tokens' time is left
    assert behind.take(300, 2048) == 192  # (1.0 x PLAN_SHARE - 0.25) s / TOKEN_S, less the first chunk's
    assert budget.plan(decoding=True).take(100, 2048) == 256  # ahead of the streams (a burst): the whole budget
    assert budget.plan(decoding=True).take(100, 2048, long_prompt=True, behind_streams=True) == 16  # long prompts'
    assert budget.plan(decoding=False).take(100, 2048, behind_streams=True) == 384  # no streams: the whole budget
    assert StepBudget(1.0, streams_s=2.0).streams_s == 1.0  # never above the budget
    assert StepBudget(1.0, long_prompt_s=0.8, streams_s=0.5).long_prompt_s == 0.5  # nor above the streams'


def test_a_bucket_not_measured_yet_takes_its_nearest_measured_neighbours_cost_and_one_buckets_rise():
    budget = measured()
    # Bucket 2 from bucket 0, the only one measured: no rise known, the most it may be (a token's whole cost growing
    # with its context, ~512 keys in bucket 0: +2x a bucket).
    assert budget.per_token_s(3000) == budget.per_token_s(1500) == 3 * TOKEN_S
    assert StepBudget(0.5).plan(decoding=False).take(1500, 2048) == FIRST_CHUNK  # nothing measured: no guess
    budget.record(128 * 3 * TOKEN_S, decoding=False, prefills=[Chunk(2900, 128)])  # bucket 2 measured: 3x
    assert budget.plan(decoding=True).take(2900, 2048) == int(0.125 / (3 * TOKEN_S))
    assert budget.per_token_s(1500) == 3 * TOKEN_S  # the nearest before, with its rise unknown
    # Above the last measured bucket: its cost plus one bucket's rise (2 x TOKEN_S over two buckets), however far.
    assert budget.per_token_s(3500) == budget.per_token_s(9000) == 4 * TOKEN_S
    budget.record(128 * 2 * TOKEN_S, decoding=False, prefills=[Chunk(3900, 128)])  # bucket 3 cheaper: no fall below
    assert budget.per_token_s(5000) == 2 * TOKEN_S
    # A chunk that would cross into a dearer bucket is sized at that bucket's price: a fresh engine's first prompt
    # leaving bucket 0 (384 tokens at TOKEN_S would end in bucket 1, at the most it may cost: 3 x TOKEN_S)...
    fresh = StepBudget(1.0)
    fresh.record(256 * TOKEN_S, decoding=False, prefills=[Chunk(0, 256)])
    assert fresh.plan(decoding=False).take(900, 2048) == int(0.75 / (3 * TOKEN_S))
    assert fresh.plan(decoding=False).take(700, 2048) == 1023 - 700  # not fewer than bucket 0 has left, at its price
    # ...and once two buckets are measured, their rise (1 x TOKEN_S a bucket).
    rising = StepBudget(1.0)
    rising.record(256 * TOKEN_S, decoding=False, prefills=[Chunk(0, 256)])
    rising.record(256 * 2 * TOKEN_S, decoding=False, prefills=[Chunk(1024, 256)])  # bucket 1: 2x
    assert rising.plan(decoding=False).take(1950, 2048) == int(0.75 / (3 * TOKEN_S))  # 192 at 2x would end in bucket 2
    assert rising.plan(decoding=False).take(1900, 2048) == 2047 - 1900  # what bucket 1 has left, more than that
    later = StepBudget(0.5)
    later.record(128 * TOKEN_S, decoding=False, prefills=[Chunk(4096, 128)])
    assert later.per_token_s(100) == TOKEN_S  # nothing before: the nearest after


def test_a_step_over_budget_still_advances_its_first_prompt_by_a_few_tokens_and_admits_no_other():
    plan = measured(budget_s=0.5, decode_s=0.6).plan(decoding=True)
    assert plan.take(0, 2048) == MIN_CHUNK and not plan.has_time_for(long_prompt=False)
    assert measured(decode_s=0.6).plan(decoding=True).take(0, 5) == 5


def test_a_step_faster_than_its_decode_part_teaches_nothing():
    budget = measured()
    budget.record(0.1, decoding=True, prefills=[Chunk(0, 64)])
    assert budget.per_token_s(10) == TOKEN_S


def test_the_budget_must_be_positive():
    with pytest.raises(ValueError, match="must be > 0 seconds"):
        StepBudget(0)
    with pytest.raises(ValueError, match="long prompts' step budget must be > 0 seconds"):
        StepBudget(1, long_prompt_s=0)
    from mlxpaged.config import SchedulerConfig

    with pytest.raises(ConfigError, match="step_budget_ms"):
        SchedulerConfig(step_budget_ms=-5)
    assert SchedulerConfig(step_budget_ms=None).step_budget_ms is None
    with pytest.raises(ConfigError, match="long_prompt_step_budget_ms"):
        SchedulerConfig(long_prompt_step_budget_ms=0)
    with pytest.raises(ValueError, match="streams' budget must be > 0 seconds"):
        StepBudget(1, streams_s=-1)
    with pytest.raises(ConfigError, match="streams_step_budget_ms"):
        SchedulerConfig(streams_step_budget_ms=0)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def test_a_long_prompt_beside_a_decoding_stream_is_prefilled_a_few_tokens_a_step_and_the_stream_never_waits(
    model, tokenizer
):
    # A budget no step can meet: beside the stream every step prefills MIN_CHUNK tokens of the long prompt.
    core = make_core(model, tokenizer, max_batch_tokens=2048, max_num_seqs=4, step_budget_ms=1e-3)
    stream, long = [], []
    core.add_request("stream", random_tokens(5, seed=1), SamplingParams(temperature=0, max_tokens=40), stream.append)
    while not stream:
        core.step()  # its prompt prefills alone, in one chunk: the first measurement
    prompt = random_tokens(300, seed=2)
    core.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), long.append)
    request = core.scheduler.get("long")
    steps, computed = 0, [0]
    while not long:
        before = len(token_ids(stream))
        core.step()
        steps += 1
        assert len(token_ids(stream)) == before + 1  # the stream got its token in this step too
        computed.append(request.num_computed_tokens)
    chunks = [b - a for a, b in itertools.pairwise(computed)]
    assert chunks == [MIN_CHUNK] * (len(prompt) // MIN_CHUNK) + [len(prompt) % MIN_CHUNK], chunks
    while core.has_unfinished:
        core.step()
    assert token_ids(long) == reference_tokens(model, prompt, 5)  # small chunks, the same tokens


def test_beside_a_decoding_stream_a_long_prompt_keeps_to_its_budget_and_a_short_one_to_the_steps(model, tokenizer):
    # No step can meet the long prompts' budget, every step meets the budget: a prompt with more than a step's
    # tokens (64) to prefill prefills MIN_CHUNK tokens a step to its last chunk; a short one in one step, and so does
    # a long one whose prefix came from the cache.
    core = make_core(
        model, tokenizer, max_batch_tokens=64, max_num_seqs=4, step_budget_ms=60_000, long_prompt_step_budget_ms=1e-3
    )
    stream, long, short = [], [], []
    core.add_request("stream", random_tokens(5, seed=1), SamplingParams(temperature=0, max_tokens=80), stream.append)
    while not stream:
        core.step()  # measured once
    prompt = random_tokens(150, seed=5)
    core.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), long.append)
    request, computed = core.scheduler.get("long"), [0]
    while not long:
        core.step()
        computed.append(request.num_computed_tokens)
    chunks = [b - a for a, b in itertools.pairwise(computed)]
    assert chunks == [MIN_CHUNK] * (len(prompt) // MIN_CHUNK) + [len(prompt) % MIN_CHUNK], chunks
    core.add_request("short", random_tokens(40, seed=6), SamplingParams(temperature=0, max_tokens=1), short.append)
    core.step()
    assert short  # prefilled whole, its token sampled, in the one step
    follow_up = prompt + random_tokens(40, seed=7)  # 190 tokens, all but the last partial block's cached
    followed: list = []
    core.add_request("follow-up", follow_up, SamplingParams(temperature=0, max_tokens=1), followed.append)
    core.step()
    assert followed and followed[-1].cached_tokens == 144  # the rest prefilled in one step
    while core.has_unfinished:
        core.step()
    assert token_ids(long) == reference_tokens(model, prompt, 3)


def test_a_hang_up_during_a_long_prefill_is_let_go_within_one_step(model, tokenizer):
    with tiny_engine(model, tokenizer, max_batch_tokens=2048, step_budget_ms=1e-3) as engine:
        engine.generate([random_tokens(4, seed=3)], SamplingParams(temperature=0, max_tokens=1))  # measured once
        steps, left = [0, 0], threading.Event()
        step = engine.core.step

        def counted() -> None:  # the third step of the prompt ends only once its client has left
            step()
            steps[left.is_set()] += 1
            if steps[0] == 3:
                assert left.wait(60)

        engine.core.step = counted  # the engine thread looks it up every step
        request_id = engine.submit(random_tokens(480, seed=4), SamplingParams(max_tokens=1), lambda event: None)
        deadline = time.monotonic() + 60
        while steps[0] < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        engine.abort(request_id)
        left.set()
        while engine.stats()["blocks_used"] and time.monotonic() < deadline:
            time.sleep(0.001)
        assert engine.stats()["blocks_used"] == 0
        assert steps == [3, 0]  # 3 chunks of MIN_CHUNK tokens of 480, and no step after the one running
