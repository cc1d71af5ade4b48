"""A ``torch.save`` zip archive's tensors, read from its records without importing torch.

``torch.save`` writes a zip archive: ``<name>/data.pkl`` (the pickled object, whose tensors are
``torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, ...)`` calls naming their
storage by a persistent id) and one uncompressed record ``<name>/data/<key>`` per storage.
``torch.load(weights_only=True, mmap=True)`` builds each tensor by mapping record ``<key>`` at the
offset of its data in the file (the local header's offset plus its name and extra fields, the
same arithmetic as here) and viewing it with that offset, size and stride. So the records are
exactly what torch loads when:

- ``data.pkl`` is read by :mod:`ckptctl.format.torch_pickle` (allow-list, nothing imported or
  run; a global outside it refuses the file) and every tensor's rebuild arguments are exactly
  typed (no coercion was needed);
- the archive has a ``version`` record (torch's reader requires one); ``data.pkl`` and every
  storage record are stored uncompressed and lie inside the file;
- each storage record holds at least the storage's bytes (torch maps only that many; a shorter
  record would make torch read the next record's bytes: refused here), and each view lies
  inside its storage (torch refuses that too).

This replaces the former cross-check against ``torch.load``'s own mapping (which imported torch
for every export): the checks above are the conditions under which the two agree, and
``tests/test_torch_records.py`` compares the records byte for byte with ``torch.load`` on files
saved by torch. What the records cannot describe exactly (a legacy non-zip file, a compressed
record, a dtype safetensors lacks, a quantized or sparse tensor, a state dict that needs
``--key``) gives None: the caller loads the file with torch as before.

Refused whoever reads the file (InputError, exit 2): an archive whose ``byteorder`` record says
anything but ``little`` (``big``: its bytes are big-endian; anything else torch refuses itself,
"Unknown endianness type"), and a state dict with two keys of one name (``1`` and ``"1"``: both
would be tensor ``"1"``, and one would be lost). A storage named again by a later tensor with
another storage type (or size) is the first one's, as ``torch.load`` builds it
(:class:`ckptctl.format.torch_pickle.ScanUnpickler`); ``torch.save`` never writes that, so the
later tensor's view is its own tensor even where it equals an earlier one's (it is exported as
``torch.load`` gives it, under its name, not dropped as a tie).

The archive is the directory of its first record, as torch's reader takes it
(``PyTorchStreamReader``), and every record must lie in it (torch refuses the file otherwise,
"file in archive is not in a subdirectory", and so does this reader): ``data.pkl``, ``version``
and ``byteorder`` are read there only; a ``byteorder`` record deeper down is not torch's and is
not read.
"""

from __future__ import annotations

import math
import os
import stat
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ckptctl.errors import InputError, from_oserror
from ckptctl.format import dtypes as dt
from ckptctl.format.pickle_walk import check_pickles
from ckptctl.format.torch_pickle import Inert, TensorRef, load_pickles
from ckptctl.sources.base import FileId, changed

MAX_PICKLE_BYTES = 1 << 30  # a larger data.pkl is not a state dict: torch reads it
_COMPLETE = "check that the file is a complete torch.save output"


@dataclass(frozen=True)
class Member:
    offset: int  # of its data in the file
    size: int
    stored: bool  # uncompressed, unencrypted


@dataclass(frozen=True)
class ArchiveTensor:
    """One tensor of a state dict as ``torch.load`` would build it from the archive."""

    name: str
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    ident: tuple[Any, ...]  # the view's identity (storage, offset, size, stride, dtype): tied tensors share it
    offset: int | None  # absolute offset of its bytes in the file; None when it is not contiguous


class _Damaged(Exception):
    """The zip structure is broken (truncated, a record past the end)."""


