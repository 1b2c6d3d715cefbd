"""Speculative decoding end to end: the same tokens as plain decoding (greedy and seeded), alone and
batched, stops inside an accepted run, prefix-cache hits on speculated blocks, and every block free after.

Tiny random models rarely repeat themselves, so most tiny-model tests draft with an oracle: the plain
run's own continuation, corrupted at some positions, so that drafts are partly kept and partly rolled
back every step. The real model drafts with the n-gram drafter on a prompt it quotes.
"""

from __future__ import annotations

import dataclasses

from mlxpaged.runner.ngram_drafter import NgramDrafter
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_core import make_core, run_to_completion, token_ids
from tests.engine.test_engine import tokenizer  # noqa: F401  (the fixture, shared)
from tests.tiny_models import random_tokens, tiny_llama, tiny_qwen3

import pytest

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=40, ignore_eos=True)
PROMPTS = {"a": random_tokens(11, seed=1), "b": random_tokens(30, seed=2), "c": random_tokens(5, seed=3)}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return tiny_llama() if request.param == "llama" else tiny_qwen3()


def run(model, tokenizer, prompts: dict, params, **scheduling) -> tuple[dict, object]:
    """Every prompt through one core (batched); (events by id, the core) once all finished."""
    core = make_core(model, tokenizer, max_num_seqs=4, **scheduling)
    events = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, params[rid] if isinstance(params, dict) else params, events[rid].append)
    run_to_completion(core)
    assert core.scheduler.kv_manager.stats().num_owned == 0  # rollback and finish left no block owned
    return events, core


