"""Checking a ratio a bench printed against the figures it printed beside it, both rounded."""

from __future__ import annotations


def from_rounded(
    ratio: float, top: float, bottom: float, ratio_step: float, top_half: float, bottom_half: float
) -> bool:
    """Whether a ratio printed to `ratio_step` can be top / bottom of the figures before they were printed rounded
    (to twice their half steps): it lies in the interval those give, widened by half its own step. Not a first-order
    bound: a 6 ms time printed as 0.006 s over a cold 0.01 s moves the ratio by more than the linearized error
    (a bench gpu row failed so: 68.1% printed, 60% from the printed times, 8.05 allowed)."""
    low = (top - top_half) / (bottom + bottom_half)
    high = (top + top_half) / (bottom - bottom_half) if bottom > bottom_half else float("inf")
    return low - ratio_step / 2 - 1e-9 <= ratio <= high + ratio_step / 2 + 1e-9
