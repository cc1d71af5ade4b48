"""One pass over a pickle's opcodes before any unpickler runs: every pickle reader of ckptctl
(torch archives and legacy files, ZeRO rank files, Megatron's ``common.pt``: :mod:`ckptctl.format.torch_pickle`;
DCP ``.metadata``: :mod:`ckptctl.format.dcp_metadata`) calls :func:`check_pickles` and unpickles
only what it passed.

The walk reads each opcode with ``pickletools``' own argument readers (what ``torch.save``
writes most is decoded inline), checks every length field against the bytes that are there (a
hostile length is never allocated), and models what the unpickler would build, one cell per
object (:class:`_Shape`). It refuses (ValueError, one line) a pickle

- whose objects nest deeper than ``_MAX_NESTING`` (CPython hashes a tuple by C recursion: a 2 MB
  pickle of one tuple inside the next, used as a dict key, crashed the process);
- whose dict keys, set items and call arguments repeat more objects by memo reference than
  ``_BUDGET_BASE + _BUDGET_PER_BYTE`` per byte (a 319-byte pickle of memoised tuples took 8 s to
  hash as one key);
- whose objects would take more memory than :data:`MEMORY_BASE` + :data:`MEMORY_PER_BYTE` bytes
  per byte of pickle (the budget of what a real state dict needs; see below). Each opcode is
  charged what CPython 3.11 allocates for what it builds, an upper bound: an empty set 216 bytes,
  a dict 64 and 32 per item, a list 56 and 10 per item, a tuple 40 and 8 per item, a string or
  bytes object 80 and its length, an int 32, a global 256, a stack slot or memo reference 8, a
  call's result (a tensor record, an ``OrderedDict``, a DCP record) 256 and 40 per object among
  its arguments (``set(memoised list)`` copies them all), a BUILD 64 and, for a state given again
  by memo reference, 40 per object it holds, a new memo entry 96 (the unpickler's slot and the
  walk's own entry) and the array the C unpickler grows to hold a memo index (16 bytes per index
  past the highest so far).

The memory budget is proportional to the pickle's size: a real state dict's pickle spends most of
its bytes on the tensors' names, keys and rebuild calls, and by this count its objects take 12 to
34 bytes per pickle byte (measured: ``torch.save`` of 20,000 tensors 23, DeepSpeed's ZeRO rank
files 21 to 34, Megatron's ``common.pt`` 13; what CPython really allocated for them: 8 to 17), so
96 per byte (and 32 MiB for any pickle) leaves them more than twice what they use. DCP's
``.metadata``, whose protocol 4 memoises every object, counts 46 per byte (25 allocated) and gets
128 (:data:`RECORDS_PER_BYTE`). ``tests/test_pickle_budget.py`` holds real files of each kind
under half of it. A pickle built to amplify (20 million one-byte ``EMPTY_SET`` opcodes: over
4 GiB built from 20 MB) stops at the budget, after a walk that keeps one 8-byte slot per object
it has seen.
"""

from __future__ import annotations

import io
import pickletools
import struct
from typing import Any

_MAX_NESTING = 1000  # objects within objects; torch's own checkpoints nest fewer than 20
_BUDGET_BASE, _BUDGET_PER_BYTE = 1 << 22, 8  # objects hashed or passed to calls, for a pickle's size
MEMORY_BASE, MEMORY_PER_BYTE = 32 << 20, 96  # bytes of objects built, for a pickle's size
RECORDS_PER_BYTE = 128  # DCP's .metadata: protocol 4 memoises every object (46 per byte measured)
# what each opcode's object costs beyond its stack slot (bytes); strings and bytes add their length
_COST = {"EMPTY_SET": 216, "EMPTY_DICT": 64, "EMPTY_LIST": 56, "FROZENSET": 216, "DICT": 64, "LIST": 56,
         "BININT": 32, "BININT2": 32, "INT": 32, "LONG": 32, "LONG1": 32, "LONG4": 32, "FLOAT": 24,
         "BINFLOAT": 24, "BINPERSID": 256, "PERSID": 256, "GLOBAL": 256, "STACK_GLOBAL": 256,
         "BYTEARRAY8": 80, "BINBYTES": 40, "SHORT_BINBYTES": 40, "BINBYTES8": 40, "STRING": 80,
         "BINSTRING": 80, "SHORT_BINSTRING": 80, "UNICODE": 80, "SHORT_BINUNICODE": 80, "BINUNICODE8": 80,
         "TUPLE": 40, "TUPLE1": 48, "TUPLE2": 56, "TUPLE3": 64, "EXT1": 64, "EXT2": 64, "EXT4": 64}
