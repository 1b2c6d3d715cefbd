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
from tests.archs.quantized_reference import assert_equal_up_to_near_ties, assert_greedy_matches
from tests.engine.test_engine import GREEDY, assert_pool_empty, tiny_engine, tokenizer  # noqa: F401
from tests.engine.test_speculative import oracle
from tests.tiny_models import random_tokens, tiny_llama

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache

PROMPTS = [random_tokens(n, seed=s) for s, n in enumerate((30, 9, 21))]


def qkv_cache_greedy(model, prompt: list[int], max_tokens: int, bits: int, group: int) -> tuple[list[int], list]:
    """mlx-lm's own QuantizedKVCache from the first token (the prompt fed token by token): greedy tokens and
    each step's top-2 log-prob gap."""
    cache = [QuantizedKVCache(group_size=group, bits=bits) for _ in model.layers]
    for token in prompt[:-1]:
        model(mx.array([[token]]), cache=cache)
    out, gaps, last = [], [], prompt[-1]
    for _ in range(max_tokens):
        logits = model(mx.array([[last]]), cache=cache)[0, -1]
        top2 = mx.sort(logits - mx.logsumexp(logits))[-2:].tolist()
        last = int(mx.argmax(logits).item())
        out.append(last)
        gaps.append(top2[1] - top2[0])
    return out, gaps


@pytest.fixture(scope="module")
def model():
    return tiny_llama(head_dim=64)


@pytest.mark.parametrize("bits,group", [(8, 32), (8, 64), (4, 64), (4, 32)])
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
    # Up to near-ties: the engine prefills the three prompts in one ragged pass, the twins one prompt a pass.
    assert_greedy_matches(got, model, PROMPTS, bits, group_size=group, transform=transform)
    if transform is None:  # mlx-lm's QuantizedKVCache stores K/V as the model gives them
        mlx_lm_own = [qkv_cache_greedy(model, p, GREEDY.max_tokens, bits, group) for p in PROMPTS]
        assert_equal_up_to_near_ties(got, mlx_lm_own, bits)
    with tiny_engine(model, tokenizer) as full:  # and quantization did change something
        plain = full.generate(PROMPTS, scored)
    changed = [c.logprobs != pytest.approx(f.logprobs, abs=1e-5) for c, f in zip(completions, plain, strict=True)]
    assert any(changed)


@pytest.mark.parametrize("bits,group", [(8, 32), (8, 64), (4, 64), (4, 32)])
def test_the_cpu_paths_unpacked_levels_give_the_quantized_matmuls_output_over_the_engines_own_pages(
    model, tokenizer, bits, group, monkeypatch
):
    """The CPU path's decode over quantized pages (integer levels through float32 matmuls; 4-bit at every length
    here) against its twin, the reference path's quantized matmuls, over the same pages: at every decode call of a
    real run (batched, then batch 1), both forms attend the engine's own pages and must agree to float32 rounding.

    Not two engines side by side: their pages differ. The forms differ by ~1e-7 in a layer's output, and a K/V
    element near a level boundary then rounds to the other level when the next token is written (4-bit: log-probs
    0.09 apart after a few tokens under OpenBLAS's Haswell kernels, issue 41), so two runs compare their
    rounding, not the forms. tests/kernels/test_quantized_unpacked.py compares them on random pages too."""
    monkeypatch.setenv("MLXPAGED_ATTENTION", "cpu")
    monkeypatch.setenv("MLXPAGED_COMPILE", "0")  # eager passes: each call's output can be read where it is made
    monkeypatch.setattr(quantized_attention, "UNPACKED_4BIT_MIN_KEYS", 0)
    errors: list[float] = []
    real = cpu_attention.attend_quantized_unpacked

    def both_forms(q, k_pages, v_pages, rows, mask, scale, sinks=None):
        unpacked = real(q, k_pages, v_pages, rows, mask, scale, sinks)
        twin = quantized_attention.attend_quantized_pages(q, k_pages, v_pages, rows, mask, scale, sinks)
        errors.append((mx.abs(unpacked - twin).max() / mx.maximum(mx.abs(twin).max(), 1.0)).item())
        return unpacked

    monkeypatch.setattr(cpu_attention, "attend_quantized_unpacked", both_forms)
    with tiny_engine(model, tokenizer, kv_bits=bits, kv_group_size=group) as engine:
        assert engine.built.attention.status()["path"] == "cpu" and engine.kv.quantization.group_size == group
        batched = engine.generate(PROMPTS, GREEDY)
        calls = len(errors)
        alone = [engine.generate([p], GREEDY)[0] for p in PROMPTS]
        assert_pool_empty(engine)
    assert calls >= GREEDY.max_tokens and len(errors) >= calls + len(PROMPTS) * GREEDY.max_tokens  # every layer too
    assert max(errors) < 1e-5, max(errors)  # relative to the call's largest output (float32 sums over 64-256 keys)
    assert all(len(c.token_ids) == GREEDY.max_tokens for c in batched + alone)


@pytest.mark.parametrize("bits", [8, 4])
def test_eager_decode_equals_the_compiled_pass(model, tokenizer, bits, monkeypatch):
    """The compiled decode pass (the unpacked levels traced into it on the CPU path) gives the eager passes' tokens:
    the same code over the same pages, fused."""
    monkeypatch.setattr(quantized_attention, "UNPACKED_4BIT_MIN_KEYS", 0)
    calls = []
    real = cpu_attention.attend_quantized_unpacked
    monkeypatch.setattr(cpu_attention, "attend_quantized_unpacked", lambda *a, **k: calls.append(1) or real(*a, **k))
    with tiny_engine(model, tokenizer, kv_bits=bits) as engine:
        assert engine.runner.decoder is not None
        compiled = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
        on_cpu_path = engine.built.attention.status()["path"] == "cpu"
    assert bool(calls) == on_cpu_path
    monkeypatch.setenv("MLXPAGED_COMPILE", "0")
    with tiny_engine(model, tokenizer, kv_bits=bits) as engine:
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
    assert_greedy_matches(got, hybrid, PROMPTS, 8)


def test_a_head_width_that_groups_cannot_split_is_refused_before_the_pools(tokenizer):
    with pytest.raises(ConfigError, match=r"widths include 16 .*multiple of 32"):  # 8-bit pages: groups of 32
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
    assert_greedy_matches(got, model, PROMPTS, 8)


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
