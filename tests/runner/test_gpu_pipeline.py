"""The path a GPU takes (platform/backend.py simulated as CUDA, MLX still computing on the CPU):
decode queued before the last step is read, with its K/V kept off the pools (runner/deferred_writes.py),
checked against mlx-lm token for token, for blocking syncs per step, and for pools updated in place."""

from __future__ import annotations

import dataclasses
import itertools
import threading

from mlxpaged.engine.core import EngineCore
from mlxpaged.platform import backend
from mlxpaged.runner import decode_buffers, deferred_writes, model_runner
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_engine import (
    GREEDY,
    assert_pool_empty,
    reference_tokens,
    tiny_engine,
    tokenizer,  # noqa: F401  (the fixture, shared)
)
from tests.runner.test_decode_pass import buffer_address
from tests.tiny_models import random_tokens, tiny_llama, tiny_qwen3

import mlx.core as mx
import numpy as np
import pytest

LONG = dataclasses.replace(GREEDY, max_tokens=40)


@pytest.fixture(scope="module")
def gpu_engine(tokenizer):
    model = tiny_llama()
    with backend.simulate("cuda"), tiny_engine(model, tokenizer, max_num_seqs=8) as eng:
        assert eng.runner.defers and eng.runner.decoder is None
        yield eng
        assert_pool_empty(eng)


@pytest.fixture
def short_run(monkeypatch):
    """Flush the pending K/V every 5 tokens, so a reply crosses several flushes."""
    monkeypatch.setattr(model_runner, "MAX_PENDING", 5)
    monkeypatch.setattr(model_runner, "MAX_PENDING_BUFFERED", 5)


def test_gpu_backends_pipeline_ahead_of_the_read_and_the_cpu_does_not(tokenizer):
    for name, defers in (("cuda", True), ("metal", True), ("cpu", False)):
        with backend.simulate(name), tiny_engine(tiny_llama(), tokenizer) as eng:
            assert eng.runner.defers is defers, name


@pytest.mark.parametrize("length", [1, 7, 8, 9, 30])
def test_queued_ahead_decode_matches_mlx_lm(gpu_engine, short_run, length):
    prompt = random_tokens(length, seed=length)
    got = gpu_engine.generate([prompt], LONG)[0]
    assert got.token_ids == reference_tokens(gpu_engine.model, prompt, LONG.max_tokens)


def test_a_batch_one_buffer_that_grows_mid_run_matches_mlx_lm(gpu_engine, monkeypatch):
    """Batch 1 keeps each layer's K/V in one buffer per run: grown every 3 columns here (256 in use) and flushed
    every 11 tokens, the reply crosses many growths, flushes and buffers made again from the pages."""
    monkeypatch.setattr(decode_buffers, "BUFFER_STEP", 3)
    monkeypatch.setattr(model_runner, "MAX_PENDING_BUFFERED", 11)
    prompt = random_tokens(14, seed=41)
    assert gpu_engine.generate([prompt], LONG)[0].token_ids == reference_tokens(gpu_engine.model, prompt, 40)


def test_a_batch_one_pass_attends_its_buffer_unmasked(gpu_engine, monkeypatch):
    """The K/V a buffered batch-1 layer returns are exactly the sequence's (no padding, so no mask is needed):
    the pages gathered once, then one column written per pass."""
    prompt = random_tokens(9, seed=42)
    seen = []
    original = deferred_writes.DeferredPass._buffered

    def spy(self, layer, keys, values):
        out = original(self, layer, keys, values)
        if layer == 0:
            seen.append((self.ends[0], out[0].shape[2], self.buffers[0][0].shape[2]))
        return out

    monkeypatch.setattr(deferred_writes.DeferredPass, "_buffered", spy)
    gpu_engine.generate([prompt], dataclasses.replace(LONG, max_tokens=12))
    assert seen, "no buffered pass ran"
    assert all(attended == end and capacity % decode_buffers.BUFFER_STEP == 0 for end, attended, capacity in seen)


def test_batched_queued_ahead_decode_equals_mlx_lm_per_prompt(gpu_engine, short_run):
    prompts = [random_tokens(n, seed=n) for n in (3, 17, 40, 5, 64, 12, 33, 9)]
    # Different lengths: rows leave the run at different steps and their pending K/V become orphans.
    params = [dataclasses.replace(LONG, max_tokens=m) for m in (40, 13, 27, 6, 40, 21, 33, 9)]
    got = gpu_engine.generate(prompts, params)
    for prompt, p, completion in zip(prompts, params, got, strict=True):
        assert completion.token_ids == reference_tokens(gpu_engine.model, prompt, p.max_tokens)


def test_a_reply_written_while_pipelined_is_a_correct_prefix_hit(gpu_engine, short_run):
    """The reply's K/V reach the pools after it ends (orphaned pending rows): the next turn, which reuses
    the reply's full blocks from the prefix cache, must answer as a cold run does."""
    prompt = random_tokens(21, seed=5)
    first = gpu_engine.generate([prompt], LONG)[0]
    turn = prompt + first.token_ids + random_tokens(6, seed=6)
    warm = gpu_engine.generate([turn], LONG)[0]
    assert warm.cached_tokens >= len(prompt) + len(first.token_ids) - 16
    gpu_engine.pool.reset_prefix_cache()
    cold = gpu_engine.generate([turn], LONG)[0]
    assert warm.token_ids == cold.token_ids == reference_tokens(gpu_engine.model, turn, LONG.max_tokens)


