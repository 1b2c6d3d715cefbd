"""SamplingParams validation and the batched sampler: greedy, filters, seeded reproducibility
under batching and preemption, penalties, logprobs and per-row processor failures."""

from __future__ import annotations

import dataclasses

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.engine.request import Request
from mlxpaged.runner.sampling import SampleResult, make_state, sample_batch
from mlxpaged.sampling_params import SamplingParams

import mlx.core as mx
import numpy as np
import pytest

VOCAB = 2000


def history(prompt: list[int], output: list[int] = ()) -> Request:
    """The request a sampler state reads its tokens from."""
    return Request("r", list(prompt), max_tokens=1 << 20, output_token_ids=list(output))


def row_logits(step: int, scale: float = 1.0) -> np.ndarray:
    """The tracked request's logits at a step: a function of the step only."""
    return (np.random.default_rng(1000 + step).normal(size=VOCAB) * scale).astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return (
        x
        - np.log(np.exp(x - x.max(axis=-1, keepdims=True)).sum(axis=-1, keepdims=True))
        - x.max(axis=-1, keepdims=True)
    )


# --- validation -----------------------------------------------------------------------------

BAD = [
    ("max_tokens", 0),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "1"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -1),
    ("top_k", 2.0),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", -2.01),
    ("presence_penalty", 3),
    ("frequency_penalty", 2.5),
    ("seed", 1.5),
    ("seed", "7"),
    ("seed", True),
    ("stop", [""]),
    ("stop", [3]),
    ("stop", 3),
    ("stop", ["x"] * 17),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", "5"),
    ("stop_token_ids", [1.0]),
    ("ignore_eos", 1),
    ("logprobs", "yes"),
    ("top_logprobs", 21),
    ("top_logprobs", -1),
    ("n", 0),
    ("n", 129),
    ("logits_processors", [1]),
    ("logits_processors", "f"),
    ("logit_bias", {5: 101.0}),
    ("logit_bias", {5: float("nan")}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", [5]),
]


@pytest.mark.parametrize("name,value", BAD)
def test_bad_field_raises_value_error_naming_it(name, value):
    extra = {"logprobs": True} if name == "top_logprobs" else {}
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value}, **extra)


