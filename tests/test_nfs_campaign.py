"""The crash campaign's kill matrix on a FUSE mount with NFS semantics (issue 18): renameat2 flags
refused for real (so every --overwrite is the journaled two-rename), silly rename of open files,
a minute of dentry/attribute cache. Each trial is ``crash_harness.run_trial`` (I1, I2, I4, I8)
with the invariant of issue 18 checked after every command and before every gc-tmp
(``crash_harness.nfs``). The five states of the issue are in test_nfs_semantics.py; the long mode
is ``python -m bench.nfs_campaign``.
"""

from __future__ import annotations

import json
import random

import pytest

from tests import crash_harness as H
from tests.crash_harness.fixtures import zygote  # noqa: F401 (fixture)
from tests.crash_harness.nfs import NFS_SCENARIOS, run_nfs_trial
from tests.fusefs import MountRefused, mounted

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def nfs_mount(tmp_path_factory):
    try:
        with mounted(tmp_path_factory.mktemp("nfs"), refuse_rename_flags=True, silly="nfs", cache=60) as m:
            yield m
    except MountRefused as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def prepared_nfs(tmp_path_factory, zygote):  # noqa: F811
    cache: dict[str, H.Prepared] = {}
    root = tmp_path_factory.mktemp("nfs-prep")

    def get(name: str) -> H.Prepared:
        if name not in cache:
            cache[name] = H.Prepared(NFS_SCENARIOS[name], root / name, zygote)
        return cache[name]

    return get


def _show(o: H.Outcome) -> str:
    return json.dumps(o.to_dict(), indent=1, default=str)[:3000]


def _expected(point: str) -> str:
    if point in H.PUBLISHED_POINTS:
        return "new"
    return "window" if point == "two-rename-between" else "old"


# the fast subset: every point of one export and the publish points of a resave and of an export
# to a new destination (the long mode kills every scenario at every point, and at random moments)
NAMED = ([("export-sharded-to-single@nfs", p) for p in NFS_SCENARIOS["export-sharded-to-single@nfs"].points]
         + [("resave-dtype@nfs", p) for p in ("sealed", "exchange", "two-rename-between", "published", "after-publish")]
         + [("export-new-destination@nfs", p) for p in ("rename-noreplace", "published")])


@pytest.mark.parametrize("scenario,point", [pytest.param(s, p, id=f"{s}@{p}") for s, p in NAMED])
def test_kill_at_every_named_point_on_nfs_semantics(nfs_mount, prepared_nfs, zygote, scenario, point):  # noqa: F811
    prep = prepared_nfs(scenario)
    recovery = "rerun" if point in ("two-rename-between", "after-publish", "sealed") else "gc"
    o, checks = run_nfs_trial(prep, H.Fault("point", point), nfs_mount.mnt, zygote, recovery=recovery)
    assert o.killed and not o.violations, _show(o)
    assert o.after_kill == _expected(point) or (prep.old_absent and o.after_kill == "old"), _show(o)
    assert o.after_recovery in ("old", "new") and o.leaked_after_gc == 0 and o.rerun_identical, _show(o)
    assert checks >= 4  # after the kill, around gc-tmp, after the re-run
    if point == "two-rename-between":
        assert nfs_mount.faults("rename-flags-refused")  # the fallback was the mount's doing


def test_kill_at_random_moments_on_nfs_semantics(nfs_mount, prepared_nfs, zygote):  # noqa: F811
    prep = prepared_nfs("export-single-to-sharded@nfs")
    rng = random.Random("fast-nfs")
    outcomes = []
    while len(outcomes) < 3 or (not any(o.killed for o in outcomes) and len(outcomes) < 8):
        o, _ = run_nfs_trial(prep, H.random_fault(rng, prep), nfs_mount.mnt, zygote,
                             recovery="gc" if len(outcomes) % 2 else "rerun", poll=len(outcomes) == 0)
        outcomes.append(o)
    for o in outcomes:
        assert not o.violations, _show(o)
        assert o.after_recovery in ("old", "new") and o.rerun_identical, _show(o)
    assert any(o.killed for o in outcomes), [_show(o) for o in outcomes]