def test_a_reply_that_ends_while_others_decode_is_a_correct_prefix_hit(gpu_engine, short_run):
    """A row that leaves a running batch keeps its last K/V pending (an orphan) until the pipeline stops;
    they must reach its blocks before its next turn reads them from the prefix cache."""
    short, long = random_tokens(19, seed=7), random_tokens(11, seed=8)
    params = [dataclasses.replace(LONG, max_tokens=23), dataclasses.replace(LONG, max_tokens=40)]
    first = gpu_engine.generate([short, long], params)[0]
    turn = short + first.token_ids + random_tokens(3, seed=9)
    warm = gpu_engine.generate([turn], LONG)[0]
    assert warm.cached_tokens >= len(short) + len(first.token_ids) - 8
    assert warm.token_ids == reference_tokens(gpu_engine.model, turn, LONG.max_tokens)


def test_requests_arriving_mid_run_stop_and_restart_the_pipeline(gpu_engine, short_run):
    """Each request arrives while the earlier ones decode (a new request stops the pipeline: the queued
    pass is waited for, the pending K/V written, then the next run queues ahead again)."""
    prompts = [random_tokens(n, seed=100 + n) for n in (12, 30, 5)]
    results: list = [None] * len(prompts)
    started = [threading.Event() for _ in prompts]

    def run(i):
        stream = gpu_engine.stream(prompts[i], LONG)
        tokens = []
        for delta in stream:
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
    for t in threads:
        t.join(timeout=120)
    for prompt, got in zip(prompts, results, strict=True):
        assert got == reference_tokens(gpu_engine.model, prompt, LONG.max_tokens)


def test_seeded_sampling_is_the_same_queued_ahead(tokenizer):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True, logprobs=True)
    prompts = [random_tokens(10, seed=99), random_tokens(20, seed=98)]
    model = tiny_qwen3()
    with tiny_engine(model, tokenizer) as cpu_engine:
        want = cpu_engine.generate(prompts, params)
    with backend.simulate("cuda"), tiny_engine(model, tokenizer) as gpu:
        got = gpu.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_pools_are_updated_in_place_while_pipelined(gpu_engine, short_run):
    pools = [gpu_engine.kv.keys[0], gpu_engine.kv.values[-1]]
    mx.eval(pools)
    first = [buffer_address(p) for p in pools]
    del pools
    gpu_engine.generate([random_tokens(n, seed=n) for n in (9, 30, 4)], LONG)
    assert [buffer_address(p) for p in (gpu_engine.kv.keys[0], gpu_engine.kv.values[-1])] == first


class SyncLog:
    """Records, on the engine thread, each step's start and every MLX launch and blocking read."""

    def __init__(self, monkeypatch):
        self.events: list[str] = []
        self._main = threading.get_ident()
        self._patch(monkeypatch)

    def _note(self, what: str) -> None:
        if threading.get_ident() != self._main:
            self.events.append(what)

    def _patch(self, monkeypatch) -> None:
        def wrap(owner, name, label, arrays_only=False):
            original = getattr(owner, name)

            def recorded(*args, **kwargs):
                if not arrays_only or any(isinstance(a, mx.array) for a in args):
                    self._note(label)
                return original(*args, **kwargs)

            monkeypatch.setattr(owner, name, recorded)

        wrap(mx, "eval", "read")
        wrap(mx, "async_eval", "launch")
        wrap(mx.array, "item", "read")
        wrap(mx.array, "tolist", "read")
        wrap(np, "asarray", "read", arrays_only=True)
        wrap(np, "array", "read", arrays_only=True)
        wrap(EngineCore, "step", "step")
        wrap(model_runner.Runner, "_launch_pass", "pass")

    def steps(self) -> list[list[str]]:
        """The events of each step, in order."""
        steps: list[list[str]] = []
        for event in self.events:
            if event == "step":
                steps.append([])
            elif steps:
                steps[-1].append(event)
        return [s for s in steps if s]


@pytest.mark.parametrize("batch", [1, 8])
def test_a_decode_step_reads_once_after_queuing_the_next(gpu_engine, monkeypatch, batch):
    """mlx-lm's generate_step order: queue step N+1, then read step N; one blocking read per step."""
    prompts = [random_tokens(6 + i, seed=200 + i) for i in range(batch)]
    params = dataclasses.replace(GREEDY, max_tokens=24)
    gpu_engine.generate(prompts, params)  # warm: nothing below is a first call
    log = SyncLog(monkeypatch)
    gpu_engine.generate(prompts, params)
    monkeypatch.undo()
    steps = log.steps()
    # After the prefill and the first tokens, before the last rows end; a step of a decode pass and a prefill pass
    # reads the first before launching the second (the test below).
    steady = [events for events in steps[3:-2] if events.count("pass") < 2]
    assert len(steady) >= 15, steps
    for events in steady:
        assert events.count("read") == 1, events
        assert events.index("launch") < events.index("read"), events


