"""Review 5: a prompt's last-boundary state checkpoint when a capped / budget-cut prefill leaves one token
before that boundary (LONG_PREFILL_SHARE and decodes make chunk ends arbitrary)."""

from __future__ import annotations

from mlxpaged.engine.scheduler import Request
from tests.engine.test_scheduler_state import make, prompt_of, run


def test_a_one_token_prefill_chunk_ending_at_the_last_boundary_publishes_its_checkpoint():
    state, sched = make(budget=15)  # chunk 1 ends at 15, one token before the prompt's last boundary (16)
    sched.add_request(Request("a", prompt_of(21, 1), 12))
    steps = run(state, sched)
    assert steps[:2] == [[("a", 0, 15)], [("a", 15, 1)]]  # the scheduler cut at the boundary...
    assert state.published[0] == (16, True)  # ...so the prompt's checkpoint is published there, not pending
    again = Request("b", prompt_of(21, 1), 3)  # the same prompt: resumes at 16 (a decode checkpoint at 24
    sched.add_request(again)                    # replaced a pending one, and the prompt does not reach 24)
    run(state, sched)
    assert again.num_cached_tokens == 16
