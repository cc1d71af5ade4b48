"""A safetensors header's tensors as a column table (:class:`TensorTable`), its views by name
(:class:`SpecView`, :class:`MergedSpecs`), and :class:`Rows`, the builder both header readers
fill in file order and turn into a table in data-offset order."""

from __future__ import annotations

import operator
from array import array
from collections import Counter
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass
from itertools import chain, islice, repeat
from math import prod
from typing import Any, TypeVar

from ckptctl.format.tensor import SpecFields, TensorSpec, by_columns, dtypes


@dataclass(frozen=True, slots=True)
class TensorInfo(SpecFields):
    """One tensor of a safetensors file: its spec and where its bytes sit. ``begin``/``end`` are
    relative to the data section."""

    spec: TensorSpec
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


Offsets = Any  # array("Q"), or a list once an offset does not fit 64 bits (a hostile header)
# look-ups by name a MergedSpecs answers by searching its headers' lists of names before it makes
# their rows (MergedSpecs._part_of): verify's few (an embedding, an lm_head) make none
SCANNED_LOOKUPS = 8


_V = TypeVar("_V")


class _ByColumn(Mapping[str, _V]):
    """A read-only mapping whose views iterate by the subclass's own iterators over its columns
    (``_iter_values``, ``_iter_items``: C loops), not by a ``__getitem__`` per name as
    ``Mapping``'s views would."""

    def keys(self) -> KeysView[str]:
        return _Keys(self)

    def values(self) -> ValuesView[_V]:
        return _Values(self)

    def items(self) -> ItemsView[str, _V]:
        return _Items(self)

    def _iter_values(self) -> Iterator[_V]:
        raise NotImplementedError

    def _iter_items(self) -> Iterator[tuple[str, _V]]:
        raise NotImplementedError