def read_archive_pickle(fd: int, shown: str, limit: int, hint: str) -> tuple[bytes, dict[str, Member], str]:
    """The ``data.pkl`` bytes of the ``torch.save`` zip archive open at ``fd`` (stored, at most
    ``limit`` bytes), its members, and its record prefix (``archive/``). ``shown`` names the file
    in errors: InputError with ``hint`` for anything that is not such an archive (or one of
    another byte order); OSError as it comes (the caller names the read)."""
    with os.fdopen(fd, "rb", closefd=False) as f:
        if f.read(4) != b"PK\x03\x04":
            raise InputError(f"{shown} is not a torch.save zip archive (truncated or damaged)", hint)
        try:
            members, little, prefix = archive_members(f)
        except _Damaged as exc:
            raise InputError(f"{shown} is truncated or damaged ({str(exc)[:120]})", hint) from None
        if not little:
            _refuse_byte_order(f, shown, prefix)
        pkl = members.get(f"{prefix}data.pkl")
        if not prefix or pkl is None or not pkl.stored or pkl.size > limit:
            raise InputError(f"{shown} has no readable data.pkl", hint)
        f.seek(pkl.offset)
        return f.read(pkl.size), members, prefix


def archive_members(f: Any) -> tuple[dict[str, Member], bool, str]:
    """The members of the zip archive in the seekable binary file ``f`` (name -> data offset,
    size, stored), whether it is little-endian (its ``byteorder`` record absent or ``little``),
    and its prefix: the directory of the first record, with its slash, as torch's reader takes
    it. Raises ``_Damaged`` on a broken archive, and on one with a record outside that directory
    (torch refuses it too), and OSError on I/O errors."""
    try:
        size = f.seek(0, os.SEEK_END)
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
            little = True
            first = infos[0].filename if infos else ""
            prefix = first[:first.index("/") + 1] if "/" in first else ""
            stray = next((i.filename for i in infos if not prefix or not i.filename.startswith(prefix)), None)
            if stray is not None:  # torch's reader refuses the file ("not in a subdirectory")
                raise _Damaged(f"record {stray} is outside the archive's directory {prefix or '(none)'}, "
                               "which torch.load refuses")
            out: dict[str, Member] = {}
            for info in infos:
                f.seek(info.header_offset)
                local = f.read(30)
                if len(local) != 30 or local[:4] != b"PK\x03\x04":
                    raise _Damaged(f"member {info.filename} has no local header")
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                start = info.header_offset + 30 + name_len + extra_len
                stored = info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 1
                if start + info.compress_size > size:
                    raise _Damaged(f"member {info.filename} reaches past the end of the file")
                if info.filename in out:
                    raise _Damaged(f"member {info.filename} is stored twice")
                out[info.filename] = Member(start, info.file_size, stored)
                if prefix and info.filename == f"{prefix}byteorder":  # exactly "little" (torch's test)
                    little = info.file_size < 64 and z.read(info) == b"little"
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, struct.error, NotImplementedError,
            zlib.error) as exc:
        raise _Damaged(str(exc) or type(exc).__name__) from None
    return out, little, prefix


def _kind(obj: Any) -> str:
    """What a loaded object is, as torch's own object would be named (a record is a Tensor)."""
    return "Tensor" if isinstance(obj, TensorRef) else type(obj).__name__


def select(obj: Any, path: Path, key: str | None, is_tensor: Any) -> dict[str, Any]:
    """The flat ``{name: tensor}`` state dict of the loaded object ``obj`` (under ``key``, a
    dotted path into nested dicts), as torch or the records read it. Raises InputError."""
    if key:
        for part in key.split("."):
            if not isinstance(obj, Mapping) or part not in obj:
                raise InputError(f"{path}: no key {key!r} in the checkpoint",
                                 f"top-level keys: {', '.join(map(str, list(obj)[:10])) if isinstance(obj, Mapping) else _kind(obj)}")
            obj = obj[part]
    if not isinstance(obj, Mapping):
        raise InputError(f"{path}: holds a {_kind(obj)}, not a state dict", "pass --key to select one")
    flat: dict[str, Any] = {}
    keys: dict[str, Any] = {}
    nested = []
    for k, v in obj.items():
        if is_tensor(v):
            name = str(k)
            if keys.setdefault(name, k) is not k:
                raise InputError(f"{path}: keys {keys[name]!r} and {k!r} both name tensor {name!r}; one would be lost",
                                 "save the state dict again with distinct string keys")
            flat[name] = v
        else:
            nested.append(str(k))
    if not flat:
        hint = "pass --key " + (nested[0] if nested else "state_dict") + " to select the nested state dict"
        raise InputError(f"{path}: no tensors at the top level (keys: {', '.join(nested[:8])})", hint)
    if nested:
        raise InputError(f"{path}: mixes tensors with non-tensor entries ({', '.join(nested[:5])})",
                         "pass --key to select the state dict inside the training checkpoint")
    return flat


