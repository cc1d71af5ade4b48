"""torch DCP's ``.metadata`` file, read without importing or running anything it names.

``.metadata`` is a pickle of torch dataclasses (``Metadata``, ``TensorStorageMetadata``,
``ChunkStorageMetadata``, ``MetadataIndex``, ``_StorageInfo`` ...), and torch's own reader
unpickles it without restrictions. This is the one reader ckptctl has (``verify`` and the DCP
export source both use it): the file must be a regular file under :data:`MAX_METADATA_BYTES`,
the opcode walk of :mod:`ckptctl.format.pickle_walk` checks every length field against the bytes
that are there and what the objects would cost against its budget before anything is built, and
the unpickler resolves an explicit allow-list and refuses every other global. By default
the allow-list maps each class to a record of our own (:class:`Record` and its subclasses, with
the same field names as torch's: ``md.state_dict_metadata[fqn].chunks[i].offsets``,
``md.storage_data[MetadataIndex(fqn, offsets)].relative_path``; a dtype is a :class:`DType` that
knows its safetensors name), so neither torch nor ``torch.distributed.checkpoint`` is imported.
``torch_classes=True`` resolves the same allow-list to torch's own classes instead, for the one
caller that hands the object to torch (``dcp.load`` of a tensor that must be gathered).
Megatron-core's ``torch_dist`` saves add ``Metadata.all_local_plans``, every rank's save plan
(torch's planner dataclasses and the ``WriteItemType`` enum): those are read as data too
(:class:`PlanRecord`, the enum as its value), never used.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import stat
import struct
from dataclasses import dataclass
from typing import Any, Callable

from ckptctl.findings import ERROR, Finding
from ckptctl.format.pickle_walk import RECORDS_PER_BYTE, check_pickles
from ckptctl.format.torch_pickle import TORCH_DTYPES

MAX_METADATA_BYTES = 1 << 30
_AGAIN = "the save did not finish or the file is damaged: save it again"

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # Megatron-core's torch_dist saves add ``Metadata.all_local_plans``: every rank's save plan
    # (plain torch dataclasses and an enum), read as data like the rest.
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                             "BytesIOWriteData"},
    "torch.distributed.checkpoint._extension": {"ExtensionTransform"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class Record:
    """A DCP metadata dataclass as its pickle states it (``NEWOBJ`` then ``BUILD`` with the
    field dict); fields torch adds later simply appear as attributes."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) of a slotted dataclass
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise pickle.UnpicklingError(f"{type(self).__name__} with a state of {type(state).__name__}")
        self.__dict__.update(state)

    def __getattr__(self, name: str) -> Any:  # a field this save did not store: its default
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__!r})"


class Metadata(Record):
    pass


class TensorStorageMetadata(Record):
    pass


class BytesStorageMetadata(Record):
    pass


class ChunkStorageMetadata(Record):
    pass


class StorageMeta(Record):
    pass


class StorageInfo(Record):
    pass


class ExtensionTransform(Record):
    pass


class PlanRecord(Record):
    """One of the planning records Megatron-core adds (``SavePlan``, ``WriteItem``,
    ``TensorWriteData``, ``BytesIOWriteData``): kept as data, never used to read a tensor."""


def _enum_value(value: Any = None) -> Any:
    """``WriteItemType(n)``: its value (an int), nothing of the enum is built."""
    if type(value) is not int:
        raise pickle.UnpicklingError(f"WriteItemType of a {type(value).__name__}")
    return value


