"""The shared field checks: what they accept, and errors that name the field and the value in the
interface's spelling."""

from __future__ import annotations

import math

from mlxpaged.errors import ConfigError
from mlxpaged.validation import is_int_at_least, require_bool, require_int, require_number

import pytest
from hypothesis import given
from hypothesis import strategies as st


@given(st.one_of(st.integers(-5, 5), st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=2)))
def test_int_check_is_the_obvious_predicate(value):
    obvious = type(value) is int and value >= 1
    assert is_int_at_least(value, 1) == obvious
    if obvious:
        require_int("n", value, low=1)
    else:
        with pytest.raises(ConfigError, match=r"^n must be an integer >= 1, got "):
            require_int("n", value, low=1)


def test_messages_name_the_field_the_rule_and_the_value():
    with pytest.raises(ConfigError, match=r"^top_p must be in \(0.0, 1.0\], got 0.0$") as info:
        require_number("top_p", 0.0, 0.0, 1.0, low_open=True)
    assert info.value.param == "top_p"
    with pytest.raises(ConfigError, match=r"^temperature must be a number >= 0.0, got '1'$"):
        require_number("temperature", "1", 0.0)
    with pytest.raises(ConfigError, match=r"^top_logprobs must be an integer in \[0, 20\], got 21$"):
        require_number("top_logprobs", 21, 0, 20, integer=True)
    with pytest.raises(ConfigError, match=r"^logit_bias\[5\] must be in") as info:
        require_number("logit_bias[5]", math.nan, -100.0, 100.0)
    assert info.value.param is None  # not a setting's name
    with pytest.raises(ConfigError, match=r"^ignore_eos must be True or False, got 1$"):
        require_bool("ignore_eos", 1)


def test_a_setting_is_named_as_each_interface_spells_it():
    with pytest.raises(ConfigError) as info:
        require_int("block_size", 0, low=1, setting=True)
    assert str(info.value) == "block_size=0 must be an integer >= 1"
    assert info.value.render("cli") == "--block-size 0 must be an integer >= 1"
    assert info.value.param == "block_size"


def test_numbers_accept_their_range_and_any_size_of_int():
    require_number("x", 10**400, 0.0)  # an int is finite however large (float() of it would overflow)
    require_number("x", 1, 0.0, 1.0)
    require_number("x", 0.5, 0.0, 1.0, low_open=True)
    for bad in (math.inf, -math.inf, -0.1, True):
        with pytest.raises(ValueError):  # ConfigError is a ValueError: callers' handlers still catch it
            require_number("x", bad, 0.0)
