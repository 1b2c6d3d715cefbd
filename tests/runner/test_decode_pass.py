"""The compiled decode pass (mlxpaged/runner/decode_pass.py) against the eager pass, mlx-lm and the NumPy oracle."""

from __future__ import annotations

import dataclasses

from mlxpaged.engine.engine import Engine
from mlxpaged.engine.output_processor import OutputProcessor
from mlxpaged.kernels import cpu_attention
from mlxpaged.kernels.attention import attention_backend, decode_attention
from mlxpaged.kernels.reference import page_rows
from mlxpaged.runner.decode_pass import MIN_PAGES, CompiledDecode, batch_bucket, compiled_rows_asked, page_bucket
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_engine import (  # noqa: F401  (the fixtures, shared)
    GREEDY,
    assert_pool_empty,
    assert_same_completions,
    reference_tokens,
    tiny,
    tiny_engine,
    tokenizer,
)
from tests.msl.oracle import make_decode_case, max_error
from tests.tiny_models import random_tokens, tiny_llama

import mlx.core as mx
import numpy as np
import pytest

SEEDED = SamplingParams(
    temperature=0.9, top_k=40, seed=3, max_tokens=40, ignore_eos=True, logprobs=True, top_logprobs=2
)


def count_passes(monkeypatch) -> list[int]:
    """Counts compiled passes (one entry per call, the batch size)."""
    calls: list[int] = []
    original = CompiledDecode.__call__

    def counted(self, starts, tables, tokens, *rest):
        calls.append(len(starts))
        return original(self, starts, tables, tokens, *rest)

    monkeypatch.setattr(CompiledDecode, "__call__", counted)
    return calls


def test_page_buckets_pad_by_at_most_a_quarter_with_four_graphs_per_doubling():
    buckets = [page_bucket(n) for n in range(1, 5000)]
    assert buckets[:MIN_PAGES] == [MIN_PAGES] * MIN_PAGES
    assert all(b >= n for n, b in zip(range(1, 5000), buckets, strict=True))
    assert all(b <= 1.25 * n for n, b in zip(range(MIN_PAGES + 1, 5000), buckets[MIN_PAGES:], strict=True))
    assert buckets == sorted(buckets)
    for k in range(4, 12):
        assert len({page_bucket(n) for n in range(2**k + 1, 2 ** (k + 1) + 1)}) == 4


