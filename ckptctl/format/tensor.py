"""The one record of a tensor's identity: name, safetensors dtype, shape.

Every other tensor record (a header entry with its offsets, a source tensor with the file its
bytes sit in, a verify or inspect row) holds a ``TensorSpec`` and adds only its own facts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
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



def dtypes(tensors: Mapping[str, TensorSpec]) -> set[str | None]:
    """The dtypes the tensors are stored in. A header's table (and a view of several) answers from
    its columns (``dtype_set``), without a spec per tensor."""
    fast = getattr(tensors, "dtype_set", None)
    return fast() if fast is not None else set(map(attrgetter("dtype"), tensors.values()))