def test_a_step_of_several_passes_launches_each_once_the_one_before_is_done(gpu_engine, monkeypatch):
    """A pass's page writes queued while the pass before still reads the pools copy every pool they write (MLX
    updates in place only what no queued work holds; on the CPU backend that happened when its thread lagged,
    on a GPU it would on every step of a decode pass and a prefill chunk): each pass is read before the next."""
    prompts = [random_tokens(n, seed=300 + n) for n in (4, 9, 30)]  # two prefill passes (passes.py)
    log = SyncLog(monkeypatch)
    gpu_engine.generate(prompts, dataclasses.replace(GREEDY, max_tokens=4))
    monkeypatch.undo()
    several = [events for events in log.steps() if events.count("pass") > 1]
    assert several, log.steps()
    for events in several:
        starts = [i for i, event in enumerate(events) if event == "pass"]
        for before, after in itertools.pairwise(starts):
            assert "read" in events[before:after], events


@pytest.mark.parametrize("gpu", ["metal", "cuda"])
def test_on_a_gpu_the_kernel_attends_the_pools_and_the_pending_tail(tokenizer, monkeypatch, gpu):
    """Queued ahead on a GPU, the paged kernel (Metal's, or its CUDA twin forced on MLX's CUDA backend) still reads
    the pages in place and merges the K/V not written yet as one more partition (the kernel run by its CPU harness):
    tokens as mlx-lm's."""
    from mlxpaged.kernels import attention
    from mlxpaged.runner import routing
    from tests.msl.cuda_harness import CudaEmulator
    from tests.msl.harness import Emulator

    monkeypatch.setattr(model_runner, "MAX_PENDING", 4)
    monkeypatch.setattr(model_runner, "MAX_PENDING_BUFFERED", 4)
    merged = []
    original = routing.kernel_attention_with_tail

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        merged.append(out is not None)
        return out

    monkeypatch.setattr(routing, "kernel_attention_with_tail", counted)
    model = tiny_llama(2, head_dim=32)
    prompts = [random_tokens(n, seed=300 + n) for n in (9, 20)]
    params = dataclasses.replace(GREEDY, max_tokens=12)
    launcher = Emulator() if gpu == "metal" else CudaEmulator()
    with (
        backend.simulate(gpu),
        attention.kernel_launcher(launcher),
        attention.attention_backend("kernel"),  # CUDA's default is MLX's fused attention
        tiny_engine(model, tokenizer) as eng,
    ):
        status = attention.attention_status()
        assert eng.runner.defers and status["path"] == "kernel", status
        assert f"({'Metal' if gpu == 'metal' else 'CUDA'} source)" in status["reason"], status
        got = eng.generate(prompts, params)
    assert merged and all(merged)
    for prompt, completion in zip(prompts, got, strict=True):
        assert completion.token_ids == reference_tokens(model, prompt, params.max_tokens)


def test_a_step_that_fails_mid_run_fails_its_requests_and_the_engine_serves_on(gpu_engine, monkeypatch):
    """A step raising while a pipelined run holds pending K/V: its requests fail with the error, the queued
    pass is not waited for, and the next requests (one a prefix hit of the failed one's prompt) are exact."""
    from mlxpaged.errors import RequestFailedError

    calls = {"n": 0}
    original = model_runner.Runner._deferred_pass

    def failing(self, *args):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError("injected failure")
        return original(self, *args)

    prompt = random_tokens(26, seed=11)
    monkeypatch.setattr(model_runner.Runner, "_deferred_pass", failing)
    with pytest.raises(RequestFailedError, match="injected failure"):
        gpu_engine.generate([prompt, random_tokens(9, seed=12)], LONG)
    monkeypatch.undo()
    again = gpu_engine.generate([prompt + random_tokens(4, seed=13)], LONG)[0]
    assert again.token_ids == reference_tokens(gpu_engine.model, prompt + random_tokens(4, seed=13), LONG.max_tokens)


def test_on_metal_a_shape_the_kernel_declines_attends_the_gathered_pages(tokenizer, monkeypatch):
    """Head dim 16 is no kernel shape: the queued-ahead pass gathers the pages for the calls the kernel declines."""
    from mlxpaged.kernels import attention
    from tests.msl.harness import Emulator

    monkeypatch.setattr(model_runner, "MAX_PENDING", 4)
    monkeypatch.setattr(model_runner, "MAX_PENDING_BUFFERED", 4)
    model = tiny_llama(2)  # head_dim 16
    prompt = random_tokens(13, seed=400)
    params = dataclasses.replace(GREEDY, max_tokens=12)
    with backend.simulate("metal"), attention.kernel_launcher(Emulator()), tiny_engine(model, tokenizer) as eng:
        assert eng.runner.defers
        got = eng.generate([prompt], params)[0]
    assert got.token_ids == reference_tokens(model, prompt, params.max_tokens)
