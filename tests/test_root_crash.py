"""kill -9 at every phase of a multi-component root's export (issue 12): the destination holds the
whole old root or the whole new one, never a mix of components; what a dead writer leaves is one
staging directory gc-tmp removes; running again gives the bytes of a clean run (I8). Real
processes, a real diffusers pipeline (tests/ecosystem), the library's own loader at the end."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ecosystem import by_name, compare
from ckptctl import staging
from ckptctl.api import export
from ckptctl.write.options import ExportOptions
from tests.support import run_ckptctl, staging_dirs

pytest_plugins = ["ecosystem.fixtures"]

# The first of each: components' own points (stage-created, shard-start, sealed, exchange,
# published, after-publish fire in each component's write first), the root's (root-written:
# every component in place; publish / root-published: the root's own publish).
POINTS = ["stage-created", "shard-start", "sealed", "exchange", "published", "after-publish", "root-written",
          "root-published"]


def _files(d: Path) -> dict[str, bytes]:
    return {str((Path(b) / f).relative_to(d)): (Path(b) / f).read_bytes() for b, _, fs in os.walk(d) for f in fs}


@pytest.mark.parametrize("point", POINTS)
def test_kill9_during_a_root_export_leaves_the_old_root_or_the_new(point: str, build_one, tmp_path: Path) -> None:
    src = build_one("diffusers/pipeline")
    dst = tmp_path / "dst"
    export(build_one("diffusers/pipeline-sharded"), dst, ExportOptions(fsync=False, max_shard_size="10KB"))
    (dst / "README.md").write_text("keep me")
    old = _files(dst)
    clean = tmp_path / "clean"
    export(src, clean, ExportOptions(fsync=False))
    new = _files(clean) | {"README.md": b"keep me"}
    assert old != new

    args = ("export", src, dst, "--overwrite")
    proc = run_ckptctl(*args, env={"CKPTCTL_KILL_AT": point})
    assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, proc.stderr)
    assert _files(dst) == (new if point == "root-published" else old)
    left = staging_dirs(tmp_path)
    assert len(left) == 1 and staging.read_owner(left[0])["dest"] == "dst"  # one, recognisably ours
    gc = run_ckptctl("gc-tmp", tmp_path, "--min-age", "0")
    assert gc.returncode == 0 and staging_dirs(tmp_path) == [], gc.stderr
    assert _files(dst) == (new if point == "root-published" else old)

    run_ckptctl(*args, check=True)  # I8: the same bytes as a clean run
    assert _files(dst) == new and staging_dirs(tmp_path) == []
    if point == "root-published":
        e = by_name("diffusers/pipeline")
        assert compare(e.load(src), e.load(dst)) == []
