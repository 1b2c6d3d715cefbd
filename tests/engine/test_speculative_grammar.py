"""Speculation under a grammar: each drafted position is sampled under the grammar's mask after the drafts before it
(RowConstraint.drafted_masks), so constrained replies are token for token the plain constrained ones, greedy and
seeded, while drafts the grammar allows are kept. A tiny random model of the real tokenizer's vocabulary (the grammar
is compiled for it) and the prompt-lookup drafter replaying a corrupted oracle."""

from __future__ import annotations

import dataclasses

from mlxpaged import Engine, SamplingParams
from tests.engine.test_speculative import oracle
from tests.tiny_models import random_tokens, write_tiny_model_dir

import pytest

GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
SEEDED = SamplingParams(temperature=0.8, seed=5, max_tokens=40)
GRAMMAR = "start: /[a-z ]+/"  # lowercase words: a reply long enough to draft in, and most tokens forbidden


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model_dir(tmp_path_factory.mktemp("grammar") / "tiny", "llama", dtype="float32", seed=7)


def replies(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    constrained = dataclasses.replace(params, constraint=engine.grammar_compiler.compile(GRAMMAR))
    return [c.token_ids for c in engine.generate(prompts, [constrained] * len(prompts))]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_drafts_under_a_grammar_give_the_plain_constrained_tokens(model_dir, monkeypatch, params):
    prompts = [random_tokens(n, seed=n, vocab=49152) for n in (7, 15)]
    with Engine.from_pretrained(str(model_dir), cache_tokens=2048) as engine:
        plain = replies(engine, prompts, params)
    assert all(len(r) > 8 for r in plain)  # long enough to draft in
    oracle(monkeypatch, [p + r for p, r in zip(prompts, plain, strict=True)], wrong_every=4)
    with Engine.from_pretrained(str(model_dir), cache_tokens=2048, speculative="ngram") as engine:
        assert replies(engine, prompts, params) == plain
        stats = engine.stats()
    assert 0 < stats["spec_accepted_tokens_total"] < stats["spec_draft_tokens_total"]
