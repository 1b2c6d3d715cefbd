"""The checks settings and facts run on their fields, in one wording: a ConfigError (a ValueError)
naming the field and the value.

`name` is how the message names the field ("top_p", "logit_bias[5]"). With `setting=True` the field
is a setting the front ends spell as a flag, so the message names it as a placeholder
(`{block_size:0}`, mlxpaged.errors): "block_size=0 ..." in Python, "--block-size 0 ..." on the CLI.
"""

from __future__ import annotations

import math

from mlxpaged.errors import ConfigError


def is_int_at_least(value: object, low: int) -> bool:
    """An int >= low; never a bool, which Python counts as an int."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def require_int(name: str, value: object, low: int = 0, high: float = math.inf, *, setting: bool = False) -> None:
    """A whole number in [low, high] (a count: low=0, a size: low=1)."""
    require_number(name, value, low, high, integer=True, setting=setting)


def require_number(
    name: str,
    value: object,
    low: float,
    high: float = math.inf,
    *,
    low_open: bool = False,
    integer: bool = False,
    setting: bool = False,
) -> None:
    """A finite number in [low, high] ((low, high] if `low_open`); an int if `integer`."""
    allowed = _range_text(low, high, low_open)
    rule = f"an integer {allowed}" if integer else allowed
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise invalid(name, value, rule if integer else f"a number {allowed}", setting=setting)
    too_low = value <= low if low_open else value < low
    if too_low or value > high or (isinstance(value, float) and not math.isfinite(value)):  # NaN compares False
        raise invalid(name, value, rule, setting=setting)


def require_bool(name: str, value: object, *, setting: bool = False) -> None:
    if not isinstance(value, bool):
        raise invalid(name, value, "True or False", setting=setting)


def invalid(name: str, value: object, rule: str, *, setting: bool = False) -> ConfigError:
    """The error for `name` = `value` breaking `rule` ("an integer >= 1"), to raise."""
    param = name if name.isidentifier() else None
    if setting:
        return ConfigError(f"{{{name}:{value!r}}} must be {rule}", param=param)
    return ConfigError(f"{name} must be {rule}, got {value!r}", param=param)


def _range_text(low: float, high: float, low_open: bool) -> str:
    if high == math.inf:
        return f"{'>' if low_open else '>='} {low}"
    return f"in {'(' if low_open else '['}{low}, {high}]"
