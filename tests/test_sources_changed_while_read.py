"""Sources that change under an export, and torch archives torch reads otherwise.

- A source replaced while it is exported (a trainer saving its next step by tmp + rename, or
  rewriting a file in place) is refused ("changed while reading", exit 3), for every source kind
  (safetensors, a ``torch.save`` archive, DCP), every way its bytes come over (kernel copy,
  streamed with a conversion, gathered by ``torch.load``, ``dcp.load``) and the clone path
  (``FICLONE``/``FICLONERANGE`` on a loop-mounted XFS). The export stops itself at a fault point
  (``CKPTCTL_STOP_AT=write-data``) after its first tensor, a real second process replaces the
  source, and the export goes on: before the fix it published a mix of the two versions.
- A ``.bin`` whose second persistent id re-types the first one's storage exports what
  ``torch.load`` builds (the first typed storage of a key wins).
- A big-endian ``byteorder`` record, a ``byteorder`` record torch refuses, and the keys ``1`` and
  ``"1"`` (both exported as ``"1"``) are refused (exit 2, one line and a hint).
- A source of more files than ``ulimit -n`` exports (the descriptors kept open are bounded).
"""

from __future__ import annotations

import io
import json
import resource
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from tests.support.builders import state, write_config, write_sharded
from tests.support.cli import clean_env, popen_ckptctl, run_ckptctl, wait_stopped
from tests.support.loaders import load_glob, same

# The concurrent writer: a real process that replaces each file of the source by the next
# version's (``mode`` rename: written to a temporary name, then renamed over it, as trainers and
# huggingface_hub save; ``inplace``: the same bytes written over the old file's, same size).
REPLACER = r"""
import os, sys
src, new, mode = sys.argv[1:4]
for root, _, files in os.walk(new):
    for f in sorted(files):
        rel = os.path.relpath(os.path.join(root, f), new)
        data = open(os.path.join(new, rel), "rb").read()
        dst = os.path.join(src, rel)
        if mode == "rename":
            tmp = dst + ".tmp"
            with open(tmp, "wb") as out:
                out.write(data)
            os.replace(tmp, dst)
        elif os.path.getsize(dst) == len(data):  # a file of another size is not rewritten in place
            with open(dst, "r+b") as out:
                out.write(data)
"""


def _pickles(d: Path, tensors: dict[str, torch.Tensor], per_shard: int = 2) -> None:
    """A sharded ``torch.save`` checkpoint (``pytorch_model-0000k-of-0000n.bin`` + index), as
    transformers wrote them before safetensors."""
    d.mkdir(parents=True, exist_ok=True)
    items = list(tensors.items())
    parts = [dict(items[i:i + per_shard]) for i in range(0, len(items), per_shard)]
    wm = {}
    for k, part in enumerate(parts, 1):
        name = f"pytorch_model-{k:05d}-of-{len(parts):05d}.bin"
        torch.save(part, d / name)
        wm.update(dict.fromkeys(part, name))
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))


def _views(d: Path, seed: int) -> None:
    """Two ``torch.save`` files whose tensors are transposed views (torch must gather them)."""
    sd = state(seed, n=4)
    _pickles(d, {k: v.t() for k, v in sd.items()})