def oracle(monkeypatch, continuations: list[list[int]], wrong_every: int = 3) -> None:
    """Drafts are the known continuation of whichever sequence `tokens` starts, with one token wrong
    at every `wrong_every`-th length (so some drafts are kept, some rejected); none for unknown ones."""

    def propose(self, tokens, k):
        for full in continuations:
            if full[: len(tokens)] == list(tokens):
                draft = list(full[len(tokens) : len(tokens) + k])
                if draft and len(tokens) % wrong_every == 0:
                    draft[len(draft) // 2] = (draft[len(draft) // 2] + 1) % 256
                return draft
        return []

    monkeypatch.setattr(NgramDrafter, "propose", propose)


def full_sequences(prompts: dict, events: dict) -> list[list[int]]:
    return [prompts[rid] + token_ids(events[rid]) for rid in prompts]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_drafts_give_the_plain_tokens(model, tokenizer, monkeypatch, params):
    plain, _ = run(model, tokenizer, PROMPTS, params)
    oracle(monkeypatch, full_sequences(PROMPTS, plain))
    spec, core = run(model, tokenizer, PROMPTS, params, speculative="ngram")
    stats = core.speculator.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # drafts were kept and rolled back
    for rid in PROMPTS:
        assert token_ids(spec[rid]) == token_ids(plain[rid]), rid
        assert spec[rid][-1].completion_tokens == params.max_tokens


def test_a_drafting_request_batched_with_plain_ones(model, tokenizer, monkeypatch):
    """Only "b" drafts ("a" has a logits processor, "c" no known continuation): the others are untouched."""
    params = {"a": dataclasses.replace(GREEDY, logits_processors=[lambda tokens, row: row * 1.5]), "b": GREEDY}
    params["c"] = GREEDY
    plain, _ = run(model, tokenizer, PROMPTS, params)
    oracle(monkeypatch, full_sequences(PROMPTS, plain)[:2])
    spec, core = run(model, tokenizer, PROMPTS, params, speculative="ngram")
    assert core.speculator.stats.accepted_tokens > 0
    assert core.speculator.stats.drafting_steps <= len(plain["b"])  # one row drafted
    assert {rid: token_ids(e) for rid, e in spec.items()} == {rid: token_ids(e) for rid, e in plain.items()}


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_rows_with_penalties_draft_with_the_drafts_before_each_position_as_history(
    model, tokenizer, monkeypatch, params
):
    """A repetition penalty at drafted position j counts the drafts before it, as plain decoding does once they are
    kept (draft_verify.ShiftedState); presence and frequency penalties likewise."""
    penalized = {
        "a": dataclasses.replace(params, repetition_penalty=1.3),
        "b": dataclasses.replace(params, presence_penalty=0.8, frequency_penalty=0.6),
    }
    prompts = {rid: PROMPTS[rid] for rid in penalized}
    plain, _ = run(model, tokenizer, prompts, penalized)
    oracle(monkeypatch, full_sequences(prompts, plain), wrong_every=4)
    spec, core = run(model, tokenizer, prompts, penalized, speculative="ngram")
    assert 0 < core.speculator.stats.accepted_tokens < core.speculator.stats.draft_tokens
    assert {rid: token_ids(e) for rid, e in spec.items()} == {rid: token_ids(e) for rid, e in plain.items()}


def test_alone_with_the_ngram_drafter(model, tokenizer):
    prompt = {"r": random_tokens(12, seed=4) * 3}  # a repeated prompt: the drafter finds matches in it
    plain, _ = run(model, tokenizer, prompt, GREEDY)
    spec, core = run(model, tokenizer, prompt, GREEDY, speculative="ngram")
    assert core.speculator.stats.draft_tokens > 0
    assert token_ids(spec["r"]) == token_ids(plain["r"])


def test_seeded_speculative_runs_reproduce(model, tokenizer, monkeypatch):
    """Drafts from another seed's reply: mostly rejected, each rejection resampled, the same each run."""
    other, _ = run(model, tokenizer, PROMPTS, dataclasses.replace(SEEDED, seed=8))

    def propose(self, tokens, k):  # the other reply's tokens at these output positions
        for rid, prompt in PROMPTS.items():
            if list(tokens[: len(prompt)]) == prompt:
                return token_ids(other[rid])[len(tokens) - len(prompt) :][:k]
        return []

    monkeypatch.setattr(NgramDrafter, "propose", propose)
    first, core = run(model, tokenizer, PROMPTS, SEEDED, speculative="ngram")
    second, _ = run(model, tokenizer, PROMPTS, SEEDED, speculative="ngram")
    assert core.speculator.stats.draft_tokens > 0
    assert {rid: token_ids(e) for rid, e in first.items()} == {rid: token_ids(e) for rid, e in second.items()}


@pytest.mark.parametrize("stop", ["token", "max_tokens"])
def test_a_stop_inside_an_accepted_run_ends_the_request_there(model, tokenizer, monkeypatch, stop):
    plain, _ = run(model, tokenizer, PROMPTS, GREEDY)
    tokens = token_ids(plain["b"])
    at = 9  # stop at the 10th token: drafts of 5 cover it mid-run
    params = (
        dataclasses.replace(GREEDY, stop_token_ids=[tokens[at]])
        if stop == "token"
        else dataclasses.replace(GREEDY, max_tokens=at + 1)
    )
    expected = tokens[: tokens.index(tokens[at]) + 1]
    oracle(monkeypatch, full_sequences(PROMPTS, plain), wrong_every=10**6)  # always right: long runs
    spec, core = run(model, tokenizer, {"b": PROMPTS["b"]}, params, speculative="ngram")
    assert core.speculator.stats.accepted_tokens > 0
    assert token_ids(spec["b"]) == expected
    assert spec["b"][-1].completion_tokens == len(expected)


def test_prefix_cache_hits_on_speculated_blocks_are_the_kept_tokens(model, tokenizer, monkeypatch):
    """Blocks written during speculation are cached; a prompt extending the reply reuses them."""
    plain, _ = run(model, tokenizer, PROMPTS, GREEDY)
    oracle(monkeypatch, full_sequences(PROMPTS, plain))
    core = make_core(model, tokenizer, max_num_seqs=4, speculative="ngram")
    first, follow_up = [], []
    core.add_request("r", PROMPTS["b"], GREEDY, first.append)
    run_to_completion(core)
    extended = PROMPTS["b"] + token_ids(first)[:33]
    core.add_request("s", extended, dataclasses.replace(GREEDY, max_tokens=8), follow_up.append)
    run_to_completion(core)
    fresh, _ = run(model, tokenizer, {"s": extended}, dataclasses.replace(GREEDY, max_tokens=8))
    assert follow_up[-1].cached_tokens >= 56  # the hit covers blocks the speculative run wrote
    assert token_ids(follow_up) == token_ids(fresh["s"])


def test_rejected_drafts_give_their_blocks_back_every_step(model, tokenizer, monkeypatch):
    plain, _ = run(model, tokenizer, PROMPTS, GREEDY)
    oracle(monkeypatch, full_sequences(PROMPTS, plain), wrong_every=2)
    core = make_core(model, tokenizer, max_num_seqs=4, speculative="ngram")
    for rid, prompt in PROMPTS.items():
        core.add_request(rid, prompt, GREEDY, lambda event: None)
    manager = core.scheduler.kv_manager

    def blocks(tokens: int) -> int:
        return -(-tokens // manager.block_size)

    while core.has_unfinished:
        core.step()
        for request in core.scheduler.running:
            # slots for its tokens but the newest (given at the next schedule), or one more a pipelined
            # step reserves; never the slots of rejected drafts
            assert (
                blocks(request.num_tokens - 1)
                <= len(manager.block_tables(request.request_id)[0])
                <= blocks(request.num_tokens + 1)
            ), request.request_id
    assert core.speculator.stats.accepted_tokens < core.speculator.stats.draft_tokens
    assert manager.stats().num_owned == 0


@pytest.mark.slow
def test_the_real_model_quoting_its_prompt_keeps_drafts_and_the_plain_tokens(default_loaded):
    """SmolLM2 asked to repeat code, batched with a free-text request, greedy and with logprobs: the
    n-gram drafter's drafts are kept, and every token and logprob is plain decoding's."""
    from mlxpaged.config import CacheConfig, SchedulerConfig
    from mlxpaged.engine.engine import Engine
    from mlxpaged_app.bench.spec import TASKS
    from tests.engine.test_engine import assert_pool_empty

    prompts = [
        default_loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": TASKS[task][1]}], add_generation_prompt=True
        )
        for task in ("code edit", "free text")
    ]
    params = SamplingParams(temperature=0.0, max_tokens=40, logprobs=True)
    results = {}
    for speculative in (None, "ngram"):
        with Engine(default_loaded, CacheConfig(cache_tokens=4096), SchedulerConfig(speculative=speculative)) as engine:
            results[speculative] = (engine.generate(prompts, params), engine.stats())
            assert_pool_empty(engine)
    (plain, _), (spec, stats) = results[None], results["ngram"]
    assert stats["spec_acceptance_rate"] > 0.3 and stats["speculative"] == "ngram"
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids and b.text == a.text
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)


