"""torch DCP's ``.metadata`` file, read without running anything it names.

``.metadata`` is a pickle of torch dataclasses, and torch's own reader unpickles it without
restrictions. This is the one reader ckptctl has (``verify`` and the DCP export source both use
it): the file must be a regular file under :data:`MAX_METADATA_BYTES`, every length field is
checked against the bytes that are there before anything is allocated, and the unpickler resolves
an explicit allow-list (DCP's metadata classes, ``torch.Size``, dtypes, layouts) and refuses
every other global. torch is imported here, so only DCP directories pay for it.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import stat
import struct
from dataclasses import dataclass
from typing import Any

from ckptctl.findings import ERROR, Finding

MAX_METADATA_BYTES = 1 << 30
_AGAIN = "the save did not finish or the file is damaged: save it again"

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint._extension": {"ExtensionTransform"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.refused: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) or name == "Size":
                return obj
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        if name in _DCP_CLASSES.get(module, ()):
            import importlib

            return getattr(importlib.import_module(module), name)
        self.refused.append(f"{module}.{name}")
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def _bad(display: str, why: str, hint: str = _AGAIN) -> tuple[None, list[Finding]]:
    return None, [Finding("dcp.bad_metadata", ERROR, display, f"{display}: {why}", hint)]


def read_dcp_metadata(path: str | os.PathLike[str], display: str) -> tuple[Any | None, list[Finding]]:
    """The Metadata object of a DCP ``.metadata`` file, or None with the findings that say why
    (``dcp.bad_metadata``, ``dcp.unsafe_global``). Raises OSError when the file cannot be read."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then tells what it is.
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return _bad(display, "not a regular file (a FIFO, device or directory)")
        if st.st_size > MAX_METADATA_BYTES:
            return _bad(display, f"{st.st_size} bytes is too large for DCP metadata", "this is not a DCP checkpoint")
        data = f.read()
    try:
        # pickletools checks every length field against the bytes that are there; the C
        # unpickler would first allocate what a hostile length field asks for.
        for _ in pickletools.genops(data):
            pass
    except (ValueError, struct.error, OverflowError, RecursionError) as exc:  # garbage, short data, bad lengths
        return _bad(display, f"unreadable DCP metadata ({type(exc).__name__}: {str(exc)[:160]})")
    up = _AllowListUnpickler(data)
    try:
        md = up.load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            struct.error, UnicodeDecodeError, RecursionError, OverflowError, ImportError) as exc:
        if up.refused:
            return None, [Finding("dcp.unsafe_global", ERROR, display,
                                  f"{display}: DCP metadata references {up.refused[0]}, outside the allow-list "
                                  "(nothing was run)", "re-save the checkpoint with torch.distributed.checkpoint",
                                  None, {"globals": up.refused})]
        return _bad(display, f"unreadable DCP metadata ({type(exc).__name__}: {str(exc)[:160]})")
    if not (isinstance(getattr(md, "state_dict_metadata", None), dict)
            and isinstance(getattr(md, "storage_data", None), dict)):
        return _bad(display, f".metadata holds a {type(md).__name__}, not DCP Metadata with a storage map",
                    "save the checkpoint again with torch.distributed.checkpoint")
    return md, []


@dataclass(frozen=True)
class StorageNeed:
    """How far into one storage file the metadata reads, and for which tensor (the furthest)."""

    relative_path: Any  # as the metadata says: check it with names.member_problem before use
    end: int
    fqn: str


def storage_needs(md: Any) -> list[StorageNeed]:
    """Every file the storage map names, with the end of the furthest byte range read from it."""
    needs: dict[Any, StorageNeed] = {}
    for key, info in md.storage_data.items():
        rel = getattr(info, "relative_path", None)
        off, length = getattr(info, "offset", 0) or 0, getattr(info, "length", 0) or 0
        end = int(off) + int(length)
        key_rel = rel if isinstance(rel, str) else repr(rel)
        if key_rel not in needs or end > needs[key_rel].end:
            needs[key_rel] = StorageNeed(rel, end, str(getattr(key, "fqn", key)))
    return sorted(needs.values(), key=lambda n: str(n.relative_path))


def missing_chunks(md: Any) -> tuple[int, list[str]]:
    """(tensor count, tensor chunks and objects without a storage entry) of a Metadata object."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    storage = md.storage_data
    tensors = 0
    missing: list[str] = []
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            tensors += 1
            for chunk in meta.chunks if isinstance(meta.chunks, (list, tuple)) else ():
                if MetadataIndex(fqn, chunk.offsets) not in storage:
                    missing.append(f"{fqn}@{list(chunk.offsets)}")
        elif MetadataIndex(fqn) not in storage:
            missing.append(fqn)
    return tensors, missing
