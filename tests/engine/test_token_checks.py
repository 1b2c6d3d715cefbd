"""The prompt checks' fast paths (C loops over plain ints) against their entry-by-entry twins: the same tokens
accepted, the same error for anything else."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

from mlxpaged.engine.engine import Engine
from mlxpaged.errors import ConfigError
from mlxpaged.sampling_params import token_id_list
from mlxpaged.validation import require_number

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

VOCAB = 100
ENTRIES = st.one_of(
    st.sampled_from([-1, 0, VOCAB - 1, VOCAB]),  # the edges
    st.integers(-3, VOCAB + 3),
    st.booleans(),
    st.floats(-2.0, VOCAB + 2.0),
    st.integers(0, VOCAB - 1).map(np.int64),
)
# Mostly plain in-range ints (the fast path), sometimes one odd entry anywhere.
PROMPTS = (
    st.lists(st.integers(0, VOCAB - 1), max_size=40)
    .flatmap(lambda ints: st.tuples(st.just(ints), st.integers(0, len(ints)), st.one_of(st.none(), ENTRIES)))
    .map(lambda t: t[0][: t[1]] + ([] if t[2] is None else [t[2]]) + t[0][t[1] :])
)


def outcome(check, *args):
    try:
        return "ok", check(*args)
    except (ValueError, TypeError) as exc:
        return type(exc).__name__, str(exc)


def slow_token_id_list(name, value):
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {value!r}")
    for token in value:
        require_number(f"{name} entries", token, 0, math.inf, integer=True)
    return list(value)


class Checks:
    """What Engine's caller-side checks read: the vocabulary's width (no model needed)."""

    facts = SimpleNamespace(vocab_size=VOCAB)
    _tokenize = Engine._tokenize
    _check_token_ids = Engine._check_token_ids


def slow_tokenize(prompt, vocab=VOCAB):
    tokens = [int(t) for t in prompt]
    bad = [t for t in tokens if t < 0 or (vocab and t >= vocab)]
    if bad:
        raise ConfigError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}", param="prompt")
    return tokens


@settings(max_examples=300, deadline=None)
@given(prompt=PROMPTS, as_tuple=st.booleans())
def test_token_id_list_accepts_and_refuses_as_its_entry_by_entry_twin(prompt, as_tuple):
    value = tuple(prompt) if as_tuple else prompt
    assert outcome(token_id_list, "prompt_token_ids", value) == outcome(slow_token_id_list, "prompt_token_ids", value)


@settings(max_examples=300, deadline=None)
@given(prompt=PROMPTS)
def test_the_engines_prompt_check_accepts_and_refuses_as_its_entry_by_entry_twin(prompt):
    got, want = outcome(Checks()._tokenize, prompt), outcome(slow_tokenize, prompt)
    assert got == want
    if got[0] == "ok":
        assert all(type(t) is int for t in got[1])  # what the engine queues: plain ints


def test_the_engines_checks_name_the_bad_ids():
    checks = Checks()
    for prompt, bad in (([1, -1, 2], [-1]), ([1, -1, 2, VOCAB], [-1, VOCAB]), ([VOCAB + 5] * 7, [VOCAB + 5] * 5)):
        with pytest.raises(ConfigError, match=re.escape(str(bad))):
            checks._tokenize(prompt)
    checks._check_token_ids("logit_bias", {})  # an empty dict: nothing to check
    with pytest.raises(ConfigError, match=r"logit_bias token ids out of range \[0, 100\): \[100\]"):
        checks._check_token_ids("logit_bias", {VOCAB: 1.0})
