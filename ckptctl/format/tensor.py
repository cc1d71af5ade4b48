"""The one record of a tensor's identity: name, safetensors dtype, shape.

Every other tensor record (a header entry with its offsets, a source tensor with the file its
bytes sit in, a verify or inspect row) holds a ``TensorSpec`` and adds only its own facts."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import repeat
from typing import Any, TypeVar
from math import prod
from operator import attrgetter

from ckptctl.format import dtypes as dt


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, safetensors dtype name (``None`` where a format does not say, e.g. an unreadable
    pickle record) and shape."""

    name: str
    dtype: str | None
    shape: tuple[int, ...]

    # One call each, no helper layers: a metadata pass over 90k tensors asks each several times.
    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the data as stored (the dtype must be known)."""
        return prod(self.shape) * dt.BY_NAME[self.dtype].bits // 8  # = dt.nbytes

    def with_dtype(self, dtype: str) -> "TensorSpec":
        return TensorSpec(self.name, dtype, self.shape)


class SpecFields:
    """A record that holds a ``spec`` (:class:`TensorSpec`) by composition: its name, dtype,
    shape, element count and stored size, read through the spec."""

    __slots__ = ()  # slotted records (a header's TensorInfo) stay slotted
    spec: TensorSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def dtype(self) -> str:
        return self.spec.dtype  # type: ignore[return-value]  # headers, sources and the writer know it

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.shape

    @property
    def numel(self) -> int:
        return self.spec.numel

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes


_R = TypeVar("_R")


def by_columns(cls: type[_R], *columns: Sequence[Any]) -> list[_R]:
    """Records of the slotted, frozen dataclass ``cls`` from one column per field (in field order,
    all of one length), as ``[cls(*row) for row in zip(*columns)]`` makes them but without a call of its
    ``__init__`` per record: ``object.__new__``, then one C loop per field through the field's
    slot (what the frozen ``__init__`` itself does, ``object.__setattr__``, at a Python call per
    field and record: 90k TensorInfo took 57 ms, here 25). Only for a class whose ``__init__``
    just sets its fields."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    n = len(columns[0]) if columns else 0
    if len(columns) != len(names) or hasattr(cls, "__post_init__") or any(len(c) != n for c in columns):
        raise TypeError(f"by_columns needs a column of one length per field of {cls.__name__}, and no __post_init__")
    out = list(map(object.__new__, repeat(cls, n)))
    for name, column in zip(names, columns):
        deque(map(getattr(cls, name).__set__, out, column), 0)
    return out


def dtypes(tensors: Mapping[str, TensorSpec]) -> set[str | None]:
    """The dtypes the tensors are stored in. A header's table (and a view of several) answers from
    its columns (``dtype_set``), without a spec per tensor."""
    fast = getattr(tensors, "dtype_set", None)
    return fast() if fast is not None else set(map(attrgetter("dtype"), tensors.values()))


def strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The element strides of a contiguous (row-major) tensor of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))
