"""A step's plan survives its int32 encoding exactly (what a follower runs is what rank 0 ran)."""

from __future__ import annotations

from mlxpaged.distributed import plan
from mlxpaged.runner.passes import StepInput

import pytest


def test_a_step_round_trips():
    inputs = [
        StepInput([5, 6, 7], 0, [[3, 9]], True),  # a prefill chunk that samples
        StepInput([11], 40, [[1, 2, 4], [8]], True, state_slot=2),  # two layer groups, a state slot
        StepInput([1, 2, 3, 4], 16, [[0, 7]], False),  # a mid-prompt chunk: no logits wanted
        StepInput([9, 10, 12], 30, [[5, 6]], True, num_logits=3),  # a decode chunk with two drafts
        StepInput([], 0, [], False),
    ]
    message = plan.decode(plan.encode_step(inputs))
    assert message.kind == plan.STEP
    assert [_fields(x) for x in message.inputs] == [_fields(x) for x in inputs]


def test_copies_and_stop_round_trip():
    message = plan.decode(plan.encode_copies([(3, 4), (10, 2)]))
    assert message.kind == plan.COPY and message.copies == ((3, 4), (10, 2))
    assert plan.decode(plan.encode_stop()).kind == plan.STOP
    assert plan.decode(plan.encode_keep_alive()).kind == plan.KEEP_ALIVE
    assert plan.decode(plan.encode_keep_alive(90)) == plan.Message(plan.KEEP_ALIVE, nap_ms=90)


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind 9"):
        plan.decode([9])


def _fields(x: StepInput) -> tuple:
    return (list(x.token_ids), x.start, [list(t) for t in x.block_tables], x.samples, x.state_slot, x.num_logits)
