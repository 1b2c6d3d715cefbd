"""The GPU levers of issue 38 that are switches (docs/design/issue38-load.md), on the path a GPU takes
(platform/backend.py simulated as CUDA, MLX computing on the CPU): each against mlx-lm token for token.

- MLXPAGED_COMPILE_BATCH=N: decode passes of up to N rows compiled at bucketed batch sizes (runner/decode_pass.py),
  built ahead on the pools (not deferred) and launched once the step before is read.
- MLXPAGED_RECORD_THREAD=1: the pass built ahead is queued (recorded, on CUDA) from a thread of its own while the
  engine thread reads the step before, delivers, schedules and builds the next (runner/recorder.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time

from mlxpaged.platform import backend
from mlxpaged.runner import model_runner, sampling
from mlxpaged.runner.recorder import THREAD_NAME, Recorder
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_engine import (
    GREEDY,
    assert_pool_empty,
    reference_tokens,
    tiny_engine,
    tokenizer,  # noqa: F401  (the fixture, shared)
)
from tests.runner.test_decode_pass import buffer_address, count_passes
from tests.tiny_models import random_tokens, tiny_llama

import mlx.core as mx
import pytest

LONG = dataclasses.replace(GREEDY, max_tokens=40)
PROMPTS = [random_tokens(n, seed=n) for n in (3, 17, 40, 5, 64, 12)]
# Replies of different lengths: the batch shrinks row by row (6 rows padded to 8, then 4, 2, 1).
PARAMS = [dataclasses.replace(LONG, max_tokens=m) for m in (40, 13, 27, 6, 33, 21)]


def test_compiled_passes_at_bucketed_batch_sizes_decode_mlx_lms_tokens_on_a_gpus_path(tokenizer, monkeypatch):
    monkeypatch.setenv("MLXPAGED_COMPILE_BATCH", "8")
    calls = count_passes(monkeypatch)
    with backend.simulate("cuda"), tiny_engine(tiny_llama(), tokenizer, max_num_seqs=8) as engine:
        assert engine.runner.defers and engine.runner.decoder is not None
        pools = [engine.kv.keys[0], engine.kv.values[-1]]
        mx.eval(pools)
        first = [buffer_address(p) for p in pools]
        del pools
        got = engine.generate(PROMPTS, PARAMS)
        assert [buffer_address(p) for p in (engine.kv.keys[0], engine.kv.values[-1])] == first  # written in place
        assert_pool_empty(engine)
        for prompt, params, completion in zip(PROMPTS, PARAMS, got, strict=True):
            assert completion.token_ids == reference_tokens(engine.model, prompt, params.max_tokens)
    assert {6, 5, 4, 3, 2, 1} <= set(calls) and len(calls) >= max(p.max_tokens for p in PARAMS) - 2


# ---- MLXPAGED_RECORD_THREAD=1: the pass built ahead is queued from a thread of its own (runner/recorder.py) --------


@pytest.fixture(params=["cuda", "cpu"])
def recording_engine(request, tokenizer, monkeypatch):
    """An engine whose queued-ahead passes the recorder thread queues: on the GPU's path (deferred writes, queued
    before the step is read) and on the CPU's (built ahead, queued once the step is read); every recording counted."""
    monkeypatch.setenv("MLXPAGED_RECORD_THREAD", "1")
    recorded: list[str] = []
    original = Recorder.record

    def counted(self, arrays):
        recorded.append(threading.current_thread().name)
        return original(self, arrays)

    monkeypatch.setattr(Recorder, "record", counted)
    with backend.simulate(request.param), tiny_engine(tiny_llama(), tokenizer, max_num_seqs=8) as engine:
        assert engine.runner.defers is (request.param == "cuda")
        engine.recorded = recorded
        yield engine
        assert_pool_empty(engine)
    assert not any(t.name.startswith(THREAD_NAME) for t in threading.enumerate())  # closed with its engine


def test_recorded_passes_decode_mlx_lms_tokens_alone_and_batched(recording_engine, monkeypatch):
    monkeypatch.setattr(model_runner, "MAX_PENDING", 5)  # several flushes of the pending K/V per reply
    monkeypatch.setattr(model_runner, "MAX_PENDING_BUFFERED", 5)
    engine = recording_engine
    built = []
    look_ahead = model_runner.Runner._look_ahead
    monkeypatch.setattr(
        model_runner.Runner, "_look_ahead", lambda self, *a: built.append(look_ahead(self, *a)) or built[-1]
    )
    alone = engine.generate([PROMPTS[2]], LONG)[0]
    assert alone.token_ids == reference_tokens(engine.model, PROMPTS[2], LONG.max_tokens)
    got = engine.generate(PROMPTS, PARAMS)
    for prompt, params, completion in zip(PROMPTS, PARAMS, got, strict=True):
        assert completion.token_ids == reference_tokens(engine.model, prompt, params.max_tokens)
    # Every pass built ahead was queued by the recorder, handed over by the engine thread (the CPU's path builds none
    # for a compiled batch-1 pass: Tuning.pipeline_compiled).
    ahead = [b for b in built if b is not None]
    assert len(ahead) >= 30 and len(engine.recorded) == len(ahead)
    assert set(engine.recorded) == {"mlxpaged-engine"}


