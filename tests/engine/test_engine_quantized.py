"""The engine on quantized pages (kv_bits): mlx-lm's tokens over the same quantized K/V, and every feature
that shares, copies or recomputes pages (prefix cache, forks, preemption, speculation, a hybrid model)."""

from __future__ import annotations

import dataclasses

import mlxpaged  # noqa: F401
from mlxpaged.cache.quantized_pages import QuantizedPages
from mlxpaged.config import CacheConfig
from mlxpaged.engine.engine import Engine
from mlxpaged.errors import ConfigError
from mlxpaged.kernels import cpu_attention, quantized_attention
from mlxpaged.platform import backend
from mlxpaged.sampling_params import SamplingParams
from tests.archs.quantized_reference import quantized_greedy
from tests.engine.test_engine import GREEDY, assert_pool_empty, tiny_engine, tokenizer  # noqa: F401
from tests.engine.test_speculative import oracle
from tests.tiny_models import random_tokens, tiny_llama

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache

PROMPTS = [random_tokens(n, seed=s) for s, n in enumerate((30, 9, 21))]


def qkv_cache_greedy(model, prompt: list[int], max_tokens: int, bits: int, group: int = 64) -> list[int]:
    """mlx-lm's own QuantizedKVCache from the first token (the prompt fed token by token)."""
    cache = [QuantizedKVCache(group_size=group, bits=bits) for _ in model.layers]
    for token in prompt[:-1]:
        model(mx.array([[token]]), cache=cache)
    out, last = [], prompt[-1]
    for _ in range(max_tokens):
        last = int(mx.argmax(model(mx.array([[last]]), cache=cache)[0, -1]).item())
        out.append(last)
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_llama(head_dim=64)


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 64), (4, 32)])
def test_ragged_batch_equals_mlx_lm_over_quantized_kv(model, tokenizer, bits, group):
    scored = dataclasses.replace(GREEDY, logprobs=True)
    with tiny_engine(model, tokenizer, kv_bits=bits, kv_group_size=group) as engine:
        completions = engine.generate(PROMPTS, scored)
        got = [c.token_ids for c in completions]
        pools = engine.kv.keys + engine.kv.values
        assert all(isinstance(p, QuantizedPages) and p.bits == bits for p in pools)
        assert engine.runner.decoder is not None  # the compiled decode pass ran on quantized pools
        assert_pool_empty(engine)
        transform = engine.kv.transform  # 4-bit pages: K/V in calibrated coordinates (kv_transform.py)
    assert (transform is not None) == (bits == 4)
    assert got == [quantized_greedy(model, p, GREEDY.max_tokens, bits, group, transform=transform)[0] for p in PROMPTS]
    if transform is None:  # mlx-lm's QuantizedKVCache stores K/V as the model gives them
        assert got == [qkv_cache_greedy(model, p, GREEDY.max_tokens, bits, group) for p in PROMPTS]
    with tiny_engine(model, tokenizer) as full:  # and quantization did change something
        plain = full.generate(PROMPTS, scored)
    changed = [c.logprobs != pytest.approx(f.logprobs, abs=1e-5) for c, f in zip(completions, plain, strict=True)]
    assert any(changed)


@pytest.mark.parametrize("bits,group", [(8, 64), (4, 64), (4, 32)])
def test_the_cpu_paths_unpacked_levels_give_the_quantized_matmuls_tokens(model, tokenizer, bits, group, monkeypatch):
    """The CPU path's decode over quantized pages (integer levels through float32 matmuls; 4-bit at every length
    here) against its twin, the reference path's quantized matmuls: the same greedy tokens and log-probs, batched
    (eager passes) and batch 1 (the compiled pass)."""
    scored = dataclasses.replace(GREEDY, logprobs=True)
    monkeypatch.setenv("MLXPAGED_ATTENTION", "reference")
    with tiny_engine(model, tokenizer, kv_bits=bits, kv_group_size=group) as twin:
        want = twin.generate(PROMPTS, scored) + [twin.generate([p], scored)[0] for p in PROMPTS]
    monkeypatch.setenv("MLXPAGED_ATTENTION", "cpu")
    monkeypatch.setattr(quantized_attention, "UNPACKED_4BIT_MIN_KEYS", 0)
    calls = []
    real = cpu_attention.attend_quantized_unpacked
    monkeypatch.setattr(cpu_attention, "attend_quantized_unpacked", lambda *a, **k: calls.append(1) or real(*a, **k))
    with tiny_engine(model, tokenizer, kv_bits=bits, kv_group_size=group) as engine:
        assert engine.built.attention.status()["path"] == "cpu" and engine.runner.decoder is not None
        got = engine.generate(PROMPTS, scored) + [engine.generate([p], scored)[0] for p in PROMPTS]
    assert calls  # the unpacked form attended
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    # Log-probs within 1e-2, not float32 rounding: the two forms differ by ~1e-7 in a layer's output, and a K/V
    # element that lies near a level boundary then rounds to the other level when the next token is written
    # (seen: 1.2e-3 at 4 bits; 3.0e-2 at 4 bits in calibrated coordinates, kv_transform.py, whose rotation spreads
    # a flipped level over the whole row). tests/kernels/test_quantized_unpacked.py compares them over the same
    # pages to 1e-5.
    for c, w in zip(got, want, strict=True):
        assert c.logprobs == pytest.approx(w.logprobs, abs=1e-2 if bits == 8 else 6e-2)


