"""Sizes both ways: what format_size prints, parse_size reads back (to its rounding), and
size_at_least is never less than asked."""

from __future__ import annotations

from mlxpaged.units import format_size, parse_size, size_at_least

from hypothesis import given
from hypothesis import strategies as st


def test_sizes_print_in_the_unit_the_settings_read():
    assert format_size(2 * 10**9) == "2.00 GB"
    assert format_size(10**7) == "0.01 GB"  # 10 MB and up: GB
    assert format_size(10**7 - 1) == "10.00 MB"
    assert format_size(1000) == "1.00 KB" and format_size(0) == "0.00 KB"
    assert format_size(None) == "-"  # not known (a front end's empty cell)


@given(st.integers(min_value=0, max_value=10**15))
def test_what_is_printed_reads_back_within_its_rounding(n):
    text = format_size(n)
    unit = text.split()[1]
    assert abs(parse_size(text.replace(" ", "")) - n) <= parse_size("0.01" + unit)


@given(st.integers(min_value=1, max_value=10**15))
def test_size_at_least_is_enough_and_barely_more(n):
    asked = parse_size(size_at_least(n))
    unit = size_at_least(n)[-2:]
    assert n <= asked <= n + parse_size("0.01" + unit)