def test_messages_state_the_allowed_range():
    with pytest.raises(ValueError, match=r"presence_penalty must be in \[-2.0, 2.0\], got 3"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(ValueError, match=r"top_p must be in \(0.0, 1.0\]"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match=r"top_logprobs=3 needs logprobs=True"):
        SamplingParams(top_logprobs=3)


def test_defaults_and_normalisation():
    params = SamplingParams(stop="###", stop_token_ids=(5, 6))
    assert params.stop == ["###"] and params.stop_token_ids == [5, 6]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    default = SamplingParams()
    assert (default.max_tokens, default.temperature, default.top_p, default.top_k, default.n) == (256, 1.0, 1.0, 0, 1)
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy


def test_make_state_and_sample_batch_check_their_arguments():
    with pytest.raises(ValueError, match="params"):
        make_state({"temperature": 0}, history([1]))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        make_state(SamplingParams(), history([1, -2]))
    states = [make_state(SamplingParams(), history([1]))]
    with pytest.raises(ValueError, match="logits"):
        sample_batch(mx.zeros((VOCAB,)), states)
    with pytest.raises(ValueError, match="logits has 2 rows"):
        sample_batch(mx.zeros((2, VOCAB)), states)
    assert sample_batch(mx.zeros((0, VOCAB)), []) == []


# --- greedy, filters, temperature -------------------------------------------------------------


def test_greedy_is_argmax_for_every_row():
    logits = np.random.default_rng(0).normal(size=(6, VOCAB)).astype(np.float32)
    states = [make_state(SamplingParams(temperature=t), history([1])) for t in (0, 0, 1e-6, 0, 0, 0)]
    tokens = [r.token for r in sample_batch(mx.array(logits), states)]
    assert tokens == list(np.argmax(logits, axis=-1))
    half = sample_batch(mx.array(logits).astype(mx.bfloat16), states)  # other dtypes are cast
    assert all(isinstance(r.token, int) for r in half)


def test_logit_bias_moves_the_choice_but_not_the_reported_logprobs():
    from mlxpaged.runner.sampling import LazySample

    logits = np.random.default_rng(7).normal(size=(3, VOCAB)).astype(np.float32)
    top = np.argmax(logits, axis=-1)
    params = [
        SamplingParams(temperature=0, logprobs=True, logit_bias={int(top[0]): -100.0}),
        SamplingParams(temperature=0, logprobs=True, logit_bias={17: 100.0, 18: 99.0}),
        SamplingParams(temperature=0, logprobs=True),
    ]
    second = int(np.argsort(logits[0])[-2])
    for sample in (
        lambda states: sample_batch(mx.array(logits), states),
        lambda states: LazySample(mx.array(logits), states).results(),
    ):
        results = sample([make_state(p, history([1])) for p in params])
        assert [r.token for r in results] == [second, 17, int(top[2])]
        assert results[1].logprob == pytest.approx(log_softmax(logits[1])[17], abs=1e-5)  # the model's own
    drawn = sample_batch(
        mx.array(logits[:1]), [make_state(SamplingParams(temperature=1.0, seed=3, logit_bias={5: 100.0}), history([1]))]
    )
    assert drawn[0].token == 5  # +100 dominates any draw


def test_top_k_1_is_greedy_whatever_the_seed():
    logits = np.random.default_rng(1).normal(size=(8, VOCAB)).astype(np.float32)
    states = [make_state(SamplingParams(top_k=1, temperature=1.5, seed=s), history([1])) for s in range(8)]
    assert [r.token for r in sample_batch(mx.array(logits), states)] == list(np.argmax(logits, axis=-1))


def frequencies(params: dict, probs: list[float], draws: int = 4000) -> np.ndarray:
    logits = mx.array(np.tile(np.log(np.array(probs, dtype=np.float32)), (draws, 1)))
    states = [make_state(SamplingParams(seed=s, **params), history([])) for s in range(draws)]
    tokens = [r.token for r in sample_batch(logits, states)]
    return np.bincount(tokens, minlength=len(probs)) / draws


def test_draws_follow_the_distribution_and_filters():
    probs = [0.5, 0.3, 0.2]
    np.testing.assert_allclose(frequencies({}, probs), probs, atol=0.03)
    squared = np.square(probs) / np.square(probs).sum()
    np.testing.assert_allclose(frequencies({"temperature": 0.5}, probs), squared, atol=0.03)
    assert frequencies({"top_p": 0.6}, probs)[2] == 0  # 0.5 + 0.3 covers 0.6: token 2 is cut
    assert frequencies({"min_p": 0.5}, probs)[2] == 0  # 0.2 < 0.5 * 0.5
    assert frequencies({"top_k": 2}, probs)[2] == 0


def test_temperature_to_zero_tends_to_argmax():
    logits = mx.array([[0.0, 1.0, 5.0, 2.0, 4.5]] * 200)
    for temperature in (0.05, 0.01):
        states = [make_state(SamplingParams(temperature=temperature, seed=s), history([])) for s in range(200)]
        assert {r.token for r in sample_batch(logits, states)} == {2}
    states = [make_state(SamplingParams(temperature=1.0, seed=s), history([])) for s in range(200)]
    assert len({r.token for r in sample_batch(logits, states)}) > 2


# --- reproducibility ------------------------------------------------------------------------

TRACKED = SamplingParams(
    temperature=1.0,
    top_p=0.95,
    top_k=500,
    min_p=0.01,
    repetition_penalty=1.2,
    presence_penalty=0.3,
    frequency_penalty=0.2,
    seed=1234,
)
OTHERS = [
    SamplingParams(),
    SamplingParams(temperature=0),
    SamplingParams(top_p=0.5, logprobs=True),
    SamplingParams(temperature=0.7, repetition_penalty=1.3, top_k=5),
]


def generate(state, steps: int, batch_with: list | None = None, position: int = 0) -> list[int]:
    """Sample `steps` tokens for `state`; with `batch_with`, inside a batch of other random rows."""
    others = batch_with or []
    noise = np.random.default_rng(len(state.output_token_ids) + 7)
    tokens = []
    for _ in range(steps):
        rows = [noise.normal(size=VOCAB).astype(np.float32) for _ in others]
        rows.insert(position, row_logits(state.generation_index))
        batch = [*others[:position], state, *others[position:]]
        results = sample_batch(mx.array(np.stack(rows)), batch)
        for other, result in zip(batch, results, strict=True):
            other.sequence.output_token_ids.append(result.token)  # as the scheduler does
        tokens.append(results[position].token)
    return tokens


def test_seeded_tokens_are_the_same_alone_batched_and_after_preemption():
    alone = generate(make_state(TRACKED, history([3, 4, 5])), 24)
    others = [make_state(p, history([9, 9])) for p in OTHERS]
    batched = generate(make_state(TRACKED, history([3, 4, 5])), 24, batch_with=others, position=2)
    assert batched == alone
    rebuilt = make_state(TRACKED, history([3, 4, 5], alone[:12]))  # preempted after 12
    assert alone[:12] + generate(rebuilt, 12, batch_with=others[:2], position=1) == alone
    assert alone != [int(np.argmax(row_logits(i))) for i in range(24)]  # it really sampled


def test_seeds_sequences_and_unseeded_requests_differ():
    def first_tokens(params, **kwargs):
        return generate(make_state(params, history([1]), **kwargs), 12)

    assert first_tokens(TRACKED) != first_tokens(dataclasses.replace(TRACKED, seed=1235))
    assert first_tokens(TRACKED) != first_tokens(TRACKED, sequence_index=1)  # n > 1 samples differ
    unseeded = dataclasses.replace(TRACKED, seed=None)
    first, second = make_state(unseeded, history([1])), make_state(unseeded, history([1]))
    assert first.seed != second.seed
    # An unseeded request resumes identically when rebuilt with the seed it drew.
    reference = generate(make_state(dataclasses.replace(unseeded, seed=first.seed), history([1])), 10)
    assert (
        generate(first, 5)
        + generate(make_state(dataclasses.replace(unseeded, seed=first.seed), history([1], first.output_token_ids)), 5)
        == reference
    )


# --- penalties and processors ---------------------------------------------------------------

LOGITS = [2.0, -1.0, 0.5, 3.0, 0.0, -2.0]
PROMPT, OUTPUT = [0, 1], [2, 2, 3]


def processed(**params) -> tuple[list[float], list[int], int]:
    """(logits the last processor saw, tokens it saw, greedy token) for LOGITS, PROMPT, OUTPUT."""
    seen = []

    def capture(tokens, logits):
        seen.append((tokens.tolist(), logits[0].tolist()))
        return logits

    state = make_state(SamplingParams(temperature=0, logits_processors=[capture], **params), history(PROMPT, OUTPUT))
    batch = mx.array([LOGITS])
    (result,) = sample_batch(batch, [state])
    assert batch[0].tolist() == LOGITS  # the batch itself is never modified
    return seen[0][1], seen[0][0], result.token


@pytest.mark.parametrize(
    "params,expected",
    [
        ({}, LOGITS),
        # prompt and output tokens {0, 1, 2, 3}: positive logits / 2, negative ones * 2
        ({"repetition_penalty": 2.0}, [1.0, -2.0, 0.25, 1.5, 0.0, -2.0]),
        # generated tokens only: 2 and 3 once each, prompt tokens 0 and 1 untouched
        ({"presence_penalty": 0.5}, [2.0, -1.0, 0.0, 2.5, 0.0, -2.0]),
        ({"presence_penalty": -1.0}, [2.0, -1.0, 1.5, 4.0, 0.0, -2.0]),
        # token 2 was generated twice, token 3 once
        ({"frequency_penalty": 0.25}, [2.0, -1.0, 0.0, 2.75, 0.0, -2.0]),
        (
            {"repetition_penalty": 2.0, "presence_penalty": 0.5, "frequency_penalty": 0.25},
            [1.0, -2.0, -0.75, 0.75, 0.0, -2.0],
        ),
    ],
)
def test_penalties_change_logits_exactly_as_defined(params, expected):
    logits, tokens, _ = processed(**params)
    assert logits == expected
    assert tokens == PROMPT + OUTPUT  # processors get prompt + generated tokens, as in mlx-lm


def test_penalties_decide_the_greedy_token():
    assert processed()[2] == 3
    assert processed(presence_penalty=2.0)[2] == 0  # 3.0 - 2.0 < 2.0


def test_presence_and_frequency_ignore_the_prompt():
    state = make_state(SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0), history([3, 3, 3]))
    assert sample_batch(mx.array([LOGITS]), [state])[0].token == 3


