"""ckptctl/sizes.py on its own: sizes as huggingface_hub parses them (decimal units) plus binary
units, their formatting, and durations; every refusal is a ValueError naming the input."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from huggingface_hub.serialization._base import parse_size_to_int

from ckptctl.sizes import parse_duration, parse_size

_numbers = st.integers(1, 10**6).map(str) | st.tuples(st.integers(0, 999), st.integers(1, 999)).map(
    lambda t: f"{t[0]}.{t[1]}")
_units = st.sampled_from(["KB", "MB", "GB", "TB"]).flatmap(
    lambda u: st.sampled_from([u, u.lower(), u.capitalize(), u[0].lower() + u[1]]))


@given(_numbers, st.sampled_from(["", " "]), _units)
def test_decimal_units_are_huggingface_hubs(number, space, unit):
    text = f"{number}{space}{unit}"
    expected = parse_size_to_int(text)
    if expected > 0:
        assert parse_size(text) == expected
    else:  # e.g. 0.0001KB: hub says 0 bytes, which is no size at all
        with pytest.raises(ValueError, match="must be positive"):
            parse_size(text)


@pytest.mark.parametrize("text,expected", [
    ("5GB", 5 * 10**9), ("20KB", 20_000), ("2GiB", 2 * 2**30), ("1.5MiB", 3 * 2**19), ("4kib", 4096),
    ("1TiB", 2**40), ("123", 123), ("123B", 123), ("  7 mb ", 7_000_000), ("0.5KB", 500),
])
def test_sizes(text, expected):
    assert parse_size(text) == expected


def test_an_int_is_a_size_in_bytes():
    assert parse_size(4096) == 4096


@pytest.mark.parametrize("value", [0, -1])
def test_an_int_that_is_not_positive_is_refused_like_its_string(value):
    with pytest.raises(ValueError, match="must be positive"):
        parse_size(value)


@pytest.mark.parametrize("text,message", [
    ("5XB", r"invalid size unit 'XB' in '5XB'"), ("GB", "invalid size 'GB'"), ("-5GB", "invalid size '-5GB'"),
    ("5 G B", "invalid size"), ("", "invalid size ''"), ("0", "must be positive"), ("0.0001KB", "must be positive"),
    ("1e3", "invalid size '1e3'"),
])
def test_bad_sizes_are_refused_with_the_input_named(text, message):
    with pytest.raises(ValueError, match=message):
        parse_size(text)


@pytest.mark.parametrize("text,seconds", [
    ("30m", 1800.0), ("6h", 21600.0), ("2d", 172800.0), ("1w", 604800.0), ("45", 45.0), ("45s", 45.0),
    ("1.5h", 5400.0), ("30M", 1800.0), (" 2 d ", 172800.0), ("0", 0.0),
])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["10y", "", "m", "-5m", "5 mins", "1h30m"])
def test_bad_durations_are_refused_with_the_input_named(text):
    with pytest.raises(ValueError, match=f"invalid duration {text!r}"):
        parse_duration(text)