def test_recorded_seeded_sampling_and_logprobs_are_the_same(recording_engine, tokenizer):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True, logprobs=True)
    prompts = [random_tokens(10, seed=99), random_tokens(20, seed=98)]
    with tiny_engine(recording_engine.model, tokenizer) as plain:  # the CPU's path, no recorder
        want = plain.generate(prompts, params)
    got = recording_engine.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_requests_arriving_and_leaving_mid_run_with_a_recorder(recording_engine):
    """Requests arrive while others decode (the step settles the recorder, the pipeline stops and starts again), one
    is aborted mid-reply, one ends on a stop string, an n = 2 request forks (block copies): each reply is mlx-lm's."""
    engine = recording_engine
    prompts = [random_tokens(n, seed=400 + n) for n in (12, 30, 5, 21)]
    results: list = [None] * len(prompts)
    started = [threading.Event() for _ in prompts]

    def run(i):
        tokens = []
        for delta in engine.stream(prompts[i], LONG):
            if delta.token_id is not None:
                tokens.append(delta.token_id)
                if len(tokens) == 3:
                    started[i].set()
        started[i].set()
        results[i] = tokens

    threads = []
    for i in range(len(prompts)):
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        started[i].wait(timeout=60)
    left = engine.stream(random_tokens(9, seed=77), LONG)
    for _ in zip(range(4), left, strict=False):
        pass
    left.close()  # the client hangs up mid-reply
    forked = engine.generate([prompts[0]], dataclasses.replace(LONG, n=2, max_tokens=12))
    for t in threads:
        t.join(timeout=120)
    for prompt, got in zip(prompts, results, strict=True):
        assert got == reference_tokens(engine.model, prompt, LONG.max_tokens)
    assert [c.token_ids for c in forked] == [reference_tokens(engine.model, prompts[0], 12)] * 2


def test_a_recording_that_fails_fails_its_requests_and_the_engine_serves_on(recording_engine, monkeypatch):
    engine = recording_engine
    calls = []

    def fails_once(*arrays):
        calls.append(threading.current_thread().name.startswith(THREAD_NAME))
        if calls.count(True) == 2:  # the second pass queued ahead by the recorder thread
            raise RuntimeError("the device refused the graph")
        return real(*arrays)

    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", fails_once)
    with pytest.raises(RuntimeError, match="the device refused the graph"):
        engine.generate([random_tokens(14, seed=3), random_tokens(6, seed=5)], LONG)  # batch 2: built ahead on both
    monkeypatch.undo()
    prompt = random_tokens(15, seed=4)
    assert engine.generate([prompt], LONG)[0].token_ids == reference_tokens(engine.model, prompt, LONG.max_tokens)


def test_the_engine_thread_evaluates_nothing_while_a_pass_is_recorded_but_the_copy_it_reads(
    recording_engine, monkeypatch
):
    """The recorder's rules (runner/recorder.py), checked where a race would not show: each recording is slowed to
    20 ms, and meanwhile the engine thread may build the next pass and read a sample's separate copy of its tokens
    (it does both: that overlap is what the lever is for), never launch, evaluate, or read anything else, through
    replies of different lengths and an n = 2 fork."""
    engine = recording_engine
    copies: set[int] = set()
    overlapped, broken = [], []
    init = sampling.LazySample.__init__

    def noted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self._read is not self.tokens:
            copies.add(id(self._read))

    def guarded(real, what):
        def call(*args, **kwargs):
            name = threading.current_thread().name
            if name.startswith(THREAD_NAME) and what == "async_eval":
                time.sleep(0.02)
            elif name == "mlxpaged-engine" and engine.runner.recorder.busy:
                if what == "tolist" and id(args[0]) in copies:
                    overlapped.append(what)
                else:
                    broken.append(what)
            return real(*args, **kwargs)

        return call

    look_ahead = model_runner.Runner._look_ahead

    def building(self, *args):
        if self.recorder.busy:
            overlapped.append("build")
        return look_ahead(self, *args)

    monkeypatch.setattr(model_runner.Runner, "_look_ahead", building)
    monkeypatch.setattr(sampling.LazySample, "__init__", noted)
    for what in ("async_eval", "eval"):
        monkeypatch.setattr(mx, what, guarded(getattr(mx, what), what))
    for what in ("tolist", "item"):
        monkeypatch.setattr(mx.array, what, guarded(getattr(mx.array, what), what))
    got = engine.generate(PROMPTS, PARAMS)
    forked = engine.generate([PROMPTS[1]], dataclasses.replace(LONG, n=2, max_tokens=12))
    monkeypatch.undo()
    assert broken == []
    # The next pass is built while one records; on a GPU's path the step before is also read meanwhile (on the CPU's,
    # a pass is queued once its step is read).
    assert overlapped.count("build") >= 10
    assert overlapped.count("tolist") >= (10 if engine.runner.defers else 0)
    for prompt, params, completion in zip(PROMPTS, PARAMS, got, strict=True):
        assert completion.token_ids == reference_tokens(engine.model, prompt, params.max_tokens)
    assert [c.token_ids for c in forked] == [reference_tokens(engine.model, PROMPTS[1], 12)] * 2


def test_both_levers_at_once_decode_mlx_lms_tokens(tokenizer, monkeypatch):
    """Compiled passes at bucketed batch sizes, built ahead and queued by the recorder thread once the step is read."""
    monkeypatch.setenv("MLXPAGED_COMPILE_BATCH", "8")
    monkeypatch.setenv("MLXPAGED_RECORD_THREAD", "1")
    calls = count_passes(monkeypatch)
    with backend.simulate("cuda"), tiny_engine(tiny_llama(), tokenizer, max_num_seqs=8) as engine:
        got = engine.generate(PROMPTS, PARAMS)
        assert engine.runner.recorder is not None
        for prompt, params, completion in zip(PROMPTS, PARAMS, got, strict=True):
            assert completion.token_ids == reference_tokens(engine.model, prompt, params.max_tokens)
        assert_pool_empty(engine)
    assert {6, 5, 4, 3, 2, 1} <= set(calls)
