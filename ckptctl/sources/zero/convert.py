"""fp32 to bf16 or fp16 without torch: the ZeRO source's ``--dtype`` fast path.

The ZeRO source's master weights are fp32, and ``--dtype bf16`` is what users upload. The
reference is :func:`ckptctl.sources.base.convert_bytes` (torch's ``Tensor.to``), which imports
torch (about 300 MiB of RSS) and copies every chunk twice; :func:`convert_chunks` gives the same
bytes with numpy, in steps of ``STEP`` elements so that its temporaries stay a few MiB:

- bf16: round to nearest even on the top 16 bits (``(u + 0x7FFF + ((u >> 16) & 1)) >> 16``), as
  torch rounds; infinities and overflow to infinity come out as torch's;
- fp16: numpy's ``astype(float16)``, correctly rounded (to nearest even) as torch's is;
- a step holding a NaN, any other pair of dtypes, or ``fast=False``: the reference itself
  (torch's NaN bits depend on its vectorised kernel, so they are never guessed).

``tests/test_zero_convert.py`` holds it to the reference on rounding ties, subnormals,
infinities, overflow and NaNs, and the export both ways (``CKPTCTL_FAST_CONVERT=0`` switches it
off).
"""

from __future__ import annotations

from typing import Any, Iterator

from ckptctl.sources.base import convert_bytes

FAST_PAIRS = frozenset({("F32", "BF16"), ("F32", "F16")})
STEP = 1 << 20  # elements converted at once (4 MiB in, 2 MiB out)


def convert_chunks(raw: Any, src: str, dst: str, *, fast: bool = True) -> Iterator[Any]:
    """The bytes of ``raw`` (``src`` elements) as ``dst``, in one or more pieces."""
    if not fast or (src, dst) not in FAST_PAIRS or len(raw) % 4:
        yield convert_bytes(raw, src, dst)
        return
    import numpy as np

    words = np.frombuffer(raw, dtype="<u4")
    for start in range(0, len(words), STEP):
        part = words[start:start + STEP]
        if np.any((part & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)):  # a NaN: torch's own bits
            yield convert_bytes(part.tobytes(), src, dst)  # element by element: the same as whole
            continue
        if dst == "F16":
            with np.errstate(over="ignore"):  # beyond 65504: inf, as torch gives
                yield memoryview(part.view("<f4").astype("<f2")).cast("B")
            continue
        out = part + np.uint32(0x7FFF)  # no NaN: at most 0xFF800000 (-inf) + 0x8000, no wrap-around
        odd = part >> np.uint32(16)
        odd &= np.uint32(1)
        out += odd
        out >>= np.uint32(16)
        yield memoryview(out.astype("<u2")).cast("B")