# a stack slot; a dict or set entry; a call's result; an object among a call's arguments
_SLOT, _ENTRY, _CALL, _ARG = 8, 64, 256, 40
_EMPTY = {0x8F: _SLOT + _COST["EMPTY_SET"], 0x7D: _SLOT + _COST["EMPTY_DICT"], 0x5D: _SLOT + _COST["EMPTY_LIST"]}
_PUT = 96  # a new memo entry: the C unpickler's slot and this walk's own dict entry
_FRESH = (1, 1)  # an empty container, not yet filled (a list cell of its own once it is filled or memoised)
_LEAF = (1, 0)  # a cell: (objects held, counting repeats by reference; nesting depth); a list when mutable
_MARK = pickletools.markobject
_OPCODES = {ord(code.code): code for code in pickletools.opcodes}
_CALLS = {"REDUCE": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3}  # stack items a call takes: the callable, its arguments
# opcodes without an argument whose model is one of _Shape.ops: byte -> (name, what the walk charges before
# the step, as for any opcode: its cost and a slot per object it leaves)
_DIRECT = {ord(c.code): (c.name, _COST.get(c.name, 0) + _SLOT * len(c.stack_after)) for c in pickletools.opcodes
           if c.arg is None and c.name in ("TUPLE2", "TUPLE3", "FROZENSET", "DICT", "LIST", "ADDITEMS", "SETITEMS",
                                           "APPENDS", "SETITEM", "APPEND", "BUILD", "OBJ", "NEWOBJ", "NEWOBJ_EX",
                                           "DUP")}


def memory_budget(size: int, per_byte: int = MEMORY_PER_BYTE) -> int:
    """Bytes of objects a pickle of ``size`` bytes may build."""
    return MEMORY_BASE + per_byte * size


