"""The split (issue 47): a large sharded checkpoint's shard headers decoded by a forked child
while the index is parsed (``ckptctl/layout/header_split.py``). It may only make a pass faster:
every command's document is the same with it on and off, the child really decodes a share, and
a child that fails, or a shard changed after the child read it, changes nothing in what is found.

The commands run as subprocesses (the split forks only a process with no other thread); the
readings are driven in a subprocess too, where the decodes of this process are counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ckptctl.format.index import encode_index
from ckptctl.layout.header_split import SPLIT_INDEX_BYTES
from tests.support import clean_env

SHARDS = 12
PER_SHARD = 1200  # 14,400 names: an index over SPLIT_INDEX_BYTES
ROOT = Path(__file__).resolve().parents[1]


def _many(d: Path) -> list[Path]:
    """SHARDS shards of PER_SHARD one-element tensors, their index and a config; the shards."""
    d.mkdir()
    weight_map, total, shards = {}, 0, []
    for s in range(SHARDS):
        name = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        tensors = {f"model.layers.{s}.mlp.experts.{e}.down_proj.weight": np.full((1,), e, np.float32)
                   for e in range(PER_SHARD)}
        save_file(tensors, str(d / name))
        weight_map.update({k: name for k in tensors})
        total += 4 * PER_SHARD
        shards.append(d / name)
    (d / "model.safetensors.index.json").write_bytes(encode_index(weight_map, total))
    (d / "config.json").write_text(json.dumps({"model_type": "custom-split-test"}))
    assert (d / "model.safetensors.index.json").stat().st_size >= SPLIT_INDEX_BYTES
    return shards


def _cli(*args: str, split: str) -> subprocess.CompletedProcess:
    env = clean_env({"CKPTCTL_FAST_SPLIT": split, "PYTHONPATH": str(ROOT)})
    return subprocess.run([sys.executable, "-m", "ckptctl", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


@pytest.mark.parametrize("command", [["verify", "--static", "--json"], ["inspect", "--json"]])
def test_a_command_says_the_same_with_the_split_on_and_off(tmp_path: Path, command: list[str]) -> None:
    _many(tmp_path / "ckpt")
    on, off = (_cli(*command, str(tmp_path / "ckpt"), split=s) for s in ("1", "0"))
    assert on.returncode == off.returncode == 0, on.stderr + off.stderr
    assert on.stdout == off.stdout


def test_the_same_damage_is_found_with_the_split_on_and_off(tmp_path: Path) -> None:
    shards = _many(tmp_path / "ckpt")
    data = bytearray(shards[-1].read_bytes())
    data[20:24] = b"\x00\x01\x02\x03"  # inside the last shard's header text: the child's first shard
    shards[-1].write_bytes(bytes(data))
    on, off = (_cli("verify", "--static", "--json", str(tmp_path / "ckpt"), split=s) for s in ("1", "0"))
    assert on.returncode == off.returncode == 1, on.stderr
    assert on.stdout == off.stdout and "header." in on.stdout


_DRIVE = textwrap.dedent("""
    import json, os, sys, time
    import ckptctl.layout.reading as R
    from ckptctl.layout import header_split
    root, mode = sys.argv[1], sys.argv[2]
    decoded = []
    real = R.decode_header
    def counting(hdr, raw, **kw):
        decoded.append((os.getpid(), hdr.path))
        return real(hdr, raw, **kw)
    R.decode_header = counting
    reading = R.MetadataReading(split=True)
    if mode == "child-dies":  # the child kills itself at its first shard
        reading._decoded = lambda path: os.kill(os.getpid(), 9)
    elif mode == "changed":  # a shard rewritten after the child read it: the parent must see the new bytes
        first = reading._decoded
        def then_change(path):
            got = first(path)
            if os.path.basename(path).startswith("model-00012-"):
                data = bytearray(open(path, "rb").read())
                at = data.index(b"down_proj")
                data[at:at + 4] = b"UP__"
                open(path, "wb").write(bytes(data))
            return got
        reading._decoded = then_change
    index = reading.index(os.path.join(root, "model.safetensors.index.json"))
    split = reading._split
    if mode != "child-dies" and split:  # let the child reach the first shard before this process reads
        for _ in range(30000):  # (a wait on the child's progress, not a time: at most 5 minutes)
            if split._board[split._n]:
                break
            time.sleep(0.01)
    names = sorted(n for n in os.listdir(root) if n.endswith(".safetensors"))
    headers = [reading.header(os.path.join(root, n)) for n in names]
    here = [p for pid, p in decoded if pid == os.getpid()]
    reference = R.MetadataReading(split=False)
    same = all(list(h.tensors) == list(reference.header(os.path.join(root, n)).tensors)
               and not h.findings for h, n in zip(headers, names))
    print(json.dumps({"split": type(split).__name__, "decoded_here": len(here), "shards": len(names),
                      "same": same, "taken": bool(split) and split.taken}))
""")


def _drive(root: Path, mode: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _DRIVE, str(root), mode], capture_output=True, text=True,
                       env=clean_env({"PYTHONPATH": str(ROOT)}), cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _forks() -> bool:
    return len(os.sched_getaffinity(0)) >= 2


@pytest.mark.skipif(not _forks(), reason="the split forks only with two CPUs or more")
def test_what_the_child_decodes_the_command_uses(tmp_path: Path) -> None:
    _many(tmp_path / "ckpt")
    got = _drive(tmp_path / "ckpt", "normal")
    assert got["split"] == "HeaderSplit" and got["taken"] and got["same"]
    assert got["decoded_here"] == 0  # the child had taken every shard: none is decoded twice


@pytest.mark.skipif(not _forks(), reason="the split forks only with two CPUs or more")
def test_a_child_that_dies_leaves_every_shard_to_the_command(tmp_path: Path) -> None:
    _many(tmp_path / "ckpt")
    got = _drive(tmp_path / "ckpt", "child-dies")
    assert got["split"] == "HeaderSplit" and got["same"]
    assert got["decoded_here"] == got["shards"]


@pytest.mark.skipif(not _forks(), reason="the split forks only with two CPUs or more")
def test_a_shard_changed_after_the_child_read_it_is_read_as_it_is_now(tmp_path: Path) -> None:
    _many(tmp_path / "ckpt")
    got = _drive(tmp_path / "ckpt", "changed")
    # the child decoded the shard before rewriting it: the command saw other bytes and decoded them
    # itself (the reference, read after the change, agrees); every other shard is the child's
    assert got["same"]
    assert got["decoded_here"] == 1


def test_no_split_below_its_index_size(tmp_path: Path) -> None:
    from ckptctl.layout.reading import MetadataReading

    d = tmp_path / "small"
    d.mkdir()
    save_file({"w": np.zeros(2, np.float32)}, str(d / "model-00001-of-00001.safetensors"))
    (d / "model.safetensors.index.json").write_bytes(
        encode_index({"w": "model-00001-of-00001.safetensors"}, 8))
    reading = MetadataReading(split=True)
    reading.index(d / "model.safetensors.index.json")
    assert reading._split is None