class TensorProperties(Record):
    """torch pickles it as a tuple: (dtype, layout, requires_grad, memory_format, pin_memory)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 5:
            state = dict(zip(("dtype", "layout", "requires_grad", "memory_format", "pin_memory"), state))
        super().__setstate__(state)


class MetadataIndex(Record):
    """The key of the storage map: equal and hashed by ``fqn`` and ``offset`` (``index`` is a hint)."""

    def __init__(self, fqn: str = "", offset: Any = None, index: int | None = None) -> None:
        super().__init__(fqn=fqn, offset=None if offset is None else tuple(offset), index=index)

    def _key(self) -> tuple[Any, ...]:
        off = self.__dict__.get("offset")
        return self.__dict__.get("fqn"), None if off is None else tuple(off)

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)
        self._key()  # an offset that is no sequence fails here, before it becomes a dict key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclass(frozen=True)
class DType:
    """A torch dtype named in the metadata: ``torch_name`` (``float32``) and its safetensors
    ``name`` (None when safetensors has none)."""

    torch_name: str

    @property
    def name(self) -> str | None:
        return TORCH_DTYPES.get(self.torch_name)


_RECORDS: dict[str, Any] = {
    "Metadata": Metadata, "MetadataIndex": MetadataIndex, "TensorStorageMetadata": TensorStorageMetadata,
    "BytesStorageMetadata": BytesStorageMetadata, "ChunkStorageMetadata": ChunkStorageMetadata,
    "TensorProperties": TensorProperties, "StorageMeta": StorageMeta, "_StorageInfo": StorageInfo,
    "ExtensionTransform": ExtensionTransform, "_MEM_FORMAT_ENCODING": int,
    "SavePlan": PlanRecord, "WriteItem": PlanRecord, "TensorWriteData": PlanRecord, "BytesIOWriteData": PlanRecord,
    "WriteItemType": _enum_value,
}
# torch dtypes safetensors has no name for: read (the export then says it cannot store them).
_OTHER_DTYPES = frozenset({"complex128", "cdouble", "complex32", "chalf", "qint8", "quint8", "qint32", "quint4x2",
                           "quint2x4", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16",
                           *(f"uint{n}" for n in range(1, 8)), *(f"int{n}" for n in range(1, 8))})
_TORCH_CONSTANTS = frozenset({"strided", "sparse_coo", "sparse_csr", "contiguous_format", "channels_last",
                              "channels_last_3d", "preserve_format"})


def _record_class(module: str, name: str) -> Any:
    """The allow-list resolved to our records (None: refused). Imports nothing."""
    if name in _DCP_CLASSES.get(module, ()):
        if module == "pathlib":
            return pathlib.PurePosixPath if "Windows" not in name else pathlib.PureWindowsPath
        if module in ("collections", "builtins"):
            import builtins
            import collections

            return getattr(collections if module == "collections" else builtins, name)
        return _RECORDS[name]
    if module == "torch":
        if name == "Size":
            return lambda x=(): tuple(int(v) for v in x)
        if name in TORCH_DTYPES or name in _OTHER_DTYPES:
            return DType(name)
        if name in _TORCH_CONSTANTS:
            return f"torch.{name}"
    if module == "torch.serialization" and name == "_get_layout":
        return lambda n: n if isinstance(n, str) else None
    return None


def _torch_class(module: str, name: str) -> Any:
    """The allow-list resolved to torch's own classes (None: refused). Imports torch."""
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
    return None


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, resolve: Callable[[str, str], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self.refused: list[str] = []
        self._resolve = resolve

    def find_class(self, module: str, name: str) -> Any:
        obj = self._resolve(module, name)
        if obj is not None:
            return obj
        self.refused.append(f"{module}.{name}")
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def _bad(display: str, why: str, hint: str = _AGAIN) -> tuple[None, list[Finding]]:
    return None, [Finding("dcp.bad_metadata", ERROR, display, f"{display}: {why}", hint)]


def read_dcp_metadata(path: str | os.PathLike[str], display: str, *, torch_classes: bool = False
                      ) -> tuple[Any | None, list[Finding]]:
    """The Metadata of a DCP ``.metadata`` file (our records; torch's objects with
    ``torch_classes``), or None with the findings that say why (``dcp.bad_metadata``,
    ``dcp.unsafe_global``). Raises OSError when the file cannot be read."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then tells what it is.
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return _bad(display, "not a regular file (a FIFO, device or directory)")
        if st.st_size > MAX_METADATA_BYTES:
            return _bad(display, f"{st.st_size} bytes is too large for DCP metadata", "this is not a DCP checkpoint")
        data = f.read()
    # the opcode walk checks every length field against the bytes that are there (the C unpickler
    # would first allocate what a hostile length field asks for), the nesting, and the memory the
    # objects would take against the budget of a pickle of this size (pickle_walk)
    checked, err = check_pickles(data, per_byte=RECORDS_PER_BYTE)
    if err or not checked:
        return _bad(display, f"unreadable DCP metadata ({err})")
    up = _AllowListUnpickler(data, _torch_class if torch_classes else _record_class)
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
    """(tensor count, tensor chunks and objects without a storage entry) of a records Metadata."""
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


def state_summary(md: Any) -> list[dict[str, Any]]:
    """A DCP training state (``dcp.save({"model": ..., "optimizer": ..., "step": n})``) by its
    top-level keys, in the order saved: per key its tensor count, elements, bytes (of the dtypes
    safetensors can name; others are counted as tensors only), tensors per dtype, and its
    non-tensor entries (``objects``: the step, param groups, byte objects)."""
    import math

    out: dict[str, dict[str, Any]] = {}
    for fqn, item in md.state_dict_metadata.items():
        top = str(fqn).split(".")[0]
        row = out.setdefault(top, {"key": top, "tensors": 0, "parameters": 0, "bytes": 0, "dtypes": {}, "objects": 0})
        if not isinstance(item, TensorStorageMetadata):
            row["objects"] += 1
            continue
        dtype = getattr(getattr(item, "properties", None), "dtype", None)
        name = dtype.name if isinstance(dtype, DType) else None
        try:
            numel = math.prod(int(x) for x in item.size)
        except (TypeError, ValueError):
            numel = 0
        row["tensors"] += 1
        row["parameters"] += numel
        if name is not None:
            from ckptctl.format import dtypes as dt

            row["bytes"] += numel * dt.BY_NAME[name].bits // 8
        label = name or (f"torch.{dtype.torch_name}" if isinstance(dtype, DType) else "?")
        row["dtypes"][label] = row["dtypes"].get(label, 0) + 1
    return list(out.values())


def is_training_state(md: Any) -> bool:
    """Whether the checkpoint holds entries besides tensors (a training state, not one model)."""
    return any(not isinstance(item, TensorStorageMetadata) for item in md.state_dict_metadata.values())