def _dcp(d: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A DCP checkpoint with one ``.distcp`` file per tensor."""
    import torch.distributed.checkpoint as dcp

    dcp.save({k: v.clone() for k, v in tensors.items()},
             storage_writer=dcp.FileSystemWriter(str(d), single_file_per_rank=False), no_dist=True)


def _source(kind: str, d: Path, seed: int) -> None:
    if kind in ("safetensors", "convert", "clone-keep", "clone-range"):
        write_sharded(d, state(seed, n=4), per_shard=2)
    elif kind == "pytorch":
        _pickles(d, state(seed, n=4))
    elif kind == "pytorch-view":
        _views(d, seed)
    elif kind in ("dcp", "dcp-load"):
        _dcp(d, state(seed, n=4))
    else:
        raise AssertionError(kind)
    if kind not in ("dcp", "dcp-load"):
        write_config(d)


def _args(kind: str) -> list[str]:
    if kind in ("convert", "dcp-load"):
        return ["--dtype", "bf16"]
    if kind == "clone-keep":
        return ["--max-shard-size", "keep"]
    return []


def _export_while_replaced(src: Path, new: Path, out: Path, mode: str, args: list[str]) -> tuple[int, str, str]:
    """Export ``src`` to ``out``; at its first ``write-data`` point (one tensor or run written)
    a second process replaces ``src`` by ``new`` (``mode``); every later stop is resumed."""
    proc = popen_ckptctl("export", src, out, "--no-fsync", *args, env={"CKPTCTL_STOP_AT": "write-data"})
    wait_stopped(proc.pid)
    w = subprocess.run([sys.executable, "-c", REPLACER, str(src), str(new), mode], env=clean_env(), timeout=120,
                       capture_output=True, text=True)
    assert w.returncode == 0, w.stderr
    return _resume_until_done(proc)


def _resume_until_done(proc: subprocess.Popen) -> tuple[int, str, str]:
    """Resume ``proc`` at each of its later stops (the next tensors' write-data points) until it exits."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        proc.send_signal(signal.SIGCONT)
        try:
            out_text, err = proc.communicate(timeout=0.1)
            return proc.returncode, out_text, err
        except subprocess.TimeoutExpired:
            continue
    proc.kill()
    raise AssertionError("the export did not finish")


def _check_refused(rc: int, err: str, out: Path) -> None:
    assert rc == 3, err
    lines = [ln for ln in err.splitlines() if ln.startswith(("error:", "hint:"))]
    assert len(lines) == 2 and "changed while reading" in lines[0], err
    assert "Traceback" not in err
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(("_tmp_", "._tmp_"))] == []


KINDS = ["safetensors", "convert", "pytorch", "pytorch-view", "dcp", "dcp-load"]


@pytest.mark.parametrize("mode", ["rename", "inplace"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_source_replaced_during_the_export_is_refused(tmp_path, kind, mode):
    src, new, out = tmp_path / "latest", tmp_path / "next", tmp_path / "out"
    _source(kind, src, 1)
    _source(kind, new, 2)
    rc, _, err = _export_while_replaced(src, new, out, mode, _args(kind))
    _check_refused(rc, err, out)


def test_a_torn_multi_file_save_is_refused(tmp_path):
    """A trainer's save renames its files one by one: the export lists ``latest`` between the
    two renames (shard 1 new, shard 2 old) and the second rename lands after shard 2 was copied.
    Each file read is the version listed, yet the output mixes two steps: refused, because a
    file of the source no longer is the version listed when the shard is done."""
    src, new, out = tmp_path / "latest", tmp_path / "next", tmp_path / "out"
    _source("safetensors", src, 1)
    _source("safetensors", new, 2)
    first = "model-00001-of-00002.safetensors"
    shutil.copyfile(new / first, src / (first + ".tmp"))
    (src / (first + ".tmp")).rename(src / first)  # the trainer's first rename, before the export
    (new / first).unlink()  # what is left to replace: shard 2
    proc = popen_ckptctl("export", src, out, "--no-fsync", env={"CKPTCTL_STOP_AT": "write-data"})
    wait_stopped(proc.pid)  # shard 1's run copied
    proc.send_signal(signal.SIGCONT)
    wait_stopped(proc.pid)  # shard 2's run copied: the trainer's second rename
    w = subprocess.run([sys.executable, "-c", REPLACER, str(src), str(new), "rename"], env=clean_env(), timeout=120,
                       capture_output=True, text=True)
    assert w.returncode == 0, w.stderr
    rc, _, err = _resume_until_done(proc)
    _check_refused(rc, err, out)


def test_a_source_left_alone_exports_as_before(tmp_path):
    """The same stops with nobody writing: the export succeeds and equals its source."""
    src, out = tmp_path / "latest", tmp_path / "out"
    _source("safetensors", src, 1)
    proc = popen_ckptctl("export", src, out, "--no-fsync", env={"CKPTCTL_STOP_AT": "write-data"})
    wait_stopped(proc.pid)
    rc, _, err = _resume_until_done(proc)
    assert rc == 0, err
    assert same(load_glob(out), state(1, n=4))


# ---- the clone path on a filesystem that clones -----------------------------------------------


@pytest.fixture(scope="module")
def xfs(tmp_path_factory) -> Path:
    if shutil.which("mkfs.xfs") is None:
        pytest.skip("mkfs.xfs is not installed")
    base = tmp_path_factory.mktemp("loop-xfs")
    img, mnt = base / "xfs.img", base / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(512 << 20)
    subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(img)], check=True, capture_output=True)
    r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mounting a loop xfs image was refused: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True, capture_output=True)


@pytest.mark.parametrize("mode", ["rename", "inplace"])
@pytest.mark.parametrize("kind", ["clone-keep", "clone-range"])
def test_a_source_replaced_during_a_clone_is_refused(xfs, request, kind, mode):
    """``clone-keep``: each output shard is a source file, cloned whole (``FICLONE``);
    ``clone-range``: one output shard whose runs' aligned middles are cloned (``FICLONERANGE``)."""
    base = xfs / request.node.name.replace("[", "-").replace("]", "")
    base.mkdir()
    try:
        src, new, out = base / "latest", base / "next", base / "out"
        # tensors of whole blocks, so that the clone path is taken
        write_sharded(src, state(1, n=4, rows=256, cols=64), per_shard=2)
        write_sharded(new, state(2, n=4, rows=256, cols=64), per_shard=2)
        rc, _, err = _export_while_replaced(src, new, out, mode, _args(kind))
        _check_refused(rc, err, out)
    finally:
        shutil.rmtree(base)


