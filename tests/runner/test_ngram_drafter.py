"""The n-gram drafter (pure Python): the indexed lookup against its scanning twin."""

from __future__ import annotations

from collections.abc import Sequence

from mlxpaged.errors import ConfigError
from mlxpaged.runner.ngram_drafter import NgramDrafter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def propose_by_scan(tokens: Sequence[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """The slow twin of `NgramDrafter.propose`: scan backwards for the latest earlier occurrence."""
    if k <= 0 or len(tokens) < min_n + 1:
        return []
    tokens = list(tokens)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_it_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] occurred at 0 (followed by 9); [2, 3] also at 5 (followed by 7): the longer one wins
    assert NgramDrafter(min_n=2, max_n=3).propose(tokens, 3) == [9, 5, 2]
    assert NgramDrafter(min_n=2, max_n=2).propose(tokens, 3) == [7, 8, 1]  # the latest [2, 3]


def test_no_earlier_occurrence_drafts_nothing():
    assert NgramDrafter().propose([1, 2, 3, 4, 5, 6], 4) == []
    assert NgramDrafter().propose([1, 2], 4) == []  # too short to hold a suffix and an earlier match
    assert NgramDrafter().propose([1, 2, 1, 2], 0) == []


def test_a_periodic_sequence_drafts_into_its_own_suffix():
    assert NgramDrafter().propose([4, 5, 4, 5, 4], 5) == [5, 4]  # [5, 4] after [4,5,4] at 0: only 2 tokens known


def test_a_sequence_that_shrinks_is_refused():
    drafter = NgramDrafter()
    drafter.propose([1, 2, 3, 1, 2, 3], 2)
    with pytest.raises(ValueError, match="shrank"):
        drafter.propose([1, 2, 3], 2)


def test_bad_n_gram_sizes_are_refused():
    with pytest.raises(ConfigError, match="max_n"):
        NgramDrafter(min_n=3, max_n=2)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=60),
    st.integers(1, 6),
    st.integers(1, 3),
    st.integers(0, 2),
    st.lists(st.integers(1, 8), min_size=1, max_size=10),
)
def test_the_growing_index_proposes_what_a_scan_finds(tokens, k, min_n, extra, cuts):
    """Proposals at growing prefixes (as a sequence grows step by step) equal the scanning twin's."""
    drafter = NgramDrafter(min_n=min_n, max_n=min_n + extra)
    end = 0
    for cut in cuts:
        end = min(len(tokens), end + cut)
        prefix = tokens[:end]
        assert drafter.propose(prefix, k) == propose_by_scan(prefix, k, min_n, min_n + extra)
