"""`ckptctl env` on filesystems that clone (loop-mounted XFS and btrfs, as tests/test_reflink.py
mounts them; skipped where that cannot be done): reflinks reported as working, the type named."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import run_ckptctl
from tests.test_reflink import clone_dir, cloning_fs  # noqa: F401  (the fixtures)


def test_env_sees_reflinks_where_they_work(clone_dir: Path) -> None:  # noqa: F811
    r = run_ckptctl("env", "--json", cwd=clone_dir)
    assert r.returncode == 0, r.stderr
    fs = json.loads(r.stdout)["cwd"]
    assert fs["reflink"] is True and fs["type"] in ("xfs", "btrfs")
    assert list(clone_dir.iterdir()) == []
    text = run_ckptctl("env", cwd=clone_dir).stdout
    assert f"on {fs['type']} " in text and "reflinks: yes" in text