def test_the_clone_path_still_clones(xfs, request):
    """With nobody writing, the export on XFS still shares its blocks with the source."""
    base = xfs / "still-clones"
    base.mkdir()
    try:
        src, out = base / "latest", base / "out"
        write_sharded(src, state(1, n=4, rows=256, cols=64), per_shard=2)
        r = run_ckptctl("export", src, out, "--no-fsync", "--max-shard-size", "keep", "--json", check=True)
        doc = json.loads(r.stdout)
        assert doc["bytes_cloned"] > 0, doc
        assert same(load_glob(out), state(1, n=4, rows=256, cols=64))
    finally:
        shutil.rmtree(base)


# ---- torch archives: what torch.load builds, or a clear refusal --------------------------------


def _rewrite_member(path: Path, suffix: str, change) -> None:
    """Rewrite the member of ``path`` whose name ends with ``suffix`` (``change(bytes) -> bytes``);
    every other member kept, stored (torch reads such a zipfile-written archive)."""
    src = zipfile.ZipFile(path)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(suffix):
                data = change(data)
            z.writestr(info.filename, data)
    src.close()
    path.write_bytes(buf.getvalue())


def _export(src: Path, out: Path) -> tuple[int, str, str]:
    r = run_ckptctl("export", src, out, "--no-fsync")
    return r.returncode, r.stdout, r.stderr


def test_a_storage_retyped_by_a_later_tensor_exports_what_torch_loads(tmp_path):
    """torch.save refuses to write two dtypes over one storage; a crafted (or damaged) archive
    names storage ``0`` again, as an IntStorage, for ``b``. ``torch.load`` keeps the first typed
    storage of a key: ``b`` is a float32 view of ``a``'s bytes."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    p = src / "pytorch_model.bin"
    torch.save({"a": torch.arange(8, dtype=torch.float32) + 0.5, "b": torch.arange(4, dtype=torch.int32)}, p)

    def retype(data: bytes) -> bytes:
        key1 = b"X\x01\x00\x00\x001"  # BINUNICODE "1": b's storage key
        assert data.count(key1) == 1
        return data.replace(key1, b"X\x01\x00\x00\x000")

    _rewrite_member(p, "/data.pkl", retype)
    expect = torch.load(p, weights_only=True, mmap=True)
    assert expect["b"].dtype == torch.float32  # the premise: torch's view, not the pid's IntStorage
    rc, _, err = _export(src, out)
    assert rc == 0, err
    assert same(load_glob(out), {k: v.clone() for k, v in expect.items()})


@pytest.mark.parametrize("order", [b"big", b"little\n"])
def test_an_archive_of_another_byte_order_is_refused(tmp_path, order):
    """``big``: the bytes are big-endian (torch would swap them on load); ``little\\n``: a record
    torch refuses ("Unknown endianness type"). Before: both exported (the second as little)."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    p = src / "pytorch_model.bin"
    torch.save({"a": torch.arange(6, dtype=torch.float32)}, p)
    _rewrite_member(p, "/byteorder", lambda _: order)
    rc, _, err = _export(src, out)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error:") and lines[1].startswith("hint:"), err
    assert "byte order" in lines[0] and repr(order.decode()) in lines[0], err
    assert not out.exists()


def test_keys_that_name_the_same_tensor_are_refused(tmp_path):
    """``torch.save({1: t, "1": u})``: both would be exported as ``"1"``; one was lost."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    torch.save({1: torch.ones(2), "1": torch.zeros(2), "x": torch.ones(3)}, src / "pytorch_model.bin")
    rc, _, err = _export(src, out)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error:") and lines[1].startswith("hint:"), err
    assert "1" in lines[0] and "'1'" in lines[0], err
    assert not out.exists()


# ---- more source files than descriptors -------------------------------------------------------

FILES = 150
LIMIT = 64


def _many(kind: str, d: Path) -> dict[str, torch.Tensor]:
    sd = state(3, n=FILES, rows=4, cols=4)
    if kind == "safetensors":
        write_sharded(d, sd, per_shard=1)
    elif kind == "pytorch":
        _pickles(d, sd, per_shard=1)
    else:
        _dcp(d, sd)
    return sd


def _low_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, hard))


@pytest.mark.parametrize("kind", ["safetensors", "pytorch", "dcp"])
def test_more_source_files_than_descriptors(tmp_path, kind):
    src, out = tmp_path / "src", tmp_path / "out"
    sd = _many(kind, src)
    assert len([p for p in src.iterdir() if p.suffix in (".safetensors", ".bin", ".distcp")]) == FILES
    r = run_ckptctl("export", src, out, "--no-fsync", preexec_fn=_low_limit, timeout=300)
    assert r.returncode == 0, r.stderr
    assert same(load_glob(out), sd)
