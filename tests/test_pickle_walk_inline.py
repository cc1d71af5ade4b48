"""The pickle walk's inlined opcodes (MEMOIZE, LONG_BINGET, NONE, BININT2, BININT,
SHORT_BINUNICODE, and the argument-free ones sent straight to their model) give the verdict and
the charge of the opcode-by-opcode model (``_Shape.op`` after ``pickletools``' reader), and a
short argument is refused with pickletools' own message."""

from __future__ import annotations

import io
import pickle
import pickletools

import pytest

from ckptctl.format import pickle_walk as W


def _stepwise(data: bytes) -> int:
    """What the opcode-by-opcode model charges for ``data`` (one pickle)."""
    shape = W._Shape(W._BUDGET_BASE + W._BUDGET_PER_BYTE * len(data), W.memory_budget(len(data)))
    for code, arg, _pos in pickletools.genops(data):
        shape.spent += W._COST.get(code.name, 0) + W._SLOT * len(code.stack_after)
        if isinstance(arg, (str, bytes, bytearray)):
            shape.spent += len(arg)
        shape.op(code, arg)
    return shape.spent


def _walked(data: bytes) -> int:
    shape = W._Shape(W._BUDGET_BASE + W._BUDGET_PER_BYTE * len(data), W.memory_budget(len(data)))
    assert shape.walk(data, 0, io.BytesIO(data)) == len(data)
    return shape.spent


def test_the_inlined_opcodes_charge_what_the_model_charges():
    words = [f"w{i}" for i in range(300)]  # more than 256 memo entries: LONG_BINGET for the repeats
    obj = {"words": words, "again": list(reversed(words)), "pairs": [(i, -i) for i in range(50)],
           "triples": [(None, 70000, "é") for _ in range(3)], "ints": [300, 2**20, -7], "flags": [True, False]}
    data = pickle.dumps(obj, protocol=4)
    names = {code.name for code, _, _ in pickletools.genops(data)}
    assert {"MEMOIZE", "LONG_BINGET", "NONE", "BININT2", "BININT", "SHORT_BINUNICODE", "TUPLE2", "TUPLE3",
            "SETITEMS", "APPENDS"} <= names
    assert _walked(data) == _stepwise(data)
    assert W.check_pickles(data) == (1, None)


@pytest.mark.parametrize("data, message", [
    (b"\x80\x04\x6a\x01\x02", "not enough data in stream to read uint4"),  # LONG_BINGET
    (b"\x80\x02\x4d\x01", "not enough data in stream to read uint2"),  # BININT2
    (b"\x80\x02\x4a\x01\x02\x03", "not enough data in stream to read int4"),  # BININT
    (b"\x80\x04\x8c\x05ab", "expected 5 bytes in a unicodestring1, but only 2 remain"),  # SHORT_BINUNICODE
    (b"\x80\x04\x8c", "not enough data in stream to read uint1"),
    (b"\x80\x04\x94", "the pickle ends early or pops more than it pushed"),  # MEMOIZE of nothing
    (b"\x80\x04N\x86.", "the pickle pops more than it pushed"),  # TUPLE2 of one object
])
def test_a_short_or_unbalanced_pickle_is_refused_as_before(data, message):
    checked, err = W.check_pickles(data)
    assert checked == 0 and err is not None and err.endswith(message)
