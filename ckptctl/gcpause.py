"""The cyclic garbage collector paused while a command builds its metadata.

A checkpoint of 90k tensors is read into hundreds of thousands of small acyclic objects (header
entries, specs, source tensors, entries, plan records). Each allocation burst makes the cyclic
collector re-scan everything that survived the last one: a tenth to a fifth of an export's or a
no-op repair's time at that scale, for no garbage (reference counting frees all of it). Paused
for the call, and restored (never enabled if the caller had disabled it)."""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def paused() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