def test_batch_buckets_are_powers_of_two_to_eight_then_multiples_of_eight():
    assert [batch_bucket(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert [batch_bucket(n) for n in (16, 17, 24, 25, 64, 65)] == [16, 24, 24, 32, 64, 72]
    assert len({batch_bucket(n) for n in range(1, 65)}) == 11  # 64 sizes, 11 graphs per page bucket


def test_the_compiled_batch_lever_reads_its_environment(monkeypatch):
    monkeypatch.delenv("MLXPAGED_COMPILE_BATCH", raising=False)
    assert compiled_rows_asked() is None
    monkeypatch.setenv("MLXPAGED_COMPILE_BATCH", "64")
    assert compiled_rows_asked() == 64
    monkeypatch.setenv("MLXPAGED_COMPILE_BATCH", "many")
    with pytest.raises(ValueError, match="MLXPAGED_COMPILE_BATCH must be a whole number"):
        compiled_rows_asked()


def test_passes_padded_to_their_batch_bucket_equal_eager_passes(tiny, monkeypatch):
    """Five prompts that end one after another decode at 5, 4, 3, 2 and 1 rows: compiled, every batch of several rows
    runs padded to 8, 4 or 2 rows (copies of its first row that write only what that row writes), tracing one graph
    per bucket; the tokens and logprobs are the eager passes', and no block is left written or owned."""
    prompts = [random_tokens(n, seed=n) for n in (5, 19, 40, 11, 70)]
    original = CompiledDecode._trace_rows
    for base in (dataclasses.replace(GREEDY, max_tokens=24), dataclasses.replace(SEEDED, max_tokens=24)):
        params = [dataclasses.replace(base, max_tokens=base.max_tokens - 4 * i) for i in range(len(prompts))]
        monkeypatch.setattr(tiny.runner, "decoder", None)
        eager = tiny.generate(prompts, params)
        traced: list[int] = []

        def tracing(self, *args, traced=traced):
            traced.append(args[0].shape[0])  # the rows the graph is traced for
            return original(self, *args)

        monkeypatch.setattr(CompiledDecode, "_trace_rows", tracing)
        decoder = CompiledDecode(tiny.model, tiny.kv, tiny.runner.head)  # a fresh function: no traces yet
        monkeypatch.setattr(tiny.runner, "decoder", decoder)
        monkeypatch.setattr(tiny.runner, "_compiled_rows", 8)
        calls = count_passes(monkeypatch)
        got = tiny.generate(prompts, params)
        assert {5, 4, 3, 2, 1} <= set(calls)
        assert sorted(set(traced)) == [2, 4, 8] and len(traced) == len(set(traced))  # one page bucket here
        assert_same_completions(got, eager)
        monkeypatch.undo()
    assert_pool_empty(tiny)


def padded_inputs(case, width: int) -> tuple[mx.array, mx.array]:
    """Page rows and key mask as a compiled pass builds them: tables padded to `width` pages."""
    block_size = case.k_pool.shape[2]
    tables = []
    for table, n in zip(case.tables_np, case.lens, strict=True):
        used = list(table[: -(-n // block_size)])
        tables.append(used + [used[-1]] * (width - len(used)))
    tables = mx.array(np.asarray(tables, dtype=np.int32))
    mask = np.arange(width * block_size)[None, :] < np.asarray(case.lens)[:, None]
    return page_rows(tables, case.k_pool.shape, clip=False), mx.array(mask[:, None, None, :])


@pytest.mark.parametrize("backend,min_keys", [("cpu", 0), ("cpu", 1 << 30), ("reference", 0)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (9, 3, 64), (4, 4, 128)])
def test_decode_attention_from_arrays_matches_the_oracle(monkeypatch, backend, min_keys, heads, kv_heads, head_dim):
    """Gathered (small) and gather_mm (large) paths, padded past each sequence, eager and compiled."""
    monkeypatch.setattr(cpu_attention, "GATHER_MM_MIN_KEYS", min_keys)
    case = make_decode_case(11, [40, 1, 17], heads, kv_heads, head_dim, 8, spare_blocks=6)
    rows, mask = padded_inputs(case, width=8)
    with attention_backend(backend):
        eager = decode_attention(case.q, case.k_pool, case.v_pool, rows, mask, case.scale)
        compiled = mx.compile(lambda *a: decode_attention(*a, case.scale))(case.q, case.k_pool, case.v_pool, rows, mask)
    assert max_error(eager, case.expected()) < 1e-5
    assert max_error(compiled, case.expected()) < 1e-5


def test_decode_attention_reads_only_unmasked_keys():
    """Planted bug: a mask that lets the padding through must be caught by the oracle."""
    case = make_decode_case(12, [9, 30], 8, 2, 64, 8, spare_blocks=6)
    rows, mask = padded_inputs(case, width=6)
    leaky = mx.ones_like(mask)
    assert (
        max_error(decode_attention(case.q, case.k_pool, case.v_pool, rows, leaky, case.scale), case.expected()) > 1e-2
    )


def test_compiled_passes_equal_eager_passes(tiny, monkeypatch):
    """Greedy and seeded sampling with logprobs: the same tokens whether batch-1 decode passes run
    compiled or eager, and the compiled passes really ran."""
    compiled = tiny.runner.decoder
    assert compiled is not None
    prompts = [random_tokens(n, seed=n) for n in (5, 19, 70)]
    for params in (dataclasses.replace(GREEDY, max_tokens=40), SEEDED):
        monkeypatch.setattr(tiny.runner, "decoder", None)
        eager = [tiny.generate([p], params)[0] for p in prompts]
        monkeypatch.setattr(tiny.runner, "decoder", compiled)
        calls = count_passes(monkeypatch)
        got = [tiny.generate([p], params)[0] for p in prompts]
        assert len(calls) >= len(prompts) * (params.max_tokens - 2) and set(calls) == {1}
        assert_same_completions(got, eager)
        monkeypatch.undo()
    assert_pool_empty(tiny)


def test_compiled_passes_match_mlx_lm_on_the_real_model(default_loaded, monkeypatch):
    from mlxpaged.config import CacheConfig
    from mlxpaged.loading.loader import chat_prompt

    calls = count_passes(monkeypatch)
    with Engine(default_loaded, CacheConfig(cache_tokens=4096)) as engine:
        # One reply across several page buckets (each a trace of its own); a second prompt added ~15 s and no path.
        prompt = chat_prompt(engine.tokenizer, [{"role": "user", "content": "Count from one to twenty in words."}])
        got = engine.generate([prompt], dataclasses.replace(GREEDY, max_tokens=120))[0].token_ids
        assert got == reference_tokens(engine.model, prompt, 120)
        assert len(calls) >= 118


def test_a_growing_context_retraces_once_per_bucket(tiny, monkeypatch):
    traces = []
    original = CompiledDecode._trace
    monkeypatch.setattr(CompiledDecode, "_trace", lambda self, *a: traces.append(a[2].shape) or original(self, *a))
    decoder = CompiledDecode(tiny.model, tiny.kv, tiny.runner.head)  # a fresh function: no traces yet
    monkeypatch.setattr(tiny.runner, "decoder", decoder)
    tiny.generate([random_tokens(3, seed=1)], dataclasses.replace(GREEDY, max_tokens=200))
    block_size = tiny.kv.block_size
    widths = sorted({page_bucket(-(-n // block_size)) for n in range(4, 204)})
    assert [shape[1] for shape in traces] == widths  # 8, 10, 12, ..., 26 pages: one trace each


def buffer_address(array: mx.array) -> int:
    return np.asarray(memoryview(array)).ctypes.data


@pytest.mark.parametrize("compiled", [True, False])
def test_decode_writes_update_the_pools_in_place(tiny, monkeypatch, compiled):
    """A pass's page writes must not copy the pools (MLX copies an array it cannot update in place,
    e.g. while anything else still refers to it): after every step, alone and batched (pipelined;
    compiled too here), the pools are still the buffers they were."""

    if compiled:
        monkeypatch.setattr(tiny.runner, "tuning", dataclasses.replace(tiny.runner.tuning, compiled_decode_max_batch=2))
    else:
        monkeypatch.setattr(tiny.runner, "decoder", None)
    pools = [tiny.kv.keys[0], tiny.kv.values[-1]]
    mx.eval(pools)
    first = [buffer_address(p) for p in pools]
    del pools
    seen = []
    process = OutputProcessor.process

    def recorded(self, *args):
        process(self, *args)
        seen.append([buffer_address(p) for p in (tiny.kv.keys[0], tiny.kv.values[-1])])

    monkeypatch.setattr(OutputProcessor, "process", recorded)
    prompts = [random_tokens(n, seed=n) for n in (9, 30)]
    tiny.generate(prompts[:1], dataclasses.replace(GREEDY, max_tokens=30))
    tiny.generate(prompts, dataclasses.replace(GREEDY, max_tokens=30))
    assert len(seen) >= 58 and all(addresses == first for addresses in seen)


def test_a_model_whose_pass_cannot_be_compiled_decodes_eagerly(tokenizer, monkeypatch):
    def fails(self):
        raise TypeError("cannot trace this attention")

    monkeypatch.setattr(CompiledDecode, "warm_up", fails)
    model = tiny_llama()
    prompt = random_tokens(12, seed=5)
    with pytest.warns(RuntimeWarning, match="compiled decode is off"), tiny_engine(model, tokenizer) as engine:
        got = engine.generate([prompt], GREEDY)[0].token_ids
        assert engine.runner.decoder is None
    assert got == reference_tokens(model, prompt, GREEDY.max_tokens)
