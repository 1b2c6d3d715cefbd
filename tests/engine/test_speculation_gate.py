"""The speculation gate (engine/speculation_gate.py) with made-up step times: it measures each way once per batch
size, runs the faster, tries the other every EXPLORE_EVERY steps, and follows a change."""

from __future__ import annotations

from mlxpaged.engine.speculation_gate import EXPLORE_EVERY, EXPLORE_MAX, EXPLORE_STEPS, FIRST_TRY, SpeculationGate

import pytest

pytestmark = pytest.mark.timed_gate  # the gate as it is (tests/conftest.py makes every other test draft)


def run(gate: SpeculationGate, rows: int, steps: int, drafted_rate: float, plain_rate: float) -> list[bool]:
    """`steps` steps at `rows` rows whose tokens per second are those given; the choices made."""
    choices = []
    for _ in range(steps):
        drafts = gate.decide(rows)
        choices.append(drafts)
        gate.record(rows, drafts, tokens=100, seconds=100 / (drafted_rate if drafts else plain_rate))
    return choices


def test_each_way_is_measured_then_the_faster_runs():
    gate = SpeculationGate()
    # drafting measured; plain decoding twice (the first step after a switch is not measured); then the faster
    assert run(gate, 4, 3, drafted_rate=30.0, plain_rate=20.0) == [True, False, False]
    assert run(gate, 4, 10, drafted_rate=30.0, plain_rate=20.0) == [True] * 10
    slow = SpeculationGate()
    assert run(slow, 16, 13, drafted_rate=15.0, plain_rate=20.0) == [True] + [False] * 12  # steps aside


def test_the_first_step_after_a_switch_is_not_measured():
    gate = SpeculationGate()
    run(gate, 2, 3, drafted_rate=30.0, plain_rate=20.0)
    gate.record(2, True, tokens=100, seconds=100.0)  # a switch back to drafting that paid a long catch-up
    assert gate.rates(2) == (30.0, 20.0)
    gate.record(2, True, tokens=100, seconds=100 / 40.0)  # the next one is measured
    assert gate.rates(2)[0] > 30.0


def test_tries_of_the_other_way_grow_rarer_while_they_confirm_the_choice_and_a_change_is_followed():
    gate = SpeculationGate()
    run(gate, 8, 3, drafted_rate=30.0, plain_rate=25.0)
    first = run(gate, 8, EXPLORE_EVERY + EXPLORE_STEPS, drafted_rate=30.0, plain_rate=25.0)
    assert first.count(False) == EXPLORE_STEPS  # tried once after EXPLORE_EVERY steps
    long = run(gate, 8, 4 * EXPLORE_MAX, drafted_rate=30.0, plain_rate=25.0)
    tries = long.count(False) // EXPLORE_STEPS
    assert 4 <= tries <= 8  # waits of 64, 128, then EXPLORE_MAX steps: far fewer than one per EXPLORE_EVERY
    # The drafts start failing: drafting is now slower than plain decoding, and the gate moves over at its next try.
    later = run(gate, 8, 3 * EXPLORE_MAX, drafted_rate=10.0, plain_rate=20.0)
    assert later[-EXPLORE_EVERY:].count(True) <= EXPLORE_STEPS  # plain, but for trying drafting again


def test_a_clear_choice_waits_longest_before_each_try():
    """Drafting at a third of plain decoding's speed (a draft model as costly as the model): tries, each of which makes
    a draft model catch up, come every EXPLORE_MAX steps from the start, not after 32, 64 and 128."""
    gate = SpeculationGate()
    choices = run(gate, 16, 3 + 2 * (EXPLORE_MAX + EXPLORE_STEPS), drafted_rate=10.0, plain_rate=30.0)
    tries = [i for i, drafts in enumerate(choices[3:]) if drafts]
    assert tries == [EXPLORE_MAX - 1, EXPLORE_MAX, 2 * EXPLORE_MAX, 2 * EXPLORE_MAX + 1], tries


def test_batch_sizes_are_learnt_apart_and_leaning_counts_nothing():
    gate = SpeculationGate()
    run(gate, 1, 4, drafted_rate=40.0, plain_rate=14.0)
    # 16 rows follow 1 row's choice (drafting) until the FIRST_TRY-th step there tries plain decoding (two steps: the
    # second measured), which is faster at 16 rows
    assert run(gate, 16, FIRST_TRY + 3, drafted_rate=18.0, plain_rate=25.0) == [True] * (FIRST_TRY - 1) + [False] * 4
    for _ in range(3 * EXPLORE_EVERY):
        assert gate.leaning(1) and not gate.leaning(16)  # a guess: no step counted, no exploration
    assert gate.rates(1) == (40.0, 14.0) and gate.rates(2) == (None, None)


def test_a_draining_batch_follows_the_nearest_batch_size_measured():
    """Requests finishing one per step give a new batch size every step: each follows the nearest measured one (no
    step drafts to measure a size it will never see again), and the choice flips where the measured ones do."""
    gate = SpeculationGate()
    run(gate, 16, 4, drafted_rate=15.0, plain_rate=25.0)
    run(gate, 2, 4, drafted_rate=40.0, plain_rate=20.0)
    drain = [choice for rows in range(15, 0, -1) for choice in run(gate, rows, 1, drafted_rate=15.0, plain_rate=25.0)]
    assert drain == [False] * 6 + [True] * 9  # 15..10 nearer 16 (plain), 9..1 nearer 2 (drafting; 9: a tie, smaller)


def test_an_engine_steps_aside_when_its_drafts_are_never_kept(default_loaded):
    """A random draft model of the real tokenizer proposes tokens the model never keeps: drafting steps make one token
    for a draft pass per drafted token and a verify pass, far slower than plain decoding, and the gate moves over."""
    from mlxpaged.sampling_params import SamplingParams
    from tests.engine.test_core import run_to_completion
    from tests.engine.test_draft_model import draft_core
    from tests.tiny_models import tiny_llama

    target = tiny_llama(num_layers=4, seed=3)
    core = draft_core(target, tiny_llama(num_layers=2, seed=4), default_loaded.tokenizer, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    for rid, prompt in (("a", [1, 2, 3, 4, 5, 6, 7]), ("b", [9, 8, 7, 6, 5])):
        core.add_request(rid, prompt, params, lambda event: None)
    run_to_completion(core)
    drafted, plain = core.speculator.gate.rates(2)
    assert drafted is not None and plain is not None and not core.speculator.gate.leaning(2), (drafted, plain)
