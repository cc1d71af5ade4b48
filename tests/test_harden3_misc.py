"""Smaller defects of issue 33: a filesystem out of inodes (not bytes) is named as such, with a
clear error and no traceback, whether no inode is left at all or the failed command's cleanup
freed the few it had taken."""

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


def _flip_in_record(path, suffix: str) -> None:
    """Flip one bit in the data of the archive's record ending with ``suffix`` (a real torch.save
    file: stored records, the local header before each)."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as zf:
        rec = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    raw = bytearray(path.read_bytes())
    lh = rec.header_offset
    n, m = struct.unpack("<HH", raw[lh + 26:lh + 30])
    raw[lh + 30 + n + m + 41] ^= 0x40
    path.write_bytes(bytes(raw))


def test_deep_checks_the_crc32_of_every_record_of_a_bin(tmp_path, run_cli):
    import json

    import torch

    good = tmp_path / "good"
    good.mkdir()
    torch.save({"model.embed.weight": torch.arange(1000, dtype=torch.float32).reshape(100, 10)},
               good / "pytorch_model.bin")
    (good / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 10}))
    rc, out, err = run_cli("verify", "--deep", "--json", good)
    codes = {f["code"] for c in json.loads(out)["results"] for f in c["findings"]}
    assert "deep.zip_crc_mismatch" not in codes, out
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in good.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    _flip_in_record(bad / "pytorch_model.bin", "data/0")
    assert torch.load(bad / "pytorch_model.bin")["model.embed.weight"].flatten()[10] != 10  # loads, changed
    rc, out, err = run_cli("verify", "--json", bad)
    assert rc == 0, out  # the static checks cannot see it
    rc, out, err = run_cli("verify", "--deep", "--json", bad)
    found = [f for c in json.loads(out)["results"] for f in c["findings"] if f["code"] == "deep.zip_crc_mismatch"]
    assert rc == 1 and len(found) == 1 and found[0]["severity"] == "error", out
    assert found[0]["code"] == "deep.zip_crc_mismatch" and "data/0" in found[0]["message"]
