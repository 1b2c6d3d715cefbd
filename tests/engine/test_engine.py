"""The paged engine against mlx-lm's own generate_step, and against itself (batched, cached, preempted)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

from mlxpaged.config import CacheConfig, split_settings
from mlxpaged.engine.engine import Engine, RequestFailedError
from mlxpaged.errors import RequestTooLongError
from mlxpaged.loading.loader import LoadedModel
from mlxpaged.loading.model_store import ModelRef
from mlxpaged.sampling_params import SamplingParams
from tests.tiny_models import random_tokens, tiny_llama, tiny_qwen3

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def reference_tokens(model, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy decode with its own KV cache."""
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


def tiny_engine(model, tokenizer, **settings) -> Engine:
    """An engine over a tiny random model, sharing the real tokenizer (its ids < 256 are byte tokens);
    `settings` are CacheConfig and SchedulerConfig fields, as Engine.from_pretrained takes them."""
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    loaded = LoadedModel(model, tokenizer, ModelRef("tiny", "path"), Path("tiny"), "float32", config)
    return Engine(loaded, *split_settings({"cache_tokens": 2048, "block_size": 8, **settings}))


def assert_same_completions(got: list, want: list) -> None:
    """The same tokens, and the same logprobs where they were asked for (to float32 noise)."""
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def assert_pool_empty(engine: Engine) -> None:
    deadline = time.monotonic() + 2.0
    while engine.stats()["blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats()["blocks_used"] == 0


@pytest.fixture(scope="module")
def tokenizer(default_loaded):
    return default_loaded.tokenizer


@pytest.fixture(scope="module")
def engine(default_loaded):
    with Engine(default_loaded, CacheConfig(cache_tokens=8192)) as eng:
        yield eng
        assert_pool_empty(eng)


@pytest.fixture(scope="module", params=["llama-gqa", "qwen3"])
def tiny(request, tokenizer):
    model = tiny_llama() if request.param == "llama-gqa" else tiny_qwen3()
    with tiny_engine(model, tokenizer) as eng:
        yield eng
        assert_pool_empty(eng)


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.mark.slow
def test_real_model_matches_mlx_lm_token_for_token(engine):
    for text in PROMPTS:
        prompt = engine.chat_tokens([{"role": "user", "content": text}])
        got = engine.generate([prompt], GREEDY)[0]
        assert got.token_ids == reference_tokens(engine.model, prompt, GREEDY.max_tokens), text
    assert_pool_empty(engine)


@pytest.mark.parametrize("length", [1, 7, 8, 9, 30])
def test_tiny_models_match_mlx_lm(tiny, length):
    prompt = random_tokens(length, seed=length)
    got = tiny.generate([prompt], GREEDY)[0]
    assert got.token_ids == reference_tokens(tiny.model, prompt, GREEDY.max_tokens)
    assert got.finish_reason == "length" and got.prompt_tokens == length


def test_concurrent_ragged_requests_equal_solo_runs(tokenizer):
    # A small token budget forces chunked prefill to interleave with other requests' decode steps.
    with tiny_engine(tiny_llama(), tokenizer, max_batch_tokens=24, max_num_seqs=8) as eng:
        prompts = [random_tokens(n, seed=n) for n in (3, 17, 40, 5, 64, 12, 33, 9)]
        solo = [eng.generate([p], GREEDY)[0].token_ids for p in prompts]
        eng.pool.reset_prefix_cache()
        batched = [c.token_ids for c in eng.generate(prompts, GREEDY)]
        assert batched == solo
        assert_pool_empty(eng)


@pytest.mark.slow
def test_prefix_cache_hit_equals_cold_output(engine):
    messages = [{"role": "user", "content": "Tell me about the moon in two sentences."}]
    cold = engine.chat(messages, GREEDY)
    warm = engine.chat(messages, GREEDY)
    assert warm.cached_tokens > 0 and warm.cached_tokens >= warm.prompt_tokens - 16
    assert warm.token_ids == cold.token_ids
    # A second turn re-prefills only the new turn.
    turn2 = [*messages, {"role": "assistant", "content": warm.text}, {"role": "user", "content": "And the sun?"}]
    second = engine.chat(turn2, GREEDY)
    assert second.cached_tokens >= len(engine.chat_tokens(messages)) - 16


def test_preempted_request_resumes_with_identical_output(tokenizer):
    model = tiny_llama()
    prompts = [random_tokens(20, seed=s) for s in range(4)]
    params = dataclasses.replace(GREEDY, max_tokens=40)
    with tiny_engine(model, tokenizer) as roomy:
        expected = [c.token_ids for c in roomy.generate(prompts, params)]
    # 4 x 60 tokens need 32 blocks of 8; this pool has 8 + 4 = 12.
    with tiny_engine(model, tokenizer, cache_tokens=64, max_num_seqs=4) as tight:
        got = [c.token_ids for c in tight.generate(prompts, params)]
        assert tight.stats()["preemptions"] > 0
        assert_pool_empty(tight)
    assert got == expected


def test_seeded_sampling_is_reproducible_alone_and_batched(tiny):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = random_tokens(10, seed=99)
    alone = tiny.generate([prompt], params)[0].token_ids
    assert tiny.generate([prompt], params)[0].token_ids == alone
    others = [random_tokens(n, seed=n) for n in (4, 25, 13)]
    unseeded = dataclasses.replace(params, seed=None, temperature=1.3)
    batched = tiny.generate([others[0], prompt, *others[1:]], [unseeded, params, unseeded, unseeded])
    assert batched[1].token_ids == alone
    other_seed = tiny.generate([prompt], dataclasses.replace(params, seed=4321))[0].token_ids
    assert other_seed != alone  # the seed matters (16 tokens at temperature 0.9)


def test_short_prompts_share_prefill_passes_and_equal_solo_runs(tokenizer, monkeypatch):
    from mlxpaged.runner import model_runner as runner_module

    shared = []
    grouping = runner_module.prefill_passes
    monkeypatch.setattr(
        runner_module,
        "prefill_passes",
        lambda inputs: shared.extend(p for p in grouping(inputs) if len(p) > 1) or grouping(inputs),
    )
    with tiny_engine(tiny_llama(), tokenizer, max_num_seqs=8) as eng:
        prompts = [random_tokens(n, seed=n) for n in (30, 33, 35, 31, 40, 9, 10, 300)]
        solo = [eng.generate([p], GREEDY)[0].token_ids for p in prompts]
        assert not shared
        eng.pool.reset_prefix_cache()
        assert [c.token_ids for c in eng.generate(prompts, GREEDY)] == solo
        assert shared  # some prompts did share a pass
        assert_pool_empty(eng)


def test_prefill_passes_group_similar_short_chunks():
    from mlxpaged.runner.passes import StepInput, prefill_passes

    def chunk(n, start=0):
        return StepInput(list(range(n)), start, [[0]], True)

    inputs = [
        chunk(1),
        chunk(40),
        chunk(200),
        chunk(38),
        chunk(10),
        chunk(45),
        chunk(8),
        chunk(30, start=240),
        chunk(1),
    ]
    # Decode rows (1 token) are not prefill; 10 and 8 pad to 10 (x1.11); 38, 40, 45 pad to 45 (x1.09);
    # 200 next to them would pad x3.2; the chunk ending at 270 runs alone.
    assert prefill_passes(inputs) == [[6, 4], [3, 1, 5], [2], [7]]


def identity_processor(tokens, logits):
    return logits


def test_pipelined_steps_equal_unpipelined_ones(tiny, monkeypatch):
    """Decode steps queued on the previous step's lazy tokens (Engine._look_ahead) produce what
    fully synchronous steps produce; a logits processor, which reads the history, turns the
    pipeline off, so it serves as the synchronous twin. Also checks the pipeline really ran:
    batched, and alone with compiled passes off (a compiled batch-1 pass is not pipelined)."""
    from mlxpaged.runner.model_runner import Lookahead

    adopted = []
    covers = Lookahead.covers
    monkeypatch.setattr(Lookahead, "covers", lambda self, chunks: adopted.append(covers(self, chunks)) or adopted[-1])
    prompts = [random_tokens(n, seed=n) for n in (6, 21, 13)]
    compiled = tiny.runner.decoder
    for params in (
        dataclasses.replace(GREEDY, max_tokens=24),
        SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=24, ignore_eos=True, logprobs=True),
    ):
        sync = dataclasses.replace(params, logits_processors=[identity_processor])
        want = [tiny.generate([p], sync)[0] for p in prompts]
        assert not adopted  # the synchronous twin never pipelines
        monkeypatch.setattr(tiny.runner, "decoder", None)
        alone = [tiny.generate([p], params)[0] for p in prompts]
        monkeypatch.setattr(tiny.runner, "decoder", compiled)
        assert sum(adopted) >= 3 * (params.max_tokens - 2)
        adopted.clear()
        batched = tiny.generate(prompts, params)
        assert sum(adopted) >= params.max_tokens - 2
        for got in (alone, batched):
            assert_same_completions(got, want)
        adopted.clear()
    assert_pool_empty(tiny)


