"""Running beside a trainer: the follower's CPU and I/O priority lowered (``--priority low``).

``os.nice`` raises the niceness by 10 (the scheduler gives the trainer the CPU first), and
``ioprio_set(2)`` puts the process in the best-effort I/O class at its lowest level (7): the
trainer's own reads and writes go first under the CFQ/BFQ schedulers, and the follower is never
starved outright (the idle class could wait for ever behind a busy trainer). The C library has
no wrapper for ``ioprio_set``: it is called through ``syscall(2)`` with ctypes, looked up at the
call as ``_libc.py`` does. Both are inherited by the threads and processes started afterwards
(the export's writer threads, an ``--on-publish`` command), so this runs first. A refusal (a
seccomp filter, an unknown architecture) is reported, never fatal.
"""

from __future__ import annotations

import errno
import os
import platform

NICE_STEP = 10
IOPRIO_CLASS_BE = 2
IOPRIO_CLASS_SHIFT = 13
IOPRIO_WHO_PROCESS = 1
LOWEST_BE_LEVEL = 7
# ioprio_set's system call number per architecture (include/uapi/asm-generic/unistd.h and arch tables)
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "arm64": 30, "riscv64": 30, "i386": 289, "i686": 289,
               "ppc64le": 273, "ppc64": 273, "s390x": 282}


def ioprio_set(io_class: int, level: int) -> None:
    """ioprio_set(IOPRIO_WHO_PROCESS, 0 (this process), class << 13 | level); OSError on failure."""
    import ctypes

    number = _IOPRIO_SET.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"ioprio_set: unknown system call number on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    if syscall(ctypes.c_long(number), ctypes.c_int(IOPRIO_WHO_PROCESS), ctypes.c_int(0),
               ctypes.c_int(io_class << IOPRIO_CLASS_SHIFT | level)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def ioprio_get() -> tuple[int, int]:
    """(class, level) of this process's I/O priority (ioprio_get(2), number = ioprio_set's + 1)."""
    import ctypes

    number = _IOPRIO_SET.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, "ioprio_get: unknown system call number")
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    value = syscall(ctypes.c_long(number + 1), ctypes.c_int(IOPRIO_WHO_PROCESS), ctypes.c_int(0))
    if value < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return value >> IOPRIO_CLASS_SHIFT, value & ((1 << IOPRIO_CLASS_SHIFT) - 1)


def lower() -> list[str]:
    """Lower this process's CPU and I/O priority; returns what could not be done (messages)."""
    problems = []
    try:
        os.nice(NICE_STEP)
    except OSError as exc:
        problems.append(f"cannot lower the CPU priority ({exc.strerror})")
    try:
        ioprio_set(IOPRIO_CLASS_BE, LOWEST_BE_LEVEL)
    except OSError as exc:
        problems.append(f"cannot lower the I/O priority ({exc.strerror or exc})")
    return problems
