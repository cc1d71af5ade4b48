"""The float formats of safetensors as bit masks, and the scan of a tensor's bytes for NaN, Inf,
all-zero and values a cast to the config's dtype turns into inf, that ``verify --deep`` runs (:mod:`ckptctl.verify.deep`): :func:`check_bits`, the
reference by masks over a whole buffer, and :func:`check_bits_fast` beside it, which must equal it.
numpy only; nothing here imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptctl.format.header import TensorInfo


@dataclass(frozen=True)
class FloatBits:
    bits: int
    exp: int  # exponent mask (all ones = Inf/NaN); 0 when the format has no Inf/NaN by exponent
    man: int  # mantissa mask
    absmask: int  # every bit but the sign
    nan_only: int | None = None  # formats whose only special value is one NaN pattern (after absmask)
    nan_is_signbit: bool = False  # FNUZ: 0x80 is the NaN


# The widths and masks of each float format, little-endian integer views.
FLOAT_BITS: dict[str, FloatBits] = {
    "F64": FloatBits(64, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF, 0x7FFFFFFFFFFFFFFF),
    "F32": FloatBits(32, 0x7F800000, 0x007FFFFF, 0x7FFFFFFF),
    "C64": FloatBits(32, 0x7F800000, 0x007FFFFF, 0x7FFFFFFF),  # two F32 per element
    "F16": FloatBits(16, 0x7C00, 0x03FF, 0x7FFF),
    "BF16": FloatBits(16, 0x7F80, 0x007F, 0x7FFF),
    "F8_E5M2": FloatBits(8, 0x7C, 0x03, 0x7F),
    "F8_E4M3": FloatBits(8, 0, 0, 0x7F, nan_only=0x7F),  # e4m3fn: no Inf, NaN = S.1111.111
    "F8_E4M3FNUZ": FloatBits(8, 0, 0, 0xFF, nan_is_signbit=True),
    "F8_E5M2FNUZ": FloatBits(8, 0, 0, 0xFF, nan_is_signbit=True),
    "F4": FloatBits(8, 0, 0, 0x77),  # two e2m1 values per byte, no Inf/NaN
}
NOT_DECODED = frozenset({"F8_E8M0", "F6_E2M3", "F6_E3M2"})  # no zero / not byte-addressable


@dataclass
class TensorStats:
    nan: int = 0
    inf: int = 0
    nonzero: bool = False
    limit: int | None = None  # a magnitude (bits after absmask) from which a finite value overflows a cast
    over: int = 0  # finite values at or past ``limit``


# The magnitude from which a finite value of each wider format becomes inf when cast to float16
# (round to nearest even: 65520 and above; bfloat16 has no value between 65280 and 65536).
F16_OVERFLOW = {"BF16": 0x4780, "F32": 0x477FF000, "F64": 0x40EFFE0000000000}
OVERFLOW_LIMITS = {"F16": F16_OVERFLOW}  # cast target -> stored dtype -> limit


def _np_dtype(bits: int, kind: str = "u") -> Any:
    import numpy as np

    return np.dtype(f"<{kind}{bits // 8}")


class TensorScanner:
    """Consumes one tensor's bytes in order, in pieces of any size (element splits are carried)."""

    def __init__(self, info: TensorInfo, cast_to: str | None = None) -> None:
        self.info = info
        self.fb = FLOAT_BITS.get(info.dtype)
        self.itemsize = self.fb.bits // 8 if self.fb else 1
        self.carry = b""
        self.stats = TensorStats(limit=OVERFLOW_LIMITS.get(cast_to or "", {}).get(info.dtype))

    def feed(self, mv: memoryview) -> None:
        if self.fb is None:
            return
        if self.carry:
            need = self.itemsize - len(self.carry)
            self.carry += bytes(mv[:need])
            mv = mv[need:]
            if len(self.carry) < self.itemsize:
                return
            check_bits(self.fb, self.carry, self.stats)
            self.carry = b""
        n = len(mv) - len(mv) % self.itemsize
        if n:
            check_bits(self.fb, mv[:n], self.stats)
        if n < len(mv):
            self.carry = bytes(mv[n:])


def check_bits(fb: FloatBits, buf: Any, st: TensorStats) -> None:
    """Add the NaN/Inf counts and whether any value is nonzero of ``buf`` (whole elements of
    format ``fb``) to ``st``: the reference, by bit masks over the whole buffer."""
    import numpy as np

    a = np.frombuffer(buf, dtype=_np_dtype(fb.bits))
    if fb.exp:
        # the exponent bits sit just below the sign: all ones exactly when |x| >= the mask
        mag = a & fb.absmask
        top = mag.max() if mag.size else 0
        if top >= fb.exp:
            special = (a & fb.exp) == fb.exp
            nan = int(np.count_nonzero(special & ((a & fb.man) != 0)))
            st.nan += nan
            st.inf += int(np.count_nonzero(special)) - nan
        if st.limit is not None and top >= st.limit:
            st.over += int(np.count_nonzero((mag >= st.limit) & (mag < fb.exp)))
    elif fb.nan_only is not None:
        st.nan += int(np.count_nonzero((a & fb.absmask) == fb.nan_only))
    elif fb.nan_is_signbit:
        st.nan += int(np.count_nonzero(a == 0x80))
    if not st.nonzero:
        if fb.exp:
            st.nonzero = bool(mag.any())
        else:
            st.nonzero = bool(np.any(a & fb.absmask)) if not fb.nan_is_signbit else bool(np.any(a))


def check_bits_fast(fb: FloatBits, buf: Any, st: TensorStats) -> None:
    """:func:`check_bits`, which it must equal, from two reductions that write nothing: the largest
    magnitude is the larger of the unsigned maximum less its sign bit and the signed maximum. Below
    the special pattern there is no NaN/Inf, above zero a nonzero; a buffer with a special value,
    and the formats whose magnitude is not all-but-sign (FNUZ, F4), are counted by check_bits."""
    if not fb.exp and fb.nan_only is None:
        check_bits(fb, buf, st)
        return
    import numpy as np

    a = np.frombuffer(buf, dtype=_np_dtype(fb.bits))
    if not a.size:
        return
    top = max(int(a.max()) & fb.absmask, int(a.view(_np_dtype(fb.bits, "i")).max()))
    if top >= (fb.exp or fb.nan_only) or (st.limit is not None and top >= st.limit):
        check_bits(fb, buf, st)
    elif top:
        st.nonzero = True
