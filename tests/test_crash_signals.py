"""The crash campaign, extended to SIGTERM and SIGHUP (issue 15): at every named point of export
--overwrite (and the exchange-less publish, a new destination, resave), the signal is handled
like Ctrl-C. Before issue 15 the process died at once (exit -15 / -1): no cleanup (a full-size
staging directory left), no error line, no JSON document. See crash_harness/signal_trial.py."""

from __future__ import annotations

import json
import signal

import pytest

from tests import crash_harness as H
from tests.crash_harness.fixtures import prepared, zygote  # noqa: F401 (fixtures)
from tests.crash_harness.signal_trial import run_signal_trial
from tests.support import ExecRunner

pytestmark = pytest.mark.slow

TERM = [pytest.param(s, p, id=f"{s}@{p}") for s in ("export-sharded-to-single", "resave-dtype")
        for p in H.SCENARIOS[s].points]
HUP = [pytest.param(s, p, id=f"{s}@{p}") for s, p in [
    ("export-sharded-to-single", "write-data"), ("export-sharded-to-single", "sealed"),
    ("export-sharded-to-single", "published"), ("export-two-rename", "two-rename-between"),
    ("export-new-destination", "rename-noreplace"), ("resave-repair", "index")]]


@pytest.mark.parametrize("scenario,point", TERM)
def test_sigterm_at_every_named_point_is_handled_like_ctrl_c(prepared, zygote, tmp_path, scenario, point):
    o = run_signal_trial(prepared(scenario), point, signal.SIGTERM, tmp_path / "t", zygote)
    assert not o.violations, json.dumps(o.to_dict(), indent=1)
    assert o.rc == 143 and o.staging_left == 0 and o.error_lines == 1 and o.rerun_identical


@pytest.mark.parametrize("scenario,point", HUP)
def test_sighup_is_handled_like_ctrl_c(prepared, zygote, tmp_path, scenario, point):
    o = run_signal_trial(prepared(scenario), point, signal.SIGHUP, tmp_path / "t", zygote)
    assert not o.violations, json.dumps(o.to_dict(), indent=1)
    assert o.rc == 129 and o.staging_left == 0 and o.rerun_identical


def test_sigterm_in_a_fresh_interpreter(prepared, tmp_path):
    """The same through ``python -m ckptctl`` (not forked from the warm zygote)."""
    o = run_signal_trial(prepared("export-sharded-to-single"), "shards-written", signal.SIGTERM, tmp_path / "t",
                         ExecRunner())
    assert not o.violations and o.rc == 143, json.dumps(o.to_dict(), indent=1)
