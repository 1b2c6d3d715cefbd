"""A pass that returns the logits of every drafted position (StepInput.num_logits) against mlx-lm's
own contiguous forward pass, alone and sharing a step with a decode row and a prefill chunk."""

from __future__ import annotations

import re

from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.runner.model_runner import Runner
from mlxpaged.runner.passes import StepInput
from mlxpaged.runner.routing import route_paged_attention
from tests.tiny_models import random_tokens, shuffled_blocks, tiny_llama

import mlx.core as mx
import pytest


@pytest.fixture(scope="module")
def model():
    route_paged_attention()
    return tiny_llama()


def contiguous_logits(model, tokens: list[int]) -> mx.array:
    """mlx-lm's forward over the whole sequence with its own cache: logits [L, V] (the slow twin)."""
    return model(mx.array([tokens]), cache=model.make_cache())[0].astype(mx.float32)


def test_every_position_of_a_verify_chunk_matches_the_contiguous_forward(model):
    args = model.args
    kv = PagedKVCache(
        num_layers=args.num_hidden_layers,
        num_blocks=32,
        block_size=8,
        num_kv_heads=args.num_key_value_heads,
        head_dim=args.head_dim,
    )
    runner, free = Runner(model, kv), shuffled_blocks(32)
    a, b, c = random_tokens(21, seed=1), random_tokens(13, seed=2), random_tokens(9, seed=3)
    tables = {name: [[free.pop() for _ in range(4)]] for name in "abc"}
    runner.step([StepInput(a[:15], 0, tables["a"], False), StepInput(b[:12], 0, tables["b"], False)])
    # one step: a verify chunk of 6 (a), a decode row (b), a prefill chunk from scratch (c)
    logits = runner.step(
        [
            StepInput(a[15:], 15, tables["a"], True, num_logits=6),
            StepInput(b[12:], 12, tables["b"], True),
            StepInput(c, 0, tables["c"], True),
        ]
    )
    assert logits.shape[0] == 6 + 1 + 1
    expected = mx.concatenate(
        [contiguous_logits(model, a)[15:], contiguous_logits(model, b)[12:], contiguous_logits(model, c)[-1:]]
    )
    assert mx.allclose(logits, expected, atol=1e-4, rtol=1e-4).item()


def test_more_logits_than_tokens_is_refused(model):
    args = model.args
    kv = PagedKVCache(
        num_layers=args.num_hidden_layers,
        num_blocks=4,
        block_size=8,
        num_kv_heads=args.num_key_value_heads,
        head_dim=args.head_dim,
    )
    with pytest.raises(ValueError, match=re.escape("num_logits 4 outside 1..3")):
        Runner(model, kv).step([StepInput([1, 2, 3], 0, [[0]], True, num_logits=4)])


def paged_runner(model, compiled: bool) -> tuple[Runner, list[list[int]]]:
    args = model.args
    kv = PagedKVCache(
        num_layers=args.num_hidden_layers,
        num_blocks=32,
        block_size=8,
        num_kv_heads=args.num_key_value_heads,
        head_dim=args.head_dim,
    )
    runner = Runner(model, kv)
    if not compiled:
        runner.decoder = None  # the eager pass through the paged views: the slow twin
    return runner, [shuffled_blocks(32)[:12]]


@pytest.mark.parametrize("length", [2, 4, 6])
def test_compiled_verify_chunk_equals_the_eager_pass_and_mlx_lm_at_every_position(model, length, monkeypatch):
    tokens = random_tokens(71 + length + 1, seed=length)
    start = 71  # past MIN_PAGES * 8 (a padded page bucket); the chunk crosses a block boundary
    fast, tables = paged_runner(model, compiled=True)
    slow, _ = paged_runner(model, compiled=False)
    assert fast.decoder is not None
    calls = []
    original = type(fast.decoder).__call__
    monkeypatch.setattr(
        type(fast.decoder),
        "__call__",
        lambda self, s, t, x, *rest: calls.append(x.shape) or original(self, s, t, x, *rest),
    )
    got = {}
    for name, runner in (("fast", fast), ("slow", slow)):
        runner.step([StepInput(tokens[:start], 0, tables, False)])
        verify = runner.step([StepInput(tokens[start : start + length], start, tables, True, num_logits=length)])
        after = runner.step(
            [StepInput(tokens[start + length :], start + length, tables, True)]
        )  # reads the chunk's writes
        got[name] = mx.concatenate([verify, after])
    assert calls == [(1, length), (1, 1)]  # the compiled runner ran the verify chunk and the decode compiled
    expected = contiguous_logits(model, tokens)[start:]
    assert got["fast"].shape == expected.shape
    assert mx.allclose(got["fast"], got["slow"], atol=1e-4, rtol=1e-4).item()
    assert mx.allclose(got["fast"], expected, atol=1e-4, rtol=1e-4).item()


def test_a_chunk_that_wants_only_its_last_logits_stays_on_the_eager_pass(model, monkeypatch):
    fast, tables = paged_runner(model, compiled=True)
    monkeypatch.setattr(type(fast.decoder), "__call__", lambda *a: pytest.fail("compiled pass used"))
    fast.step([StepInput(random_tokens(4, seed=9), 0, tables, True)])


# The chi-square statistic's 1 - 1e-6 quantile at 7 degrees of freedom (8 tokens): scipy.stats.chi2.ppf(1 - 1e-6, 7).
CHI2_7_CRITICAL = 40.52


def chi_square(counts: list[int], probabilities: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probabilities, strict=True))


def test_verified_drafts_keep_the_models_token_distribution():
    """Speculative sampling keeps the distribution: over 4,000 seeds (fixed: the test is deterministic) at temperature
    1, the first token of a verified run [last, d] is distributed as the model's first position says, whether the
    draft was kept or not; after a kept draft the next token is distributed as the second position says; the draft is
    kept as often as its probability; and each token is the one plain sampling draws with that seed."""
    from mlxpaged.runner.draft_verify import sample_with_drafts
    from mlxpaged.runner.sampling import make_state, sample_batch
    from mlxpaged.sampling_params import SamplingParams

    import numpy as np

    first = np.array([0.05, 0.3, 0.1, 0.2, 0.05, 0.15, 0.1, 0.05])
    second = np.array([0.4, 0.05, 0.05, 0.1, 0.1, 0.1, 0.1, 0.1])
    logits = mx.array(np.log(np.stack([first, second])).astype(np.float32))
    draft, trials = 3, 4000
    firsts, seconds, kept = [0] * 8, [0] * 8, 0

    class Sequence:
        prompt_token_ids, output_token_ids = [1, 2, 3], [4]

    for seed in range(trials):
        state = make_state(SamplingParams(temperature=1.0, seed=seed), Sequence())
        [result] = sample_with_drafts(logits, [[draft]], [(0, state)])
        token = result.accepted[0].token if result.accepted else result.token
        assert token == sample_batch(logits[:1], [state])[0].token  # plain sampling's draw with this seed
        firsts[token] += 1
        if result.accepted:
            kept += 1
            seconds[result.token] += 1
    assert chi_square(firsts, first.tolist()) < CHI2_7_CRITICAL
    assert chi_square(seconds, second.tolist()) < CHI2_7_CRITICAL
    assert abs(kept / trials - first[draft]) < 4 * (first[draft] * (1 - first[draft]) / trials) ** 0.5
