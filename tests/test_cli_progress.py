"""The progress display on a terminal (issue 46): a status line before the bar fills, and the rate
clock started at the first byte written, not while the source was read or a converter imported.
Driven event by event (the display redraws on each event: no timer), on a rich console that is a
terminal."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from ckptctl.cli._output import Output, ProgressReporter
from ckptctl.write.options import ProgressEvent


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> Output:
    monkeypatch.delenv("CI", raising=False)
    out = Output("export")
    out._err = Console(file=io.StringIO(), force_terminal=True, width=120, color_system=None)
    assert out.interactive
    return out


def _screen(out: Output) -> str:
    return out.err.file.getvalue()  # type: ignore[attr-defined]


def test_status_line_then_a_clock_from_the_first_byte(terminal: Output) -> None:
    rep = ProgressReporter(terminal, waiting="preparing the bf16 conversion")
    rep.start()
    assert "reading the source and planning" in _screen(terminal)
    rep(ProgressEvent("plan", total=1000))
    assert "preparing the bf16 conversion" in _screen(terminal)
    task = rep._progress.tasks[0]
    assert not task.started and task.total == 1000  # nothing written yet: no rate, no time left
    rep(ProgressEvent("write", "model-00001-of-00002.safetensors", 100, 1000))
    task = rep._progress.tasks[0]
    assert task.started and task.completed == 100
    assert len(task._progress) == 0  # the bytes before the clock started are not in the rate
    assert "model-00001-of-00002.safetensors" in _screen(terminal)
    rep(ProgressEvent("write", "model-00002-of-00002.safetensors", 600, 1000))
    assert rep._progress.tasks[0].completed == 600 and len(rep._progress.tasks[0]._progress) == 1
    rep(ProgressEvent("publish"))
    assert "publish" in _screen(terminal)
    rep(ProgressEvent("done", done=1000, total=1000))
    assert rep._progress is None


def test_nothing_with_quiet_or_off_a_terminal() -> None:
    quiet = Output("export", quiet=1)
    quiet._err = Console(file=io.StringIO(), force_terminal=True)
    rep = ProgressReporter(quiet)
    rep.start()
    rep(ProgressEvent("plan", total=10))
    assert rep._progress is None and _screen(quiet) == ""
    plain = Output("export")
    plain._err = Console(file=io.StringIO(), force_terminal=False)
    rep = ProgressReporter(plain)
    rep.start()
    rep(ProgressEvent("plan", total=10))
    rep(ProgressEvent("shard-done", "model.safetensors", 10, 10))
    assert _screen(plain) == "wrote model.safetensors (10/10 bytes)\n"