def test_a_failing_processor_fails_only_its_row():
    def boom(tokens, logits):
        raise RuntimeError("boom")

    logits = np.random.default_rng(2).normal(size=(4, VOCAB)).astype(np.float32)
    states = [
        make_state(SamplingParams(temperature=0), history([1])),
        make_state(SamplingParams(temperature=0, logits_processors=[boom]), history([1])),
        make_state(SamplingParams(temperature=0, logits_processors=[lambda t, x: x[0]]), history([1])),
        make_state(SamplingParams(temperature=0, logprobs=True, repetition_penalty=1.1), history([1])),
        make_state(SamplingParams(logits_processors=[lambda t, x: x - mx.inf]), history([1])),
    ]
    logits = np.concatenate([logits, logits[:1]])
    results = sample_batch(mx.array(logits), states)
    assert isinstance(results[1].error, RuntimeError) and results[1].token is None
    assert isinstance(results[2].error, ValueError)  # returned [V] instead of [1, V]
    assert "no finite logit" in str(results[4].error)  # masked every token
    assert [results[0].token, results[3].token] == [int(np.argmax(logits[0])), int(np.argmax(logits[3]))]
    assert results[0].error is None and results[3].logprob is not None


def test_a_processor_failing_at_evaluation_fails_only_its_row(monkeypatch):
    poisoned = []

    def lazy_boom(tokens, logits):
        poisoned.append(logits + 0)
        return poisoned[-1]

    real_eval, calls = mx.eval, []

    def flaky_eval(*arrays):
        calls.append(arrays)
        if len(calls) == 1 or any(a is p for a in arrays for p in poisoned):
            raise RuntimeError("lazy boom")
        return real_eval(*arrays)

    monkeypatch.setattr(mx, "eval", flaky_eval)
    logits = np.random.default_rng(3).normal(size=(2, VOCAB)).astype(np.float32)
    states = [
        make_state(SamplingParams(temperature=0, logits_processors=[lazy_boom]), history([1])),
        make_state(SamplingParams(temperature=0, presence_penalty=1.0), history([1])),
    ]
    first, second = sample_batch(mx.array(logits), states)
    assert str(first.error) == "lazy boom"
    assert second == SampleResult(int(np.argmax(logits[1])))


