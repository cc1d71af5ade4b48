"""torch DCP checkpoints (``.metadata`` + ``*.distcp``) as a source.

``.metadata`` is a pickle; torch's own reader unpickles it without restrictions, so ckptctl reads
it with the allow-list reader of :mod:`ckptctl.format.dcp_metadata` into records of its own, without
importing torch. Every referenced ``.distcp`` byte range is checked to exist inside the checkpoint
before anything is read. A tensor whose chunks are contiguous runs is copied by the kernel
(:mod:`ckptctl.sources.dcp.chunks`, torch-free too); any other tensor (strided chunks, a dtype
conversion) is loaded with ``dcp.load`` when it is written (torch imported then, and the metadata
read again into torch's own classes for torch's FileSystemReader), one at a time, so peak memory
is bounded by the largest tensor.

Each ``.distcp`` file and ``.metadata`` is pinned when the listing reads it (its identity:
:class:`ckptctl.sources.base.FileId`): the writer copies pieces only from those versions, and a
tensor that goes through ``dcp.load`` is read only while its files are still them (checked by
name before and after), so a checkpoint rewritten while it is exported is refused, never mixed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

from ckptctl.errors import InputError, UsageError, from_oserror
from ckptctl.format import dtypes as dt
from ckptctl.format import names as N
from ckptctl.format.dcp_metadata import read_dcp_metadata as read_allowed
from ckptctl.format.dcp_metadata import DType, TensorStorageMetadata, storage_needs
from ckptctl.sources.base import CHUNK_BYTES, FileId, OpenFiles, Source, SourceTensor, changed, read_pinned, same_file
from ckptctl.sources.dcp.chunks import tensor_pieces


def read_dcp_metadata(root: Path, *, torch_classes: bool = False) -> Any:
    """The checkpoint's Metadata (records; torch's objects with ``torch_classes``), unpickled
    with the allow-list. Raises InputError."""
    path = root / N.DCP_METADATA
    try:
        meta, findings = read_allowed(path, str(path), torch_classes=torch_classes)
    except FileNotFoundError:
        raise InputError(f"{root}: no .metadata file; the DCP save did not finish",
                         "save the checkpoint again (DCP writes .metadata last)") from None
    except OSError as exc:
        raise from_oserror(exc, "cannot read DCP metadata") from None
    if meta is None:
        f = findings[0]
        msg = f"{path}: refused to unpickle: {f.message}" if f.code == "dcp.unsafe_global" else f.message
        raise InputError(msg, f.hint)
    return meta


def check_storage(root: Path, meta: Any, pin: Callable[[str, FileId], None] | None = None) -> None:
    """Every byte range the metadata names must exist inside ``root``; ``pin`` gets each file's
    identity."""
    for need in storage_needs(meta):
        rel = need.relative_path
        why = N.member_problem(rel)
        if why:
            raise InputError(f"{root}: DCP storage entry for {need.fqn!r} names {rel!r} ({why})",
                             "the metadata is corrupt or points outside the checkpoint")
        try:
            st = (root / rel).stat()
            size = st.st_size
            if pin is not None:
                pin(str(root / rel), FileId.of(st))
        except FileNotFoundError:
            raise InputError(f"{root}: {rel} is missing (needed by {need.fqn!r})",
                             "copy the missing .distcp file or save the checkpoint again") from None
        except OSError as exc:
            raise from_oserror(exc, "cannot read DCP storage") from None
        if need.end > size:
            raise InputError(f"{root}: {rel} is truncated: {need.fqn!r} needs bytes up to {need.end}, "
                             f"file has {size}", "copy the file again or save the checkpoint again")


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        """torch's reader, with our already-validated metadata instead of its pickle.load."""

        def __init__(self, path: Path, meta: Any) -> None:
            super().__init__(str(path))
            self._meta = meta

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self._meta

    return SafeReader


def _top_keys(meta: Any) -> list[str]:
    return sorted({k.split(".")[0] for k in meta.state_dict_metadata})


def _refuse_mixed(root: Path, meta: Any, tensor_type: type) -> None:
    """A DCP checkpoint whose entries are not all tensors holds a training state (``dcp.save({"model":
    ..., "optimizer": ..., "step": n})``), not one model: exporting it whole would write optimizer
    state as weights. Refused with the keys to choose from."""
    others = sorted(k for k, item in meta.state_dict_metadata.items() if not isinstance(item, tensor_type))
    if not others:
        return
    keys = _top_keys(meta)
    pick = "model" if "model" in keys else keys[0]
    raise UsageError(f"{root} holds a training state, not one model: besides tensors it stores "
                     f"{', '.join(others[:3])}{' ...' if len(others) > 3 else ''}; top-level keys: {', '.join(keys[:12])}",
                     f"choose the state dict with --key (e.g. --key {pick})")