def _models(shape: "_Shape") -> dict[str, Any]:
    """Each opcode's model (by name) for the walk of ``shape``: what it does to the stack, the
    marks and the memo, and what it is charged beyond the charge before every step."""
    leaf, stack, memo = shape.stack.append, shape.stack, shape.memo
    ops: dict[str, Any] = {
        "MARK": lambda arg: shape.marks.append(len(stack)),
        "BINPUT": shape._put, "LONG_BINPUT": shape._put, "PUT": shape._put,
        "MEMOIZE": lambda arg: shape._put(len(memo)),
        "BINGET": lambda arg: leaf(memo.get(arg, _LEAF)),
        "DUP": lambda arg: leaf(stack[-1]),
        "TUPLE": lambda arg: leaf(shape._new(shape._spend_items(shape._pop_mark(), _SLOT), True)),
        "EMPTY_TUPLE": lambda arg: leaf((1, 1)),
        "TUPLE1": lambda arg: leaf(shape._new(shape._pop(1), True)),
        "TUPLE2": lambda arg: leaf(shape._new(shape._pop(2), True)),
        "TUPLE3": lambda arg: leaf(shape._new(shape._pop(3), True)),
        "BINPERSID": lambda arg: stack.__setitem__(-1, _LEAF),
        "FROZENSET": lambda arg: leaf(shape._new(shape._spend_items(shape._charge(shape._pop_mark()), _ENTRY),
                                                 True)),
        "DICT": lambda arg: leaf(shape._new(shape._spend_items(shape._charge(shape._pop_mark(), 2), _ENTRY // 2))),
        "LIST": lambda arg: leaf(shape._new(shape._spend_items(shape._pop_mark(), 10))),
        "ADDITEMS": lambda arg: shape._into(shape._spend_items(shape._charge(shape._pop_mark()), _ENTRY)),
        "SETITEMS": lambda arg: shape._into(shape._spend_items(shape._charge(shape._pop_mark(), 2), _ENTRY // 2)),
        "APPENDS": lambda arg: shape._into(shape._spend_items(shape._pop_mark(), 10)),
        "SETITEM": lambda arg: shape._into(shape._spend_items(shape._charge(shape._pop(2), 2), _ENTRY // 2)),
        "APPEND": lambda arg: shape._into(shape._spend_items(shape._pop(1), 10)),
        "BUILD": lambda arg: shape._into(shape._build(shape._charge(shape._pop(1)))),
        "OBJ": lambda arg: leaf(shape._new(shape._spend_call(shape._charge(shape._pop_mark())))),
        "INST": lambda arg: leaf(shape._new(shape._spend_call(shape._charge(shape._pop_mark())))),
        "STOP": lambda arg: (stack.clear(), shape.marks.clear()),
    }
    # the callable may hash, copy or return its arguments (frozenset, set, torch.Size, a passthrough)
    ops.update({name: (lambda n: lambda arg: leaf(shape._new(shape._spend_call(shape._charge(shape._pop(n))))))(n)
                for name, n in _CALLS.items()})
    ops["GET"] = ops["LONG_BINGET"] = ops["BINGET"]
    return ops


class _Shape:
    """The opcode walk's model of what the unpickler is about to build, one cell per object: how
    many objects it holds, counting again what it repeats by memo reference, and how deep it
    nests; and what the objects cost (``spent`` bytes, refused past ``memory``)."""

    def __init__(self, budget: int, memory: int, per_byte: int = MEMORY_PER_BYTE) -> None:
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo: dict[Any, Any] = {}
        self.budget = budget
        self.memory, self.spent, self.memo_top, self.per_byte = memory, 0, -1, per_byte
        self.states: dict[int, Any] = {}  # the dict states BUILD has copied once (id -> cell, kept alive)
        self.ops = _models(self)

    def walk(self, data: bytes, pos: int, stream: io.BytesIO) -> int:  # noqa: C901 - one loop over opcodes
        """Check and model the pickle at ``data[pos:]`` up to its STOP; returns where it ends.
        What ``torch.save`` writes most is read here; every other opcode by ``pickletools``'
        own argument readers (``stream`` is ``data``), each length checked against what is there."""
        stack, memo, marks, push, n = self.stack, self.memo, self.marks, self.stack.append, len(data)
        from_bytes = int.from_bytes
        spent, memory = self.spent, self.memory
        try:
            while True:
                if spent > memory:
                    self.spent = spent
                    self._spend(0)
                b = data[pos]
                pos += 1
                if b == 0x72 or b == 0x71:  # LONG_BINPUT, BINPUT
                    idx = from_bytes(data[pos:pos + 4], "little") if b == 0x72 else data[pos]
                    if stack[-1] is _FRESH:  # an empty container: filled later, under this memo entry too
                        stack[-1] = [1, 1]
                    if idx not in memo:
                        spent += _PUT
                    memo[idx] = stack[-1]
                    if idx > self.memo_top:  # the C unpickler's memo array grows to hold it
                        spent += 16 * (idx - self.memo_top)
                        self.memo_top = idx
                    pos += 4 if b == 0x72 else 1
                elif b == 0x68:  # BINGET
                    push(memo.get(data[pos], _LEAF))
                    spent += _SLOT
                    pos += 1
                elif b == 0x4B:  # BININT1 (a cached small int)
                    push(_LEAF)
                    spent += _SLOT
                    pos += 1
                elif b == 0x28:  # MARK
                    marks.append(len(stack))
                    spent += _SLOT
                elif b == 0x58:  # BINUNICODE: a length, then UTF-8
                    end = pos + 4 + from_bytes(data[pos:pos + 4], "little")
                    if end > n:
                        raise ValueError("a string runs past the end of the pickle")
                    str(data[pos + 4:end], "utf-8", "surrogatepass")
                    push(_LEAF)
                    spent += _COST["UNICODE"] + end - pos
                    pos = end
                elif b == 0x52:  # REDUCE: the callable of the arguments, charged (as _CALLS below)
                    args = stack.pop()
                    func = stack[-1]
                    self.budget -= func[0] + args[0]
                    spent += _CALL + _ARG * args[0]
                    if self.budget < 0 or args[1] >= _MAX_NESTING or func[1] >= _MAX_NESTING:
                        self._charge([])
                        self._new([args, func])
                    stack[-1] = [func[0] + args[0] + 1, 1 + max(func[1], args[1])]
                elif b == 0x74:  # TUPLE
                    items = self._pop_mark()
                    spent += _COST["TUPLE"] + _SLOT * len(items)
                    push(self._new(items, True))
                elif b == 0x85:  # TUPLE1
                    item = stack[-1]
                    if item[1] >= _MAX_NESTING:
                        self._new([item])
                    stack[-1] = (item[0] + 1, item[1] + 1)
                    spent += _COST["TUPLE1"]
                elif b == 0x29:  # EMPTY_TUPLE
                    push((1, 1))
                    spent += _SLOT
                elif b in _EMPTY:  # EMPTY_SET, EMPTY_DICT, EMPTY_LIST: a cell of its own when filled or memoised
                    push(_FRESH)
                    spent += _EMPTY[b]
                elif b in (0x51, 0x88, 0x89):  # BINPERSID (a storage), NEWTRUE, NEWFALSE
                    if b == 0x51:
                        stack[-1] = _LEAF
                        spent += _COST["BINPERSID"]
                    else:
                        push(_LEAF)
                        spent += _SLOT
                elif b == 0x94:  # MEMOIZE: a memo put at the next index (protocol 4: DCP's .metadata)
                    idx = len(memo)
                    top = stack[-1]
                    if top is _FRESH:
                        top = stack[-1] = [1, 1]
                    spent += _SLOT
                    if idx not in memo:
                        spent += _PUT
                    memo[idx] = top
                    if idx > self.memo_top:
                        spent += 16 * (idx - self.memo_top)
                        self.memo_top = idx
                elif b == 0x6A and pos + 4 <= n:  # LONG_BINGET
                    push(memo.get(from_bytes(data[pos:pos + 4], "little"), _LEAF))
                    spent += _SLOT
                    pos += 4
                elif b == 0x4E:  # NONE
                    push(_LEAF)
                    spent += _SLOT
                elif (b == 0x4D and pos + 2 <= n) or (b == 0x4A and pos + 4 <= n):  # BININT2, BININT
                    push(_LEAF)
                    spent += _COST["BININT"] + _SLOT
                    pos += 2 if b == 0x4D else 4
                elif b == 0x8C and pos < n and pos + 1 + data[pos] <= n:  # SHORT_BINUNICODE: charged per character
                    end = pos + 1 + data[pos]
                    push(_LEAF)
                    spent += _COST["SHORT_BINUNICODE"] + _SLOT + len(str(data[pos + 1:end], "utf-8", "surrogatepass"))
                    pos = end
                elif b in _DIRECT:  # no argument to read: straight to its model
                    name, cost = _DIRECT[b]
                    self.spent = spent + cost
                    self.ops[name](None)
                    spent = self.spent
                else:
                    code = _OPCODES.get(b)
                    if code is None:
                        raise ValueError(f"unknown pickle opcode 0x{b:02x} at byte {pos - 1}")
                    stream.seek(pos)
                    arg = code.arg.reader(stream) if code.arg is not None else None
                    pos = stream.tell()
                    self.spent = spent + _COST.get(code.name, 0) + _SLOT * len(code.stack_after)
                    if isinstance(arg, (str, bytes, bytearray)):
                        self.spent += len(arg)
                    self.op(code, arg)
                    spent = self.spent
                    if b == 0x2E:  # STOP
                        self._spend(0)
                        return pos
        except IndexError:
            raise ValueError("the pickle ends early or pops more than it pushed") from None

    def op(self, code: Any, arg: Any) -> None:
        """Take one opcode (as ``pickletools.genops`` gives it) into the model."""
        if (step := self.ops.get(code.name)) is not None:
            step(arg)
            return
        before = code.stack_before  # anything else pushes fresh leaves for what it pops
        if _MARK in before:
            self._pop_mark()
            self._pop(before.index(_MARK))
        else:
            self._pop(len(before))
        self.stack.extend(_LEAF for _ in code.stack_after)
        if code.stack_after and not before:  # a constant: push it without asking again
            self.ops[code.name] = lambda arg: self.stack.append(_LEAF)

    def _put(self, idx: Any) -> None:
        """A memo put at ``idx`` of the object on top of the stack."""
        if self.stack[-1] is _FRESH:
            self.stack[-1] = [1, 1]
        if idx not in self.memo:
            self._spend(_PUT)
        self.memo[idx] = self.stack[-1]
        if type(idx) is int and idx > self.memo_top:
            self._spend(16 * (idx - self.memo_top))
            self.memo_top = idx

    def _spend(self, cost: int) -> None:
        self.spent += cost
        if self.spent > self.memory:
            raise ValueError(f"its objects would take more than {self.memory >> 20} MiB, more than a state dict of "
                             f"its size needs (the budget: {MEMORY_BASE >> 20} MiB + {self.per_byte} bytes per "
                             "pickle byte)")

    def _build(self, items: list[Any]) -> list[Any]:
        """BUILD's cost: the object's state, copied into it (a record's ``__dict__.update``).
        A state dict built for this object (the pickler's way) was charged as it was built; one
        given again by memo reference is charged for every object it holds."""
        state = items[0]
        if type(state) is list and id(state) not in self.states:
            self.states[id(state)] = state
            self._spend(_ENTRY)
        else:
            self._spend(_ENTRY + _ARG * state[0])
        return items

    def _spend_items(self, items: list[Any], each: int) -> list[Any]:
        self._spend(each * len(items))
        return items

    def _spend_call(self, items: list[Any], result: int = _CALL) -> list[Any]:
        """A call's (or BUILD's) cost: its result, and what it may copy of its arguments."""
        self._spend(result + _ARG * sum(c[0] for c in items[1:] or items))
        return items

    def _pop(self, n: int) -> list[Any]:
        stack = self.stack
        if n > len(stack):
            raise ValueError("the pickle pops more than it pushed")
        items = stack[len(stack) - n:]
        del stack[len(stack) - n:]
        return items

    def _pop_mark(self) -> list[Any]:
        if not self.marks:
            raise ValueError("the pickle pops to a mark it never set")
        return self._pop(len(self.stack) - self.marks.pop())

    def _charge(self, items: list[Any], step: int = 1) -> list[Any]:
        """Count what a dict's keys (every ``step``-th item), a set's items or a call's arguments hold."""
        self.budget -= sum(c[0] for c in items[::step])
        if self.budget < 0:
            raise ValueError("its dict keys, set items and call arguments repeat more objects by memo "
                             "reference than a pickle of its size could hold otherwise")
        return items

    def _new(self, items: list[Any], frozen: bool = False, extra: int = 1) -> Any:
        """The cell of an object made of ``items`` (raises ValueError when it nests too deep)."""
        if not items:
            return (extra, 1) if frozen else [extra, 1]
        sizes, depths = zip(*items)
        depth = 1 + max(depths)
        if depth > _MAX_NESTING:
            raise ValueError(f"its objects nest more than {_MAX_NESTING} deep")
        return (extra + sum(sizes), depth) if frozen else [extra + sum(sizes), depth]

    def _into(self, items: list[Any]) -> None:
        """``items`` put into the object on top of the stack (append, setitem, build)."""
        if not self.stack:
            raise ValueError("the pickle adds items to nothing")
        target, grown = self.stack[-1], self._new(items, extra=0)
        if type(target) is tuple:  # not a container (the unpickler will refuse): a cell of its own
            target = self.stack[-1] = [target[0], target[1]]
        target[0] += grown[0]
        target[1] = max(target[1], grown[1])


def check_pickles(data: bytes, max_pickles: int = 1, per_byte: int = MEMORY_PER_BYTE) -> tuple[int, str | None]:
    """Walk up to ``max_pickles`` consecutive pickles in ``data`` (a legacy ``torch.save`` stream
    is several) under one budget for all (``per_byte``: :data:`MEMORY_PER_BYTE`, or
    :data:`RECORDS_PER_BYTE` for DCP metadata): (how many passed, the one-line error that stopped
    the walk or None). Only the pickles that passed may be unpickled."""
    stream, checked = io.BytesIO(data), 0
    memory = memory_budget(len(data), per_byte)
    shape, pos = _Shape(_BUDGET_BASE + _BUDGET_PER_BYTE * len(data), memory, per_byte), 0
    try:
        for _ in range(max_pickles):
            pos = shape.walk(data, pos, stream)
            checked += 1
    except (ValueError, struct.error, OverflowError, RecursionError, UnicodeDecodeError) as exc:
        return checked, f"{type(exc).__name__}: {str(exc)[:200]}"
    return checked, None
