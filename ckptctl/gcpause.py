"""The cyclic garbage collector paused while a command builds its metadata.

A checkpoint of 90k tensors is read into hundreds of thousands of small acyclic objects (header
entries, specs, source tensors, entries, plan records). Each allocation burst makes the cyclic
collector re-scan everything that survived the last one: a tenth to a fifth of an export's or a
no-op repair's time at that scale, for no garbage (reference counting frees all of it). Paused
for the call, and restored (never enabled if the caller had disabled it)."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# What a command would free just before its process ends. The CLI ends its process with os._exit
# when it can (``ckptctl.cli._leave``) and asks for these to be kept until then: freeing the
# records of a 92k-tensor export one by one took 50-80 ms of it. Anywhere else (the library, a
# test calling commands in-process) nothing is kept unless the caller asked.
_until_exit: list[Any] | None = None


def keep_until_exit(*objs: Any) -> None:
    """Keep ``objs`` alive until the process ends, when the CLI asked for it (else nothing)."""
    if _until_exit is not None:
        _until_exit.extend(objs)


def hold_until_exit(on: bool) -> None:
    """Start keeping what :func:`keep_until_exit` is given (``on``), or stop and drop it."""
    global _until_exit
    _until_exit = [] if on else None
