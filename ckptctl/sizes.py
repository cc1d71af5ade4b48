"""Parsing and formatting byte sizes.

Decimal units follow huggingface_hub's ``parse_size_to_int`` (``5GB`` = 5 * 10**9); binary units
(``KiB``, ``MiB``, ``GiB``, ``TiB``) are accepted too. Durations for ``--older-than`` live here too.
"""

from __future__ import annotations

import re

CHUNK_BYTES = 16 * 1024 * 1024  # what one read/convert step of a source holds in memory at most

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"2GiB"`` -> 2_147_483_648, ``"123"`` -> 123; an int is a
    byte count. Raises ``ValueError`` for anything else, or for a size that is not positive."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"invalid size {text!r}: expected a byte count or a string like 5GB or 2GiB")
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"size {text!r} must be positive")
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"invalid size {text!r}: expected a number with an optional unit, like 5GB or 2GiB")
    value, unit = float(m.group(1)), m.group(2).upper()
    if unit not in _UNITS:
        raise ValueError(f"invalid size unit {m.group(2)!r} in {text!r}: use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
    result = int(value * _UNITS[unit])
    if result <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return result


_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``"30m"`` -> 1800.0; units s, m, h, d, w (seconds without a unit)."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"invalid duration {text!r}: use a number with s, m, h, d or w, like 30m or 6h")
    return float(m.group(1)) * _SECONDS[m.group(2).lower()]
