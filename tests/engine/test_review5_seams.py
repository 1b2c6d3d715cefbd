"""Seams between merged branches (review 5): speculation x n > 1 forks at a one-token last prefill chunk."""

from __future__ import annotations

import dataclasses

from tests.engine.test_core import run_to_completion
from tests.engine.test_engine import tokenizer  # noqa: F401  (the fixture, shared)
from tests.engine.test_speculative import PROMPTS, SEEDED, oracle, run
from tests.tiny_models import tiny_llama


def replies(events) -> list[list[int]]:
    return [[e.token_id for e in events if e.index == i and e.token_id is not None] for i in range(2)]


def test_n_sequences_whose_last_prompt_chunk_is_one_token_fork_with_drafts(tokenizer, monkeypatch):
    """A repeated prompt hits the prefix cache (full blocks + the partial last block) up to its last
    token, so its last prefill chunk is one token: the speculator then drafts on it. The n = 2 forks
    sample their first token from that chunk's logits and must get the plain run's tokens."""
    model = tiny_llama()
    params = dataclasses.replace(SEEDED, n=2, max_tokens=12)
    prompt = PROMPTS["b"]
    plain, _ = run(model, tokenizer, {"r": prompt}, params)
    oracle(monkeypatch, [prompt + reply for reply in replies(plain["r"])], wrong_every=10 ** 6)
    from tests.engine.test_core import make_core
    core = make_core(model, tokenizer, max_num_seqs=4, speculative="ngram")
    warm, events = [], []
    core.add_request("warm", prompt, dataclasses.replace(SEEDED, max_tokens=1), warm.append)
    run_to_completion(core)
    core.add_request("r", prompt, params, events.append)
    run_to_completion(core)
    assert core.speculator.stats.draft_tokens > 0
    assert replies(events) == replies(plain["r"])
    assert core.scheduler.kv_manager.stats().num_owned == 0