def test_a_request_arriving_mid_decode_discards_the_queued_step_safely(tiny, monkeypatch):
    monkeypatch.setattr(tiny.runner, "decoder", None)  # compiled batch-1 passes are not pipelined
    prompts = [random_tokens(30, seed=1), random_tokens(9, seed=2)]
    params = dataclasses.replace(GREEDY, max_tokens=30)
    solo = [tiny.generate([p], params)[0].token_ids for p in prompts]
    first = tiny.stream(prompts[0], params)
    got = [next(first).token_id for _ in range(5)]  # the first request is decoding (pipelined)
    second = tiny.generate([prompts[1]], params)[0].token_ids  # admitted mid-decode
    got += [d.token_id for d in first if d.token_id is not None]
    assert got == solo[0] and second == solo[1]
    assert_pool_empty(tiny)


def test_stop_string_across_tokens_max_tokens_and_eos(engine):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = engine.chat(messages, SamplingParams(temperature=0.0, max_tokens=30))
    assert full.text == "The capital of France is Paris." and full.finish_reason == "stop"  # EOS
    stopped = engine.chat(messages, SamplingParams(temperature=0.0, max_tokens=30, stop=["is Par"]))
    assert stopped.text == "The capital of France " and stopped.finish_reason == "stop"
    short = engine.chat(messages, SamplingParams(temperature=0.0, max_tokens=3))
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_abort_mid_stream_frees_blocks(engine):
    stream = engine.stream("Count from one to one hundred:", SamplingParams(temperature=0.0, max_tokens=200))
    for delta in itertools.islice(stream, 3):
        assert delta.finish_reason is None
    assert engine.stats()["blocks_used"] > 0
    stream.close()  # closing the iterator aborts the request
    assert_pool_empty(engine)


