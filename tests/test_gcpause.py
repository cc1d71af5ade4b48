"""``ckptctl.gcpause``: the collector paused for a call, and restored as the caller had it."""

from __future__ import annotations

import gc
from pathlib import Path

from ckptctl import gcpause

REPO = Path(__file__).resolve().parents[1]


def test_paused_restores_the_collector_and_never_enables_one_the_caller_disabled() -> None:
    assert gc.isenabled()
    with gcpause.paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gcpause.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
