"""engine/drafting.py's per-sequence draft policy (plain Python): how k adapts and when drafting pauses."""

from mlxpaged.engine.drafting import MAX_PAUSE, DraftPolicy, SpeculationStats


def steps_paused(policy: DraftPolicy) -> int:
    n = 0
    while not policy.wants_draft():
        n += 1
    return n


def test_k_follows_how_much_of_the_last_draft_was_kept():
    policy = DraftPolicy(max_k=5)
    assert policy.k == 5
    policy.update(5, 2)
    assert policy.k == 3  # the kept length + 1
    policy.update(3, 3)
    assert policy.k == 5  # all kept: back to the longest
    policy.update(5, 0)
    assert policy.k == 2 and policy.wants_draft()  # one miss halves k but does not pause


def test_misses_in_a_row_pause_drafting_longer_each_time_up_to_a_cap():
    policy = DraftPolicy(max_k=4)
    pauses = []
    for _ in range(8):
        policy.update(1, 0)
        policy.update(1, 0)
        pauses.append(steps_paused(policy))
    assert pauses == [2, 4, 8, 16, 32, 64, 64, 64] and MAX_PAUSE == 64
    policy.update(1, 1)  # a fully kept draft resets the back-off
    policy.update(1, 0)
    policy.update(1, 0)
    assert steps_paused(policy) == 2


def test_acceptance_rate_is_none_before_any_draft():
    stats = SpeculationStats()
    assert stats.acceptance_rate is None and stats.snapshot()["spec_acceptance_rate"] is None
    stats.draft_tokens, stats.accepted_tokens = 8, 6
    assert stats.snapshot() == {
        "spec_draft_tokens_total": 8,
        "spec_accepted_tokens_total": 6,
        "spec_acceptance_rate": 0.75,
    }
