"""A filesystem out of inodes (not bytes) is named as such, with a clear error and no traceback,
whether no inode is left at all or the failed command's cleanup freed the few it had taken; nothing
is left behind."""

from __future__ import annotations

import subprocess

import pytest

from tests.support import run_ckptctl, staging_dirs, write_tiny_checkpoint


@pytest.fixture
def few_inodes(tmp_path):
    """A tmpfs with 16 MB of space and 30 inodes; unmounted after the test."""
    where = tmp_path / "mnt"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,nr_inodes=30", "tmpfs", str(where)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize("left", [0, 2])
def test_out_of_inodes_says_inodes(tmp_path, few_inodes, left):
    src = write_tiny_checkpoint(tmp_path / "src")
    filler = few_inodes / "filler"
    filler.mkdir()
    made = []
    for i in range(100):
        try:
            (filler / str(i)).touch()
        except OSError:
            break
        made.append(filler / str(i))
    for p in made[:left]:
        p.unlink()
    done = run_ckptctl("export", src, few_inodes / "out", timeout=60)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    first = done.stderr.splitlines()[0]
    assert "no free inodes" in first, done.stderr
    assert "remove files" in done.stderr
    assert not (few_inodes / "out").exists() and staging_dirs(few_inodes) == []
