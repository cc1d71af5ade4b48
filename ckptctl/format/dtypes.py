"""safetensors dtypes (as of safetensors 0.8) with their bit widths.

The order of ``DTYPES`` is the order of the Rust ``Dtype`` enum, which is also the order the
official writer uses to lay tensors out (descending), so it must not be changed.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class DType(NamedTuple):
    """A safetensors dtype: its width, whether it is floating, torch's name for it, and since when
    safetensors reads it."""

    name: str
    bits: int
    floating: bool
    torch_name: str | None  # attribute of the torch module, None when torch has no such dtype
    since: str  # first safetensors release that reads it

    @property
    def itemsize(self) -> int:
        """Bytes per element, rounded up (sub-byte types report 1)."""
        return max(1, self.bits // 8)


DTYPES: tuple[DType, ...] = (
    DType("BOOL", 8, False, "bool", "0.3"),
    DType("F4", 4, True, "float4_e2m1fn_x2", "0.6"),
    DType("F6_E2M3", 6, True, None, "0.6"),
    DType("F6_E3M2", 6, True, None, "0.6"),
    DType("U8", 8, False, "uint8", "0.3"),
    DType("I8", 8, False, "int8", "0.3"),
    DType("F8_E5M2", 8, True, "float8_e5m2", "0.4"),
    DType("F8_E4M3", 8, True, "float8_e4m3fn", "0.4"),
    DType("F8_E8M0", 8, True, "float8_e8m0fnu", "0.6"),
    DType("F8_E4M3FNUZ", 8, True, "float8_e4m3fnuz", "0.8"),
    DType("F8_E5M2FNUZ", 8, True, "float8_e5m2fnuz", "0.8"),
    DType("I16", 16, False, "int16", "0.3"),
    DType("U16", 16, False, "uint16", "0.3"),
    DType("F16", 16, True, "float16", "0.3"),
    DType("BF16", 16, True, "bfloat16", "0.3"),
    DType("I32", 32, False, "int32", "0.3"),
    DType("U32", 32, False, "uint32", "0.3"),
    DType("F32", 32, True, "float32", "0.3"),
    DType("C64", 64, False, "complex64", "0.7"),
    DType("F64", 64, True, "float64", "0.3"),
    DType("I64", 64, False, "int64", "0.3"),
    DType("U64", 64, False, "uint64", "0.3"),
)

BY_NAME: dict[str, DType] = {d.name: d for d in DTYPES}
RANK: dict[str, int] = {d.name: i for i, d in enumerate(DTYPES)}
BY_TORCH_NAME: dict[str, DType] = {d.torch_name: d for d in DTYPES if d.torch_name}

# The dtypes ``--dtype`` converts floating tensors to, and the names config.json uses for them.
TARGETS = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
CONFIG_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
# Only these are converted by --dtype: the float formats that carry values (not fp8 scales etc.).
CONVERTIBLE = frozenset({"F16", "BF16", "F32", "F64"})


def get(name: str) -> DType | None:
    return BY_NAME.get(name)


def from_torch(dtype) -> DType:
    """safetensors dtype of a torch dtype (``torch.float16`` -> F16)."""
    key = str(dtype).removeprefix("torch.")
    try:
        return BY_TORCH_NAME[key]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no safetensors equivalent") from None


def numel(shape: tuple[int, ...] | list[int]) -> int:
    """Number of elements of a shape (1 for a scalar)."""
    return math.prod(shape)


def nbytes(dtype: DType, shape: tuple[int, ...] | list[int]) -> int:
    return numel(shape) * dtype.bits // 8
