"""Speculation on models with state layers (a recurrent state cannot be cut back to the last kept token): after a
rejected draft the scheduler returns the state to where the verify chunk started and feeds the kept tokens again
with the next chunk. Against plain decoding, token for token: a hybrid (tiny Qwen 3.5, gated-delta + full
attention) and state-only models, prompt lookup drafting a corrupted oracle, and a draft model on the hybrid."""

from __future__ import annotations

import dataclasses

from mlxpaged.engine.core import EngineCore
from mlxpaged.runner.model_drafter import ModelDrafter
from mlxpaged.runner.model_runner import Runner
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_core import run_to_completion, token_ids
from tests.engine.test_draft_model import pages
from tests.engine.test_engine import tokenizer  # noqa: F401  (the fixture, shared)
from tests.engine.test_engine_state import make_core
from tests.engine.test_speculative import oracle
from tests.tiny_models import random_tokens, tiny_llama, tiny_qwen3_5

import pytest

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True)
PROMPTS = {"a": random_tokens(9, seed=21), "b": random_tokens(26, seed=22)}


def state_core(model, tokenizer, drafter: ModelDrafter | None = None, **scheduling) -> EngineCore:
    return make_core(model, tokenizer, drafter, **scheduling)


def run(core, prompts: dict, params) -> dict:
    events = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, params, events[rid].append)
    run_to_completion(core)
    assert core.scheduler.kv_manager.stats().num_owned == 0
    assert core.scheduler.state.num_free == 4  # every state slot back
    return {rid: token_ids(e) for rid, e in events.items()}


@pytest.fixture(scope="module")
def hybrid():
    return tiny_qwen3_5()


def count_rollbacks(monkeypatch) -> list:
    from mlxpaged.engine.scheduler import Scheduler

    calls: list = []
    original = Scheduler._roll_back_state
    monkeypatch.setattr(Scheduler, "_roll_back_state", lambda self, *a: calls.append(a) or original(self, *a))
    return calls


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_hybrid_rolls_its_state_back_after_rejected_drafts(hybrid, tokenizer, monkeypatch, params):
    plain = run(state_core(hybrid, tokenizer), PROMPTS, params)
    oracle(monkeypatch, [PROMPTS[rid] + plain[rid] for rid in PROMPTS])
    rollbacks = count_rollbacks(monkeypatch)
    core = state_core(hybrid, tokenizer, speculative="ngram", num_speculative_tokens=4)
    assert run(core, PROMPTS, params) == plain
    stats = core.speculator.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens and rollbacks  # drafts were kept and rolled back


def test_a_hybrid_keeps_its_state_checkpoints_right_through_rollbacks(hybrid, tokenizer, monkeypatch):
    """The second turn resumes from a checkpoint published while the first turn speculated: it must hold the state
    of the kept tokens, not of rejected drafts."""
    first = run(state_core(hybrid, tokenizer), {"t1": PROMPTS["b"]}, GREEDY)["t1"]
    turn2 = PROMPTS["b"] + first + random_tokens(5, seed=23)
    expected = run(state_core(hybrid, tokenizer), {"t2": turn2}, GREEDY)["t2"]
    oracle(monkeypatch, [PROMPTS["b"] + first, turn2 + expected])
    core = state_core(hybrid, tokenizer, speculative="ngram", num_speculative_tokens=4)
    assert run(core, {"t1": PROMPTS["b"]}, GREEDY)["t1"] == first
    hits = core.scheduler.kv_manager.stats().hit_tokens
    assert run(core, {"t2": turn2}, GREEDY)["t2"] == expected
    assert core.scheduler.kv_manager.stats().hit_tokens - hits >= 40  # resumed past the first turn's prompt


def test_a_state_only_model_speculates_with_rollbacks(tokenizer, monkeypatch):
    """mamba2 (the tiny rwkv7 falls into repeating one token: a rollback left out would not show there)."""
    from tests.archs.harness import build

    model = build("mamba2")
    plain = run(state_core(model, tokenizer), PROMPTS, GREEDY)
    oracle(monkeypatch, [PROMPTS[rid] + plain[rid] for rid in PROMPTS])
    core = state_core(model, tokenizer, speculative="ngram", num_speculative_tokens=4)
    assert run(core, PROMPTS, GREEDY) == plain
    assert 0 < core.speculator.stats.accepted_tokens < core.speculator.stats.draft_tokens


def test_a_draft_model_drafts_for_a_hybrid(hybrid, tokenizer):
    draft = tiny_llama(num_layers=1, seed=31)
    drafter = ModelDrafter(Runner(draft, pages(draft, 64)), "draft", vocab_size=256)
    plain = run(state_core(hybrid, tokenizer), PROMPTS, GREEDY)
    core = state_core(hybrid, tokenizer, drafter, speculative="draft", num_speculative_tokens=3)
    assert run(core, PROMPTS, dataclasses.replace(GREEDY)) == plain
    assert core.speculator.stats.draft_tokens > 0
