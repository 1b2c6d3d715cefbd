"""The check benches' tests read printed ratios with (tests/app/printed_ratios.py)."""

from __future__ import annotations

from tests.app.printed_ratios import from_rounded


def test_a_ratio_of_small_rounded_times_is_checked_against_their_whole_interval():
    # bench gpu printed 68.1% for a cached 0.006 s over a cold 0.01 s (3-decimal times): 0.0065 / 0.0095 is 68.4%
    assert from_rounded(68.1, 100 * 0.006, 0.01, 0.1, 0.0005 * 100, 0.0005)
    assert not from_rounded(70.0, 100 * 0.006, 0.01, 0.1, 0.0005 * 100, 0.0005)
    assert not from_rounded(50.0, 100 * 0.006, 0.01, 0.1, 0.0005 * 100, 0.0005)


def test_a_ratio_far_from_its_figures_is_not():
    assert from_rounded(2.00, 10.0, 5.0, 0.01, 0.05, 0.05)
    assert not from_rounded(2.10, 10.0, 5.0, 0.01, 0.05, 0.05)
