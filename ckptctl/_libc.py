"""The system calls ckptctl needs that the ``os`` module does not offer, through ctypes.

The C library is looked up at each call (``dlopen(NULL)`` of the running program: a few
microseconds, against calls made once a shard or once a chunk of megabytes), so nothing is kept
between calls and ``ctypes`` costs nothing to a command that never calls these. Each function
raises ``OSError`` with the call's errno, ENOSYS where the C library lacks the call.
"""

from __future__ import annotations

import errno
import os
from typing import Any

def _call(names: tuple[str, ...], argtypes: list[Any], *args: Any) -> None:
    """The first of ``names`` the C library has, called with ``args``."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fn = next((f for f in (getattr(libc, n, None) for n in names) if f is not None), None)
    if fn is None:
        raise OSError(errno.ENOSYS, f"{names[0]} not available")
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    if fn(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def renameat2(src: bytes, dst: bytes, flags: int) -> None:
    """renameat2(2) of two paths relative to the working directory."""
    import ctypes

    at_fdcwd = -100
    _call(("renameat2",), [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint],
          at_fdcwd, src, at_fdcwd, dst, flags)


def fallocate(fd: int, offset: int, length: int) -> None:
    """fallocate(2), mode 0: blocks reserved for ``[offset, offset + length)``, reading as zeros,
    the file extended to cover them. Unlike ``os.posix_fallocate`` it never falls back to
    writing zeros where the filesystem cannot allocate: it raises EOPNOTSUPP (or ENOSYS)."""
    import ctypes

    # fallocate64 takes a 64-bit off_t on every ABI (a C library may lack it: 64-bit musl)
    _call(("fallocate64", "fallocate"), [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64],
          fd, 0, offset, length)


def sync_file_range(fd: int, offset: int, length: int) -> None:
    """sync_file_range(2) with SYNC_FILE_RANGE_WRITE: writeback of the dirty pages of
    ``[offset, offset + length)`` started, not waited for. A hint only: durability is fsync's."""
    import ctypes

    sync_file_range_write = 2
    _call(("sync_file_range",), [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint],
          fd, offset, length, sync_file_range_write)


def madvise(address: int, length: int, advice: int) -> None:
    """madvise(2) of the pages ``[address, address + length)`` (page-aligned)."""
    import ctypes

    _call(("madvise",), [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], address, length, advice)


def die_with_parent(sig: int) -> None:
    """prctl(PR_SET_PDEATHSIG, sig): this process gets ``sig`` when the thread that forked it
    ends (a worker never outlives the command that started it)."""
    import ctypes

    pr_set_pdeathsig = 1
    _call(("prctl",), [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong],
          pr_set_pdeathsig, sig, 0, 0, 0)