def test_sliding_window_models_refuse_speculation_by_name(tokenizer):
    from mlxpaged.cache.kv_cache import PagedKVCache
    from mlxpaged.config import CacheConfig, SchedulerConfig
    from mlxpaged.engine.core import EngineCore
    from mlxpaged.errors import ConfigError

    kv = PagedKVCache(
        num_layers=4, num_blocks=16, block_size=8, num_kv_heads=2, head_dim=16, layer_windows=[8, 8, None, 8]
    )
    with pytest.raises(ConfigError, match=r"sliding windows of \[8\] tokens") as info:
        EngineCore.create(
            tiny_llama(),
            tokenizer,
            kv,
            CacheConfig(block_size=8, enable_prefix_cache=False),
            SchedulerConfig(speculative="ngram"),
            max_model_len=512,
        )
    assert info.value.param == "speculative"


def test_a_prompt_arriving_mid_run_prefills_in_the_steps_that_verify_drafts(model, tokenizer, monkeypatch):
    def staggered(**scheduling):
        core = make_core(model, tokenizer, max_num_seqs=4, max_batch_tokens=24, **scheduling)
        events = {rid: [] for rid in PROMPTS}
        for rid in ("a", "c"):
            core.add_request(rid, PROMPTS[rid], GREEDY, events[rid].append)
        for _ in range(4):
            core.step()
        core.add_request("b", PROMPTS["b"], GREEDY, events["b"].append)  # 30 tokens: chunked beside the drafts
        run_to_completion(core)
        assert core.scheduler.kv_manager.stats().num_owned == 0
        return {rid: token_ids(e) for rid, e in events.items()}, core

    plain, _ = staggered()
    oracle(monkeypatch, [PROMPTS[rid] + plain[rid] for rid in PROMPTS])
    spec, core = staggered(speculative="ngram")
    assert core.speculator.stats.accepted_tokens > 0
    assert spec == plain


def test_n_sequences_draft_each_their_own_and_keep_their_seeded_tokens(model, tokenizer, monkeypatch):
    params = dataclasses.replace(SEEDED, n=2, max_tokens=24)
    prompt = {"r": PROMPTS["b"]}

    def replies(events) -> list[list[int]]:
        return [[e.token_id for e in events if e.index == i and e.token_id is not None] for i in range(2)]

    plain, _ = run(model, tokenizer, prompt, params)
    oracle(monkeypatch, [PROMPTS["b"] + reply for reply in replies(plain["r"])])
    spec, core = run(model, tokenizer, prompt, params, speculative="ngram")
    assert core.speculator.stats.accepted_tokens > 0
    assert replies(spec["r"]) == replies(plain["r"]) and replies(plain["r"])[0] != replies(plain["r"])[1]