class TensorTable(_ByColumn[TensorInfo]):
    """The tensors of a header by name, in data-offset order, stored by column: a dict from each
    name to its row, the begin and end offsets (``array``), and per row a code into a table of
    the (dtype, shape) pairs the tensors share. A :class:`TensorInfo` is built when it is asked
    for, so a header of a million tensors costs a compact record per tensor, never a tree of
    dicts and lists (nor a million ``TensorInfo``). Read-only."""

    def __init__(self, names: list[str], begin: Offsets, end: Offsets, kind: array[int],
                 kinds: list[tuple[str, tuple[int, ...]]]) -> None:
        self._names = names  # by row (unique)
        self._begin, self._end, self._kind, self._kinds = begin, end, kind, kinds
        self._rows: dict[str, int] | None = None  # name -> row, made by the first look-up by name
        # proven as it was read: from 0, each tensor begins where the one before ends (in order)
        self._contiguous = False

    @classmethod
    def empty(cls) -> TensorTable:
        return cls([], array("Q"), array("Q"), array("I"), [])

    def rows(self) -> dict[str, int]:
        """Name -> row (made by the parser, or by the first look-up by name)."""
        if self._rows is None:
            self._rows = dict(zip(self._names, range(len(self._names))))
        return self._rows

    def row_of(self, name: str) -> int:
        return (self._rows if self._rows is not None else self.rows())[name]

    def __getitem__(self, name: str) -> TensorInfo:
        row = self.row_of(name)
        dtype, shape = self._kinds[self._kind[row]]
        return TensorInfo(TensorSpec(name, dtype, shape), self._begin[row], self._end[row])

    def spec_at(self, row: int) -> TensorSpec:
        dtype, shape = self._kinds[self._kind[row]]
        return TensorSpec(self._names[row], dtype, shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        try:
            self.row_of(name)  # type: ignore[arg-type]
        except (KeyError, TypeError):  # not a name, or not a hashable one
            return False
        return True

    def __repr__(self) -> str:
        return f"TensorTable({len(self)} tensors)"

    def _iter_values(self) -> Iterator[TensorInfo]:
        # C loops over the columns: the records' own constructors are the only Python work
        return map(TensorInfo, self.iter_specs(), self._begin, self._end)

    def _iter_items(self) -> Iterator[tuple[str, TensorInfo]]:
        return zip(self._names, self._iter_values())

    def spec_list(self) -> list[TensorSpec]:
        """Every tensor's spec, in the table's order, made column by column (:func:`by_columns`)."""
        dtypes, shapes = [k[0] for k in self._kinds], [k[1] for k in self._kinds]
        return by_columns(TensorSpec, self._names, list(map(dtypes.__getitem__, self._kind)),
                          list(map(shapes.__getitem__, self._kind)))

    def iter_specs(self) -> Iterator[TensorSpec]:
        """Every tensor's spec, in the table's order (one C loop; no :class:`TensorInfo`)."""
        dtypes, shapes = [k[0] for k in self._kinds], [k[1] for k in self._kinds]
        return map(TensorSpec, self._names, map(dtypes.__getitem__, self._kind), map(shapes.__getitem__, self._kind))

    def specs(self) -> SpecView:
        """The tensors' specs by name (a view, built on demand)."""
        return SpecView(self)

    # columns: what a pass over every tensor needs, without building a record per tensor
    @property
    def kinds(self) -> list[tuple[str, tuple[int, ...]]]:
        """The distinct (dtype, shape) pairs; :attr:`kind_codes` indexes them per row."""
        return self._kinds

    @property
    def kind_codes(self) -> array[int]:
        return self._kind

    @property
    def begins(self) -> Offsets:
        """Each tensor's begin offset, in the table's order (the column itself: read-only)."""
        return self._begin

    @property
    def data_bytes(self) -> int:
        if self._contiguous:  # from 0, each tensor where the one before ends: the sum telescopes
            return self.data_end
        return sum(self._end) - sum(self._begin)

    @property
    def data_end(self) -> int:
        """Where the last tensor in offset order ends (0 without tensors)."""
        return self._end[-1] if len(self._end) else 0

    @property
    def numel(self) -> int:
        """Elements of every tensor together."""
        return sum(prod(self._kinds[k][1]) * n for k, n in self.kind_counts().items())

    def kind_counts(self) -> Counter[int]:
        """How many tensors have each kind code (one C pass)."""
        return Counter(self._kind)

    def dtype_counts(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for k, n in self.kind_counts().items():
            out[self._kinds[k][0]] += n
        return out

    def dtype_set(self) -> set[str]:
        """The dtypes the tensors are stored in (from the kinds in use, no record per tensor)."""
        return {self._kinds[k][0] for k in set(self._kind)}


class SpecView(_ByColumn[TensorSpec]):
    """A :class:`TensorTable`'s specs by name, in its order."""

    def __init__(self, table: TensorTable) -> None:
        self._table = table

    def __getitem__(self, name: str) -> TensorSpec:
        return self._table[name].spec

    def __iter__(self) -> Iterator[str]:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def dtype_set(self) -> set[str]:
        return self._table.dtype_set()

    def _iter_values(self) -> Iterator[TensorSpec]:
        return self._table.iter_specs()

    def _iter_items(self) -> Iterator[tuple[str, TensorSpec]]:
        return zip(self._table, self._iter_values())


class MergedSpecs(_ByColumn[TensorSpec]):
    """Several tensor mappings (the files of a family: each a header's :class:`SpecView` or a
    pickle's dict) read as one, by name; a name in more than one is the last one's, in the order
    ``dict.update`` would give. Only an index from each name to its part is built, by C loops: a
    spec is looked up in its part when asked for, so the 92k tensors of 163 headers are not made
    one spec each unless a rule reads them all."""

    def __init__(self, parts: list[Mapping[str, Any]], *, disjoint: bool | None = None,
                 keys: list[Any] | None = None, where: dict[str, Any] | None = None) -> None:
        """``disjoint``: the caller knows that no name is in two parts: then no index of every
        name is built; a look-up by name asks each part's own (a header's rows) in turn. ``keys``:
        one per part (a shard's file name): the index of every name maps it to its part's key
        (:meth:`keyed_index`), not to the part. ``where`` (with ``keys``): that index, which the
        caller holds already and has proven to be exactly each part's names to its key (verify:
        an index's ``weight_map`` that agrees with the headers); the parts are then disjoint, and
        it is read, never changed."""
        self._parts = parts
        self._where: dict[str, Any] | None = where
        self._disjoint = True if where is not None else disjoint
        self._lookups: list[Mapping[str, Any]] | None = None
        self._scanned = 0  # look-ups by name answered without the headers' rows (_part_of)
        self._by_key: dict[Any, Mapping[str, Any]] | None = None
        if keys is not None:
            if len(keys) != len(parts) or len(set(keys)) != len(keys):
                raise ValueError("MergedSpecs: one distinct key per part")
            self._by_key = dict(zip(keys, parts))
        elif where is not None:
            raise ValueError("MergedSpecs: an index of names needs the parts' keys")
        if self._disjoint is None:
            self._index()

    def _index(self) -> dict[str, Any]:
        if self._where is None:
            where: dict[str, Any] = {}
            for key, part in (self._by_key.items() if self._by_key is not None else zip(self._parts, self._parts)):
                where.update(zip(part, repeat(key)))
            self._where = where
            if self._disjoint is None:
                self._disjoint = len(where) == sum(map(len, self._parts))  # no name in two parts
        return self._where

    def keyed_index(self) -> dict[str, Any]:
        """Each name to its part's key (the last part holding it), with ``keys``: read it, never
        change it."""
        assert self._by_key is not None, "a MergedSpecs made without keys"
        return self._index()

    def _part_of(self, name: str) -> Mapping[str, Any] | None:
        """The part holding ``name`` when the parts are disjoint and no index was built: its
        first :data:`SCANNED_LOOKUPS` look-ups search each header's list of names (a C loop, a
        fraction of a millisecond over 94k names), later ones each header's rows, made then for
        all of them (about 9 ms and 900 pages for 94k names)."""
        if self._lookups is None:
            if self._scanned < SCANNED_LOOKUPS:
                self._scanned += 1
                return next((p for p in self._parts if name in (_names_of(p) if type(p) is SpecView else p)), None)
            self._lookups = [p._table.rows() if type(p) is SpecView else p for p in self._parts]
        for rows, part in zip(self._lookups, self._parts):
            if name in rows:
                return part
        return None

    def get_many(self, names: Iterable[str]) -> dict[str, TensorSpec]:
        """The specs of those of ``names`` the parts hold: where the parts are disjoint and no
        index of names was built, in one pass over each part's names (a set's intersection), each
        spec then found in its header's list; else by name, one at a time."""
        wanted = set(names)
        if self._where is not None or not self._disjoint or self._lookups is not None:
            return {n: v for n in wanted if (v := self.get(n)) is not None}
        out: dict[str, TensorSpec] = {}
        for part in self._parts:
            if not wanted:
                break
            found = wanted.intersection(part)
            wanted -= found
            if type(part) is not SpecView:
                out.update((n, part[n]) for n in found)
                continue
            table = part._table
            # a few found: each by a search of the list; more: by the header's rows, made once
            row = table.row_of if len(found) > SCANNED_LOOKUPS or table._rows is not None else _names_of(part).index
            out.update((n, table.spec_at(row(n))) for n in found)
        return out

    @property
    def disjoint(self) -> bool:
        """No name is in two parts."""
        if self._disjoint is None:
            self._index()
        return bool(self._disjoint)

    def __getitem__(self, name: str) -> TensorSpec:
        if self._where is None and self._disjoint:
            part = self._part_of(name)
            if part is None:
                raise KeyError(name)
            return part[name]  # type: ignore[no-any-return]
        where = self._index()[name]
        return (self._by_key[where] if self._by_key is not None else where)[name]  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[str]:
        if self._disjoint:  # each part's names in turn (a given index's order may be another)
            return chain.from_iterable(self._parts)
        return iter(self._index())

    def __len__(self) -> int:
        if self._disjoint:
            return sum(map(len, self._parts))
        return len(self._index())

    def __contains__(self, name: object) -> bool:
        try:
            if self._where is None and self._disjoint:
                return self._part_of(name) is not None  # type: ignore[arg-type]
            return name in self._index()
        except TypeError:  # not hashable
            return False

    def dtype_set(self) -> set[str | None]:
        if self.disjoint:
            return set().union(*map(dtypes, self._parts))
        return set(map(operator.attrgetter("dtype"), self.values()))

    def _iter_values(self) -> Iterator[TensorSpec]:
        if self.disjoint:  # the merged order is each part's order in turn: no look-up by name
            return chain.from_iterable(part.values() for part in self._parts)
        return map(self.__getitem__, self._index())

    def _iter_items(self) -> Iterator[tuple[str, TensorSpec]]:
        return zip(iter(self), self._iter_values())


class _Keys(KeysView):  # type: ignore[type-arg]
    """The names, iterated by the list's own iterator (``KeysView`` yields them one by one from a
    generator: set operations on 90k names would pay a Python step each)."""

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping)  # type: ignore[no-any-return]


def specs_of(tensors: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """What ``tensors`` holds under those of ``names`` it holds: a :class:`MergedSpecs`'s in one
    pass (:meth:`MergedSpecs.get_many`), any other mapping's one look-up each."""
    if isinstance(tensors, MergedSpecs):
        return tensors.get_many(names)
    return {n: v for n in set(names) if (v := tensors.get(n)) is not None}


def _names_of(view: SpecView) -> list[str]:
    """A header's names by row (read them, never change them)."""
    return view._table._names


def table_of(names: object) -> TensorTable | None:
    """The table whose names ``names`` are (the table itself, or its keys), else None."""
    table = names._mapping if isinstance(names, _Keys) else names
    return table if type(table) is TensorTable else None


class _Values(ValuesView):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[Any]:
        return self._mapping._iter_values()  # type: ignore[attr-defined, no-any-return]


class _Items(ItemsView):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[Any]:
        return self._mapping._iter_items()  # type: ignore[attr-defined, no-any-return]



class Rows:
    """The tensors in the order a header lists them, one compact row each, made into a
    :class:`TensorTable` by :meth:`table`. Both readers fill it: the strict one a row at a time
    (:meth:`append`, :meth:`put`), the fast one by extending the columns."""

    def __init__(self) -> None:
        self.names: list[str] = []  # by row
        self.begin: Offsets = array("Q")
        self.end: Offsets = array("Q")
        self.kind: array[int] = array("I")
        self.kinds: list[tuple[str, tuple[int, ...]]] = []
        self.codes: dict[tuple[str, tuple[int, ...]], int] = {}
        self.dropped: list[int] = []  # rows that hold no tensor (an entry with an error)
        self.rows: dict[str, int] | None = None  # name -> row, when the names are known unique
        # every row so far, from 0, begins where the one before ends and holds a byte at least:
        # the rows are then in offset order and contiguous
        self.chained = True

    def code(self, dtype: str, shape: tuple[int, ...]) -> int:
        key = (dtype, shape)
        c = self.codes.get(key)
        if c is None:
            c = self.codes[key] = len(self.kinds)
            self.kinds.append(key)
        return c

    def append(self, begin: int, end: int, code: int) -> None:
        if self.chained:  # (a row to be filled by put is appended as 0, 0: not chained)
            self.chained = end > begin == (self.end[-1] if self.end else 0)
        if (begin | end) >> 64:
            self._widen()
        self.begin.append(begin)
        self.end.append(end)
        self.kind.append(code)

    def put(self, row: int, info: TensorInfo | None) -> None:
        """Fill a row appended as a placeholder (None: it holds no tensor)."""
        if info is None:
            self.dropped.append(row)
            return
        if (info.begin | info.end) >> 64:
            self._widen()
        self.begin[row], self.end[row] = info.begin, info.end
        self.kind[row] = self.code(info.spec.dtype, info.spec.shape)  # type: ignore[arg-type]

    def _widen(self) -> None:
        if isinstance(self.begin, array):
            self.begin, self.end = list(self.begin), list(self.end)

    def table(self) -> TensorTable:
        """The rows in data-offset order (a stable sort: equal offsets keep the file's order)."""
        names, begin, end, kind = self.names, self.begin, self.end, self.kind
        rows = self.rows
        if self.dropped or not (self.chained or _in_order(begin, end)):
            gone = set(self.dropped)
            order = sorted((r for r in range(len(kind)) if r not in gone), key=lambda r: (begin[r], end[r]))
            names = [names[r] for r in order]
            begin, end, kind = _take(begin, order), _take(end, order), _take(kind, order)
            rows = None  # other rows: made again by the first look-up
        table = TensorTable(names, begin, end, kind, self.kinds)
        table._rows, table._contiguous = rows, self.chained
        return table


def _take(col: Any, order: list[int]) -> Any:
    values = map(col.__getitem__, order)
    return array(col.typecode, values) if isinstance(col, array) else list(values)


def _in_order(begin: Offsets, end: Offsets) -> bool:
    if all(map(operator.lt, begin, islice(begin, 1, None))):
        return True
    pairs = list(zip(begin, end))
    return all(map(operator.le, pairs, islice(pairs, 1, None)))