# --- logprobs --------------------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax_and_top_logprobs_are_sorted():
    logits = np.random.default_rng(4).normal(size=(4, VOCAB)).astype(np.float32) * 3
    states = [
        make_state(
            SamplingParams(logprobs=True, top_logprobs=5, temperature=0.7, repetition_penalty=1.5, seed=1),
            history([int(np.argmax(logits[0]))]),
        ),
        make_state(SamplingParams(temperature=0), history([1])),
        make_state(SamplingParams(logprobs=True, temperature=0), history([1])),
        make_state(SamplingParams(logprobs=True, top_logprobs=20, temperature=0), history([1])),
    ]
    results = sample_batch(mx.array(logits), states)
    reference = log_softmax(logits)
    for row in (0, 2, 3):
        result = results[row]
        assert result.logprob == pytest.approx(reference[row, result.token], abs=1e-5)
        k = states[row].params.top_logprobs
        assert [t for t, _ in result.top_logprobs] == list(np.argsort(-reference[row])[:k])
        values = [v for _, v in result.top_logprobs]
        assert values == sorted(values, reverse=True)
        np.testing.assert_allclose(values, np.sort(reference[row])[::-1][:k], atol=1e-5)
    assert results[1].logprob is None and results[1].top_logprobs is None
    assert results[2].top_logprobs == []
    # Row 0's logprobs describe the model, not the penalised, tempered distribution it drew from.
    assert results[0].top_logprobs[0][0] == int(np.argmax(logits[0]))