def test_prompt_longer_than_cache_is_rejected_and_others_continue(tokenizer):
    with tiny_engine(tiny_llama(), tokenizer, cache_tokens=64, max_num_seqs=2) as eng:
        running = eng.stream(random_tokens(10), GREEDY)
        next(running)
        with pytest.raises(RequestTooLongError, match="exceeds the KV cache capacity"):
            eng.generate([random_tokens(200)], GREEDY)
        rest = list(running)
        assert rest[-1].finish_reason == "length"
        assert_pool_empty(eng)


def test_failing_logits_processor_fails_only_its_request(tiny):
    def broken(tokens, logits):
        raise RuntimeError("boom")

    bad = dataclasses.replace(GREEDY, logits_processors=[broken])
    good = tiny.stream(random_tokens(12), GREEDY)
    failing = tiny.stream(random_tokens(8), bad)
    with pytest.raises(RequestFailedError, match="boom"):
        list(failing)
    assert list(good)[-1].finish_reason == "length"
    assert_pool_empty(tiny)


def test_invalid_token_ids_and_empty_prompt(tiny):
    with pytest.raises(ValueError, match="out of range"):
        tiny.generate([[1, 2, 10**6]], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        tiny.generate([[]], GREEDY)


def test_n_sequences_share_the_prompt_and_match_solo_runs(tiny):
    prompt = random_tokens(21, seed=5)  # 21 tokens: two full blocks of 8 shared, a partial one copied
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=12, ignore_eos=True)
    before = tiny.stats()["prefix_hit_tokens"]
    forked = tiny.generate([prompt], params)
    assert [c.finish_reason for c in forked] == ["length"] * 3
    assert len({tuple(c.token_ids) for c in forked}) == 3  # different samples
    assert tiny.stats()["prefix_hit_tokens"] == before  # the prompt was prefilled once, not looked up 3 times
    again = tiny.generate([prompt], params)
    assert [c.token_ids for c in again] == [c.token_ids for c in forked]
    assert_pool_empty(tiny)


def test_n_sequences_stream_and_abort(tiny):
    params = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=50, ignore_eos=True)
    stream = tiny.stream(random_tokens(9, seed=3), params)
    seen = {next(stream).index for _ in range(6)}
    assert seen == {0, 1}
    stream.close()
    assert_pool_empty(tiny)


def test_quantized_model_gets_activation_dtype_pools_and_matches_mlx_lm(tokenizer):
    import mlx.nn as nn

    model = tiny_llama()
    nn.quantize(model, group_size=32, bits=8)  # like the 4-bit/8-bit mlx-community presets
    mx.eval(model.parameters())
    with tiny_engine(model, tokenizer) as eng:
        assert eng.kv.dtype == mx.float32  # not the quantized embedding's uint32
        prompt = random_tokens(12)
        assert eng.generate([prompt], GREEDY)[0].token_ids == reference_tokens(model, prompt, GREEDY.max_tokens)


def test_a_sink_that_raises_aborts_only_its_request(tiny):
    good = tiny.stream(random_tokens(12), GREEDY)

    def broken_sink(event):
        raise RuntimeError("event loop is closed")

    tiny.submit(random_tokens(9), GREEDY, broken_sink)
    assert list(good)[-1].finish_reason == "length"
    assert_pool_empty(tiny)