def open_regular(path: Path) -> int:
    """A descriptor of the regular file ``path`` (a FIFO is never waited on). Raises InputError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise from_oserror(exc, "cannot read pickle checkpoint") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"{path} is not a regular file (a FIFO, device or directory)",
                         "replace it with the real checkpoint file")
    return fd


def _load(f: Any, path: Any, max_pickle: int) -> tuple[dict[str, Member], str, Any] | None:
    """The members, the archive's prefix and the unpickled object of the ``torch.save`` archive
    in the seekable binary file ``f`` (member offsets are relative to its start), or None when
    torch must read it. Raises InputError (refused) and OSError."""
    f.seek(0)
    if f.read(4) != b"PK\x03\x04":
        return None  # legacy (pre-1.6) format or not torch: torch.load says which
    try:
        members, little, prefix = archive_members(f)
    except _Damaged as exc:
        raise InputError(f"{path}: not a readable torch checkpoint (damaged zip archive: {str(exc)[:160]})",
                         _COMPLETE) from None
    if not little:
        _refuse_byte_order(f, path, prefix)
    pkl = members.get(f"{prefix}data.pkl")
    if not prefix or pkl is None or pkl.size > max_pickle:
        return None  # torch's reader finds no data.pkl where it looks (or one too large to read here): it says
    if not pkl.stored:  # torch inflates it: walked first, so torch never builds what the budget refuses
        _check_compressed(f, path, f"{prefix}data.pkl")
        return None
    version = members.get(f"{prefix}version") or members.get(f"{prefix}.data/version")
    if version is None:  # torch's reader refuses such an archive
        raise InputError(f"{path}: not a readable torch checkpoint (the zip archive has no version record)", _COMPLETE)
    f.seek(version.offset)
    if not version.stored or version.size > 16 or not f.read(version.size).strip().isdigit():
        return None
    f.seek(pkl.offset)
    raw = f.read(pkl.size)
    objs, unsafe, err = load_pickles(raw)
    if unsafe:
        names = sorted(set(unsafe))
        raise InputError(f"{path}: refused to unpickle: it references {', '.join(names[:5])}, outside the "
                         "allow-list of plain tensor checkpoints (nothing was run)",
                         "only plain tensor checkpoints are read; convert it with trusted code first")
    if err or not objs:
        raise InputError(f"{path}: not a readable torch checkpoint (data.pkl: {err})", _COMPLETE)
    return members, prefix, objs[0]


def _check_compressed(f: Any, path: Any, name: str) -> None:
    """Walk the compressed ``data.pkl`` record ``name`` of the archive in ``f`` as every pickle
    is walked (:func:`ckptctl.format.pickle_walk.check_pickles`). Raises InputError."""
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as z:
            if z.getinfo(name).file_size > MAX_PICKLE_BYTES:  # what it inflates to, read up to that
                raise ValueError(f"it inflates to more than {MAX_PICKLE_BYTES:,} bytes")
            raw = z.read(name)
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, RuntimeError, zlib.error, OSError) as exc:
        raise InputError(f"{path}: not a readable torch checkpoint ({name}: {str(exc)[:160]})", _COMPLETE) from None
    _checked, err = check_pickles(raw)
    if err:
        raise InputError(f"{path}: not a readable torch checkpoint (data.pkl: {err})", _COMPLETE)


def read_archive(path: Path, key: str | None) -> dict[str, ArchiveTensor] | None:
    """The state dict (under ``key``) of the ``torch.save`` archive ``path`` as records, or None
    when torch must load it (see the module docstring). Raises InputError for a file that is
    refused whoever reads it: a pickle naming a global outside the allow-list (nothing is run),
    a damaged archive, a storage record shorter than its storage, a view outside its storage,
    another byte order, two keys of one name; OperationalError when it changed while read."""
    fd = open_regular(path)
    try:
        before = FileId.of(os.fstat(fd))
        with os.fdopen(fd, "rb", closefd=False) as f:
            loaded = _load(f, path, MAX_PICKLE_BYTES)
        if FileId.of(os.fstat(fd)) != before:
            raise changed(path)
    except OSError as exc:
        raise from_oserror(exc, "cannot read pickle checkpoint") from None
    finally:
        os.close(fd)
    if loaded is None:
        return None
    members, prefix, obj = loaded
    # a quantized, sparse or meta tensor reads as Inert: torch loads the file and says what it is
    flat = select(obj, path, key, lambda v: isinstance(v, (TensorRef, Inert)))
    out: dict[str, ArchiveTensor] = {}
    for name, ref in flat.items():
        t = _record(path, name, ref, members, prefix)
        if t is None:
            return None
        out[name] = t
    return out


def _refuse_byte_order(f: Any, path: Any, prefix: str) -> None:
    """Refuse the archive in ``f``, whose ``byteorder`` record (in ``prefix``) is not ``little``."""
    name = f"{prefix}byteorder"
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as z:
            order = z.read(name)[:32].decode("latin-1")
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, zlib.error) as exc:
        raise InputError(f"{path}: not a readable torch checkpoint (byteorder: {str(exc)[:160]})", _COMPLETE) from None
    if order == "big":
        raise InputError(f"{path}: its byte order is {order!r} (byteorder record): its tensors' bytes are big-endian",
                         "load it with torch.load (which swaps the bytes) and torch.save it again on a little-endian "
                         "machine, then export that file")
    raise InputError(f"{path}: unknown byte order {order!r} (byteorder record); torch.load refuses it too",
                     "the file is damaged or was not written by torch.save: save the checkpoint again")


def tensor_record(f: Any, where: str, max_pickle: int) -> ArchiveTensor | None:
    """The record of the one tensor a ``torch.save`` archive holds (a DCP chunk), read from the
    seekable binary file ``f``; None when torch must read it. Raises InputError and OSError."""
    loaded = _load(f, where, max_pickle)
    if loaded is None or not isinstance(loaded[2], TensorRef):
        return None
    return _record(Path(where), "", loaded[2], loaded[0], loaded[1])


def _record(path: Path, name: str, ref: TensorRef | Inert, members: dict[str, Member], prefix: str) -> ArchiveTensor | None:
    """One tensor's record, None when torch must build it, InputError when nobody can."""
    if not isinstance(ref, TensorRef):
        return None
    st = ref.storage
    d = dt.get(ref.dtype) if ref.dtype else None
    if not ref.exact or st is None or d is None or d.bits < 8:
        return None  # coerced arguments, a dtype safetensors lacks, sub-byte (F4) packing: torch decides
    if st.dtype is not None and st.dtype != ref.dtype:
        return None
    rec = members.get(f"{prefix}data/{st.key}")
    if rec is None:
        raise InputError(f"{path}: tensor {name!r} needs storage record {prefix}data/{st.key}, which the archive lacks",
                         _COMPLETE)
    if not rec.stored:
        return None
    itemsize = d.itemsize
    nbytes = st.numel * (itemsize if st.dtype is not None else 1)
    if rec.size < nbytes:
        raise InputError(f"{path}: storage record {prefix}data/{st.key} of tensor {name!r} holds {rec.size} bytes, "
                         f"its storage needs {nbytes} (torch would read past the record)", _COMPLETE)
    shape, stride = ref.shape, ref.stride
    numel = math.prod(shape)
    if len(stride) != len(shape) or any(n < 0 for n in shape) or any(s < 0 for s in stride) or ref.offset < 0:
        raise InputError(f"{path}: tensor {name!r} has an invalid view (size {list(shape)}, stride {list(stride)}, "
                         f"offset {ref.offset})", _COMPLETE)
    if numel:
        last = ref.offset + sum((n - 1) * s for n, s in zip(shape, stride))
        if (last + 1) * itemsize > nbytes:
            raise InputError(f"{path}: tensor {name!r} (size {list(shape)}, offset {ref.offset}) reaches past the end "
                             f"of its {nbytes}-byte storage", _COMPLETE)
    expect = 1
    contiguous = True
    for n, s in zip(reversed(shape), reversed(stride)):  # torch's is_contiguous: size-1 dims do not count
        if n != 1 and s != expect:
            contiguous = False
        expect *= n
    # a view of a re-typed storage (see the module docstring) is its own tensor, never a tie
    ident: tuple[Any, ...] = (st.key, ref.offset, shape, stride, d.name) if numel and not st.retyped else (name,)
    offset = rec.offset + ref.offset * itemsize if contiguous and numel else None
    return ArchiveTensor(name, d.name, shape, ident, offset)
