"""``--deep`` on a pickle family that holds the same tensors as its safetensors family
(``layout.converted_pickle``): every tensor's bytes compared, read from the safetensors file by
its header's offsets and from the ``torch.save`` archive by its records
(:func:`ckptctl.sources.torch_archive.read_archive`, no torch). A tensor the records cannot place
exactly (a view that is not contiguous, a compressed record) is not compared."""

from __future__ import annotations

import os
from pathlib import Path

from ckptctl import layout as L
from ckptctl.errors import CkptctlError
from ckptctl.findings import ERROR
from ckptctl.verify.context import Context

_STEP = 8 << 20


def _same(fa: int, a: int, fb: int, b: int, n: int) -> tuple[bool, int]:
    """Whether ``n`` bytes at ``a`` of ``fa`` equal those at ``b`` of ``fb``, and the bytes read."""
    done = 0
    while done < n:
        k = min(_STEP, n - done)
        x, y = os.pread(fa, k, a + done), os.pread(fb, k, b + done)
        if len(x) != k or x != y:
            return False, 2 * (done + len(x))
        done += k
    return True, 2 * n


def compare_twins(ctx: Context) -> None:
    """``deep.pickle_copy_differs``: a tensor whose bytes in the pickle differ from those in the
    safetensors family (loaders pick the safetensors file: ``use_safetensors=False`` gives another
    model)."""
    assert ctx.layout is not None
    try:
        found, read = twin_differences(ctx.root, ctx.layout)
    except OSError as exc:
        ctx.io("", exc)
        return
    ctx.result.bytes_read += read
    for name, differ in sorted(found.items()):
        ctx.add("deep.pickle_copy_differs", ERROR, ctx.disp(name),
                f"{ctx.disp(name)} holds the names, dtypes and shapes of the safetensors files beside it, but "
                f"{len(differ)} tensors have other bytes (e.g. {differ[0]!r}): transformers loads the safetensors "
                "files, `use_safetensors=False` (or a loader of pickles) another model",
                "keep one: `ckptctl resave --repair --prefer safetensors` (or `--prefer pytorch`)",
                tensor=differ[0], tensors=differ[:50])


def twin_differences(root: Path, lay: L.Layout) -> tuple[dict[str, list[str]], int]:
    """For each file of a pickle family marked as the copy of a safetensors family
    (``Family.twin_of``), the tensors whose bytes differ; and the bytes read. Raises OSError."""
    from ckptctl.sources.torch_archive import read_archive

    out: dict[str, list[str]] = {}
    total = 0
    for pt in (f for f in lay.families if f.twin_of):
        st = next((f for f in lay.families if f.container == L.SAFETENSORS and f.slot == pt.slot), None)
        if st is None:
            continue
        where: dict[str, tuple[str, int, int]] = {}  # name -> (file, absolute offset, bytes)
        for n in st.files:
            hdr = lay.reading.header(root / n, display=str(root / n))
            if not hdr.ok:
                return out, total
            for name, ti in hdr.tensors.items():
                where[name] = (n, hdr.data_start + ti.begin, ti.end - ti.begin)
        for n in pt.files:
            try:
                recs = read_archive(root / n, None)
            except CkptctlError:
                continue  # the static scan reports a damaged pickle
            if recs is None:
                continue
            differ, read = _compare_file(root, n, recs, where)
            total += read
            if differ:
                out[n] = differ
    return out, total


def _compare_file(root: Path, name: str, recs: dict, where: dict[str, tuple[str, int, int]]) -> tuple[list[str], int]:
    fds: dict[str, int] = {}
    differ: list[str] = []
    total = 0
    try:
        fds[name] = os.open(root / name, os.O_RDONLY)
        for t, rec in sorted(recs.items()):
            if t not in where or rec.offset is None:
                continue
            file, off, size = where[t]
            if file not in fds:
                fds[file] = os.open(root / file, os.O_RDONLY)
            same, read = _same(fds[name], rec.offset, fds[file], off, size)
            total += read
            if not same:
                differ.append(t)
    finally:
        for fd in fds.values():
            os.close(fd)
    return differ, total