class DcpSource(Source):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._meta: Any = None
        self._torch_meta: Any = None  # torch's own Metadata, read when a tensor must go through dcp.load
        self._fqn: dict[str, str] = {}
        self._torch_dtype: dict[str, str] = {}
        self._files_of: dict[str, set[str]] | None = None  # fqn -> the .distcp files dcp.load reads for it

    @classmethod
    def open(cls, root: Path, *, key: str | None = None, **fields: Any) -> "DcpSource":
        """The DCP checkpoint at ``root`` (``key``: one state dict of a training state);
        ``fields``: the rest of the source's identity (extras, stem, variant)."""
        src = cls(path=root, kind="dcp", **fields)
        meta, ident = read_pinned(root / N.DCP_METADATA, lambda: read_dcp_metadata(root))
        src.pin(root / N.DCP_METADATA, ident)
        check_storage(root, meta, src.pin)
        src._meta = meta
        if not key:
            _refuse_mixed(root, meta, TensorStorageMetadata)
        prefix = f"{key}." if key else ""
        files = OpenFiles(flags=os.O_NOFOLLOW)  # a bounded number open at once, each the version pinned
        try:
            src._list(meta, prefix, lambda path: files.fd(path, src.identity))
            files.check()
        except OSError as exc:
            raise from_oserror(exc, "cannot read DCP storage") from None
        finally:
            files.close()
        if not src.tensors:
            hint = f"pass --key to select the state dict (top-level keys: {', '.join(_top_keys(meta)[:8])})"
            raise InputError(f"{root}: no tensors in the DCP checkpoint" + (f" under {key!r}" if key else ""), hint)
        return src

    def _list(self, meta: Any, prefix: str, open_fd: Callable[[str], int]) -> None:
        """List the tensors under ``prefix``, each with its pieces where its chunks are
        contiguous runs (:mod:`ckptctl.sources.dcp.chunks`; ``open_fd`` opens a ``.distcp``)."""
        root = self.path
        for fqn, item in meta.state_dict_metadata.items():
            if not isinstance(item, TensorStorageMetadata) or not fqn.startswith(prefix):
                continue
            tdtype = getattr(item.properties, "dtype", None)
            if not isinstance(tdtype, DType):
                raise InputError(f"{root}: tensor {fqn!r} has no dtype", "the metadata is corrupt")
            d = dt.get(tdtype.name) if tdtype.name else None
            if d is None:
                raise InputError(f"{root}: tensor {fqn!r} has dtype torch.{tdtype.torch_name}, which safetensors "
                                 "cannot store", "convert it before exporting")
            try:
                shape = tuple(int(x) for x in item.size)
            except (TypeError, ValueError):
                raise InputError(f"{root}: tensor {fqn!r} has no size", "the metadata is corrupt") from None
            name = fqn[len(prefix):]
            pieces = () if d.name == "F4" else tensor_pieces(root, fqn, item, meta.storage_data, d.name, open_fd)
            self.tensors.append(SourceTensor(name, d.name, shape, pieces=pieces))
            self._fqn[name] = fqn
            self._torch_dtype[name] = tdtype.torch_name

    def load_tensor(self, t: SourceTensor) -> Any:
        import torch
        import torch.distributed.checkpoint as dcp

        fqn = self._fqn[t.name]
        if self._torch_meta is None:
            path = self.path / N.DCP_METADATA
            self._torch_meta, ident = read_pinned(path, lambda: read_dcp_metadata(self.path, torch_classes=True))
            if self.identity(path) not in (None, ident):
                raise changed(path)
            self.torch_loaded.append(str(path))
        buf = torch.empty(t.shape, dtype=getattr(torch, self._torch_dtype[t.name]))
        files = self._files(fqn)
        self._unchanged(files)  # torch reads them by name: the versions listed, before and after
        try:
            dcp.load({fqn: buf}, storage_reader=_reader_class()(self.path, self._torch_meta), no_dist=True)
        except Exception as exc:  # noqa: BLE001 - torch wraps read errors in CheckpointException
            self._unchanged(files)  # a file replaced while torch read it is the cause
            cause = exc.__cause__ or exc.__context__
            if isinstance(exc, OSError) or isinstance(cause, OSError):
                raise from_oserror(exc if isinstance(exc, OSError) else cause, f"cannot read tensor {t.name!r}",
                                   phase="write") from None
            raise InputError(f"{self.path}: cannot read tensor {t.name!r} ({type(exc).__name__}: {str(exc)[:200]})",
                             "the DCP files are damaged: save the checkpoint again") from None
        self._unchanged(files)
        return buf

    def _unchanged(self, files: list[str]) -> None:
        for path in files:
            same_file(path, self.identity(path))

    def _files(self, fqn: str) -> list[str]:
        """The ``.distcp`` files that hold ``fqn``'s chunks (the storage map read once)."""
        if self._files_of is None:
            self._files_of = {}
            for idx, info in self._meta.storage_data.items():
                rel = getattr(info, "relative_path", None)
                if isinstance(rel, str):
                    self._files_of.setdefault(str(getattr(idx, "fqn", idx)), set()).add(str(self.path / rel))
        return sorted(self._files_of.get(fqn, ()))

    def chunks(self, t: SourceTensor, target_dtype: str | None = None,
               chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
        if not t.nbytes:  # an empty tensor has no bytes to load
            return
        import torch

        flat = self.load_tensor(t).reshape(-1)
        if flat.numel() == 0:
            return
        per = max(1, chunk_bytes // flat.element_size())
        for i in range(0, flat.numel(), per):
            part = flat[i:i + per]
            if target_dtype and target_dtype != t.dtype:
                part = part.to(getattr(torch, dt.BY_NAME[target_dtype].torch_name))
            yield memoryview(part.view(torch.uint8).numpy())
