"""batching.py: every input in one pass, passes within the token budget, a long input alone in chunks."""

from __future__ import annotations

from mlxpaged.embedding.batching import plan_passes

from hypothesis import given
from hypothesis import strategies as st


@given(st.lists(st.integers(1, 300), min_size=1, max_size=60), st.integers(1, 512))
def test_every_input_once_and_every_call_within_the_budget(lengths, budget):
    passes = plan_passes(lengths, budget)
    assert sorted(i for p in passes for i in p.rows) == list(range(len(lengths)))
    for p in passes:
        assert p.length == max(lengths[i] for i in p.rows)
        assert [lengths[i] for i in p.rows] == sorted((lengths[i] for i in p.rows), reverse=True)
        assert len(p.rows) * min(p.chunk, p.length) <= budget
        assert p.chunk >= 1 and (p.calls == 1 or len(p.rows) == 1)


def test_many_short_inputs_share_one_pass():
    passes = plan_passes([5] * 100, 512)
    assert len(passes) == 1 and passes[0].calls == 1


def test_similar_lengths_share_a_pass_and_a_long_input_runs_alone_in_chunks():
    passes = plan_passes([3, 100, 4, 2, 5], 20)
    assert passes[0].rows == (1,) and passes[0].chunk == 20 and passes[0].calls == 5
    assert passes[1].rows == (4, 2, 0, 3) and passes[1].length == 5 and passes[1].calls == 1