def test_eager_decode_equals_the_compiled_pass(model, tokenizer, monkeypatch):
    with tiny_engine(model, tokenizer, kv_bits=8) as engine:
        compiled = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    monkeypatch.setenv("MLXPAGED_COMPILE", "0")
    with tiny_engine(model, tokenizer, kv_bits=8) as engine:
        assert engine.runner.decoder is None
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == compiled


def test_prefix_hits_forks_and_preemption_on_quantized_pages(model, tokenizer):
    params = dataclasses.replace(GREEDY, max_tokens=30)
    with tiny_engine(model, tokenizer, kv_bits=4) as engine:
        cold = [c.token_ids for c in engine.generate(PROMPTS, params)]
        warm = engine.generate(PROMPTS, params)  # the prompts' full blocks come from the prefix cache
        assert [c.token_ids for c in warm] == cold and sum(c.cached_tokens for c in warm) >= 16 + 8
        sampled = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=12, ignore_eos=True)
        forked = engine.generate([PROMPTS[2]], sampled)  # 21 tokens: a partial block copied on write
        assert len({tuple(c.token_ids) for c in forked}) == 3
        assert [c.token_ids for c in engine.generate([PROMPTS[2]], sampled)] == [c.token_ids for c in forked]
        assert_pool_empty(engine)
    with tiny_engine(model, tokenizer, kv_bits=4, cache_tokens=64, max_num_seqs=3, enable_prefix_cache=False) as tight:
        assert [c.token_ids for c in tight.generate(PROMPTS, params)] == cold
        assert tight.stats()["preemptions"] > 0


def test_speculation_on_quantized_pages_equals_plain_decoding(model, tokenizer, monkeypatch):
    with tiny_engine(model, tokenizer, kv_bits=8) as plain:
        want = [c.token_ids for c in plain.generate(PROMPTS, GREEDY)]
    # Drafts from the known continuations, one token wrong now and then: some kept, some rolled back.
    oracle(monkeypatch, [p + w for p, w in zip(PROMPTS, want, strict=True)])
    with tiny_engine(model, tokenizer, kv_bits=8, speculative="ngram") as spec:
        assert [c.token_ids for c in spec.generate(PROMPTS, GREEDY)] == want
        stats = spec.core.speculator.stats
        assert 0 < stats.accepted_tokens < stats.draft_tokens


def test_a_hybrid_window_model_equals_its_quantized_twin(tokenizer):
    types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    hybrid = tiny_llama(4, 0, layer_types=types, sliding_window=8, head_dim=64)
    with tiny_engine(hybrid, tokenizer, kv_bits=8) as engine:
        got = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
        assert {spec.window for spec in engine.kv.specs} == {None, 8}  # window and full layers
    assert got == [quantized_greedy(hybrid, p, GREEDY.max_tokens, 8)[0] for p in PROMPTS]


def test_a_head_width_that_groups_cannot_split_is_refused_before_the_pools(tokenizer):
    with pytest.raises(ConfigError, match=r"widths include 16 .*multiple of 64"):
        tiny_engine(tiny_llama(), tokenizer, kv_bits=8)


@pytest.mark.parametrize("simulated", ["cuda", "metal"])
def test_gpu_paths_keep_no_full_precision_tail_and_equal_the_twin(model, tokenizer, simulated):
    """On a GPU the pipelined decode would keep its newest K/V off the pools in full precision
    (deferred_writes.py): with quantized pages it does not pipeline, and the fused / reference paths read
    the quantized pages only."""
    with backend.simulate(simulated), tiny_engine(model, tokenizer, kv_bits=8) as engine:
        assert not engine.runner.defers and engine.runner.decoder is None
        assert engine.built.attention.status()["path"] in ("fused", "reference")
        got = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    assert got == [quantized_greedy(model, p, GREEDY.max_tokens, 8)[0] for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_the_embedded_model_on_quantized_pages_still_answers_a_plain_question(default_loaded, bits):
    """Seen by hand in session 9: with min-max 4-bit groups the embedded model answered "What is the capital of
    France?" with "La femme de France, ..." (full precision and 8-bit: "The capital of France is Paris."); with
    least-squares groups (cache/group_fit.py) it answers as at full precision."""
    tokenizer = default_loaded.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    params = SamplingParams(temperature=0.0, max_tokens=12)
    with Engine(default_loaded, CacheConfig(cache_tokens=1024, kv_bits=bits)) as engine:
        assert engine.kv.quantization is not None and engine.kv.quantization.bits == bits
        reply = tokenizer.decode(engine.generate([prompt], params)[0].token_ids)
    assert "Paris" in reply, reply
