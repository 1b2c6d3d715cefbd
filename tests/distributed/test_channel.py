"""A message split over the channel's one or two all_sums comes back whole, whatever its length."""

from __future__ import annotations

from mlxpaged.distributed.channel import (
    FIRST_INTS,
    ROOM,
    RankLostError,
    check_present,
    join_message,
    rest_length,
    split_message,
)

import pytest


@pytest.mark.parametrize("length", [1, ROOM - 1, ROOM, ROOM + 1, FIRST_INTS, 3 * FIRST_INTS + 5])
def test_split_and_join_round_trip(length):
    values = [(7 * i) % 50_000 + 1 for i in range(length)]  # no zeros: padding cannot pass for values
    first, rest = split_message(values)
    assert len(first) == FIRST_INTS  # every rank adds a buffer of the same shape
    assert rest_length(first) == len(rest)
    assert (len(rest) == 0) == (length <= ROOM)  # one all_sum when it fits
    assert join_message(first, rest) == values


def test_a_missing_rank_is_told_by_the_count():
    first, _ = split_message([1, 2, 3])
    present = [first[0], 3, *first[2:]]  # three followers each added 1
    check_present(present, 4)
    with pytest.raises(RankLostError, match="2 of the 3 other ranks took part"):
        check_present([first[0], 2, *first[2:]], 4)
