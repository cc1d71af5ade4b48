"""Static checks of PyTorch pickles (``.bin``/``.pt``) for ``verify``; torch is not imported.

Nothing in a checked pickle ever runs: it is read by :mod:`ckptctl.format.torch_pickle` (the
reader the export source uses too), which turns allow-listed globals into inert recorders of
tensor metadata and records every other global as unsafe. A DeepSpeed states file (by its name:
``*_optim_states.pt``, ``*_model_states.pt``) is read as the ZeRO source reads it: DeepSpeed's own
data classes (:data:`~ckptctl.format.torch_pickle.DEEPSPEED_GLOBALS`: the loss scaler, the stage
enum, the fragment address) are data, not ``pickle.unsafe_global``; anything else it names still is.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ckptctl.findings import ERROR, INFO, WARNING, Finding
from ckptctl.format import dtypes as dt
from ckptctl.format.header import sniff
from ckptctl.format.tensor import TensorSpec
from ckptctl.format.torch_pickle import DEEPSPEED_GLOBALS, TensorRef, keep_name, load_pickles

_MAX_PICKLE = 1 << 30  # a data.pkl larger than this is not a state dict we can describe


@dataclass
class PickleScan:
    """What a static scan of one torch pickle found."""

    tensors: dict[str, TensorSpec] | None = None  # None: not a flat state dict
    aliases: dict[str, str] = field(default_factory=dict)  # name -> the name it shares storage with
    unsafe: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


def scan_torch_file(path: str, display: str) -> PickleScan:
    """Check a torch.save file (zip or legacy) without executing it. Raises OSError on I/O errors."""
    res = PickleScan()

    def add(code: str, severity: str, message: str, hint: str | None = None, tensor: str | None = None,
            **details: Any) -> None:
        res.findings.append(Finding(code, severity, display, message, hint, tensor, dict(details)))

    with open(path, "rb") as f:
        prefix = f.read(512)
    kind = sniff(prefix)
    if kind == "lfs":
        add("pickle.lfs_pointer", ERROR, f"{display} is a git-LFS pointer, not the checkpoint data",
            "run `git lfs pull` (or download the file again) to fetch the real content")
        return res
    if kind == "html":
        add("pickle.html_page", ERROR, f"{display} is an HTML/XML page, not a torch checkpoint",
            "the download saved an error or login page: download the file again")
        return res
    from ckptctl.sources.zero.files import is_states_file

    data = DEEPSPEED_GLOBALS if is_states_file(os.path.basename(path)) else frozenset()
    if zipfile.is_zipfile(path):
        _scan_zip(path, display, res, add, data)
    else:
        _scan_legacy(path, display, res, add, data)
    if res.unsafe:
        names = sorted(set(res.unsafe))
        add("pickle.unsafe_global", ERROR,
            f"{display}: the pickle references {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}, "
            "outside the tensor allow-list; loading it with pickle would run that code (nothing was run)",
            "do not load it with torch.load(weights_only=False); re-create the checkpoint from trusted code",
            globals=names)
    return res


def _scan_zip(path: str, display: str, res: PickleScan, add: Callable[..., None], data_globals: frozenset[str]
              ) -> None:
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        add("pickle.bad_archive", ERROR, f"{display}: damaged torch zip archive ({exc})",
            "the file is truncated or corrupt: export or download it again")
        return
    with zf:
        pkls = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkls) != 1:
            add("pickle.bad_archive", ERROR, f"{display}: zip archive has {len(pkls)} data.pkl records, expected 1",
                "this is not a torch.save file")
            return
        prefix = pkls[0][: -len("data.pkl")]
        info = zf.getinfo(pkls[0])
        if info.file_size > _MAX_PICKLE:
            add("pickle.bad_archive", ERROR, f"{display}: data.pkl is {info.file_size} bytes; not checked",
                "this is not a plain state dict")
            return
        try:
            data = zf.read(pkls[0])
        except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, zlib.error) as exc:
            add("pickle.bad_archive", ERROR, f"{display}: cannot read data.pkl ({exc})",
                "the file is truncated or corrupt: export or download it again")
            return
        objs, unsafe, err = load_pickles(data, data_globals=data_globals)
        res.unsafe.extend(unsafe)
        if err:
            add("pickle.unreadable", ERROR, f"{display}: data.pkl is not a valid pickle ({err})",
                "the file is corrupt: export or download it again")
            return
        sizes = {i.filename: i.file_size for i in zf.infolist()}
        _collect(objs[0], display, res, add, records=sizes, prefix=prefix + "data/")


def _scan_legacy(path: str, display: str, res: PickleScan, add: Callable[..., None], data_globals: frozenset[str]
                 ) -> None:
    size = os.path.getsize(path)
    if size > _MAX_PICKLE:
        add("pickle.legacy_format", WARNING, f"{display}: not a zip torch.save file and too large to scan",
            "re-save it with a current torch.save")
        return
    with open(path, "rb") as f:
        data = f.read()
    objs, unsafe, err = load_pickles(data, max_pickles=4, data_globals=data_globals)
    res.unsafe.extend(unsafe)
    if err and len(objs) < 4:
        if not objs:
            add("pickle.unreadable", ERROR, f"{display}: neither a torch zip archive nor a pickle ({err})",
                "the file is corrupt or not a torch checkpoint: export or download it again")
        else:
            add("pickle.unreadable", ERROR, f"{display}: legacy torch.save stream is damaged ({err})",
                "the file is corrupt: export or download it again")
        return
    add("pickle.legacy_format", WARNING,
        f"{display}: legacy (pre-1.6, non-zip) torch.save format; storage sizes are not checked",
        "re-save it with a current torch.save (or convert it to safetensors with ckptctl export)")
    _collect(objs[3], display, res, add, records=None, prefix="")


def _collect(obj: Any, display: str, res: PickleScan, add: Callable[..., None], *,
             records: dict[str, int] | None, prefix: str) -> None:
    if not isinstance(obj, dict):
        add("pickle.not_state_dict", INFO, f"{display}: holds a {type(obj).__name__}, not a state dict; "
            "tensor names are not checked", None)
        return
    tensors: dict[str, TensorSpec] = {}
    other = [str(k) for k, v in obj.items() if not isinstance(v, TensorRef)]
    for k, v in obj.items():
        if isinstance(v, TensorRef):
            tensors[str(k)] = v.spec(str(k))
            if records is not None:
                _check_storage(str(k), v, display, add, records, prefix)
    groups: dict[tuple[Any, ...], list[str]] = {}
    for k, v in obj.items():
        if isinstance(v, TensorRef) and v.storage is not None and not v.storage.retyped:  # re-typed: no tie
            groups.setdefault((v.storage.key, v.offset, v.shape, v.stride), []).append(str(k))
    for names in groups.values():
        if len(names) > 1:  # tied weights pickled twice: keep the embedding, as transformers does
            keep = keep_name(names)
            res.aliases.update({n: keep for n in names if n != keep})
    if other:
        add("pickle.not_state_dict", INFO,
            f"{display}: {len(other)} top-level entries are not tensors ({', '.join(other[:5])}); "
            "tensor names are not checked", None, entries=other[:50])
        return
    res.tensors = tensors


def _check_storage(name: str, t: TensorRef, display: str, add: Callable[..., None], records: dict[str, int],
                   prefix: str) -> None:
    st = t.storage
    if st is None:
        return
    rec = prefix + st.key
    if rec not in records:
        add("pickle.storage_missing", ERROR, f"{display}: tensor {name!r} needs storage record {rec}, "
            "which the archive lacks", "the file is damaged: export or download it again", tensor=name)
        return
    itemsize = 1
    if st.dtype is not None:
        d = dt.get(st.dtype)
        itemsize = d.itemsize if d else 1
    need_bytes = st.numel * itemsize
    if records[rec] < need_bytes:
        add("pickle.storage_truncated", ERROR,
            f"{display}: storage {rec} of tensor {name!r} holds {records[rec]} bytes, needs {need_bytes}",
            "the file is damaged: export or download it again", tensor=name,
            record_size=records[rec], expected=need_bytes)
        return
    if dt.numel(t.shape) and t.stride and len(t.stride) == len(t.shape):
        last = t.offset + sum((s - 1) * abs(st_) for s, st_ in zip(t.shape, t.stride))
        d_t = dt.get(t.dtype) if t.dtype else None
        extent = (last + 1) * (d_t.itemsize if d_t else itemsize)
        if extent > records[rec]:
            add("pickle.tensor_out_of_range", ERROR,
                f"{display}: tensor {name!r} (shape {list(t.shape)}, offset {t.offset}) reaches past the end "
                f"of its {records[rec]}-byte storage", "the file is damaged: export or download it again",
                tensor=name)


_CRC_READ = 1 << 20


def zip_crc_findings(path: str, display: str) -> list[Finding]:
    """``--deep``: every record of a torch zip archive against the CRC-32 its archive records.
    ``torch.load`` never checks it (a flipped byte in a storage loads as a changed weight), so a
    mismatch is an error. A record whose CRC-32 is 0 was written without one (torch's
    ``set_crc32_options(False)``) and is not checked; a file that is not a zip archive, or one the
    static scan already found damaged, gives nothing here."""
    out: list[Finding] = []
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError):
        return out
    with zf:
        for info in zf.infolist():
            if info.CRC == 0:
                continue
            try:
                with zf.open(info) as f:  # checks the CRC-32 once the record is read to its end
                    while f.read(_CRC_READ):
                        pass
            except zipfile.BadZipFile as exc:
                out.append(Finding("deep.zip_crc_mismatch", ERROR, display,
                                   f"{display}: record {info.filename} does not match its CRC-32 ({exc}); "
                                   "torch.load would load the changed bytes without a word",
                                   "the file is corrupt: export or download it again", None,
                                   {"record": info.filename}))
            except (OSError, EOFError, ValueError, NotImplementedError):
                continue  # unreadable records are the static scan's and the hash's to report
    return out
