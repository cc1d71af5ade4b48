"""Static checks of PyTorch pickles (``.bin``/``.pt``) for ``verify``; torch is not imported.

Nothing in a checked pickle ever runs. The pickle is walked by an unpickler whose ``find_class``
never imports anything: globals on the allow-list (the ones ``torch.load(weights_only=True)``
accepts) become inert stand-ins that record tensor metadata, and every other global is recorded
as unsafe and replaced by an inert stub, so a ``__reduce__`` payload can neither import nor call
its target. (DCP's ``.metadata`` needs torch's own classes: :mod:`ckptctl.format.dcp_metadata`.)
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass, field
from typing import Any, Callable

from ckptctl.findings import ERROR, INFO, WARNING, Finding
from ckptctl.format import dtypes as dt
from ckptctl.format.header import sniff
from ckptctl.format.tensor import TensorSpec

# torch storage class name -> safetensors dtype
_STORAGE_DTYPES = {
    "DoubleStorage": "F64", "FloatStorage": "F32", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
    "ByteStorage": "U8", "BoolStorage": "BOOL", "ComplexFloatStorage": "C64",
}
# torch dtype attribute -> safetensors dtype
_TORCH_DTYPES = {d.torch_name: d.name for d in dt.DTYPES if d.torch_name}
_TORCH_DTYPES.update({"float": "F32", "double": "F64", "half": "F16", "long": "I64", "int": "I32",
                      "short": "I16", "complex64": "C64", "cfloat": "C64"})
_REBUILD_FUNCS = frozenset({
    "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
    "_rebuild_parameter_with_state", "_rebuild_meta_tensor_no_storage", "_rebuild_qtensor",
    "_rebuild_sparse_tensor", "_rebuild_nested_tensor", "_rebuild_device_tensor_from_numpy",
    "_rebuild_device_tensor_from_cpu_tensor", "_rebuild_wrapper_subclass",
})
_MAX_PICKLE = 1 << 30  # a data.pkl larger than this is not a state dict we can describe
# Of tied weights pickled twice, the output layer is the alias (transformers keeps the embedding).
_DISCARD_SUFFIXES = ("lm_head.weight", "embed_out.weight", "output.weight", "decoder.weight")


@dataclass
class StorageRef:
    key: str
    dtype: str | None  # None for an untyped (byte) storage
    numel: int  # elements of ``dtype`` (bytes when untyped)
    location: str


@dataclass
class TensorRef:
    """What ``torch._utils._rebuild_tensor*`` was called with: a view into a storage. The tensor
    gets its name (and so a :class:`TensorSpec`) from the state dict key it is stored under."""

    storage: StorageRef | None
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str | None

    def spec(self, name: str) -> TensorSpec:
        return TensorSpec(name, self.dtype, self.shape)


class _Inert:
    """What a refused global turns into: accepts any call and any state, does nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_Inert":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "_Inert":
        return _Inert()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


@dataclass(frozen=True)
class _DtypeStub:
    name: str | None


class _StorageType:
    def __init__(self, dtype: str | None) -> None:
        self.dtype = dtype


def _ints(x: Any) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in x)
    except (TypeError, ValueError):
        return ()


def _rebuild_v2(storage: Any, offset: Any = 0, size: Any = (), stride: Any = (), *rest: Any, **kw: Any) -> TensorRef:
    st = storage if isinstance(storage, StorageRef) else None
    return TensorRef(st, int(offset) if isinstance(offset, int) else 0, _ints(size), _ints(stride),
                     st.dtype if st else None)


def _rebuild_v3(storage: Any, offset: Any = 0, size: Any = (), stride: Any = (), requires_grad: Any = False,
                hooks: Any = None, dtype: Any = None, *rest: Any, **kw: Any) -> TensorRef:
    t = _rebuild_v2(storage, offset, size, stride)
    if isinstance(dtype, _DtypeStub):
        t.dtype = dtype.name
    return t


def _passthrough(data: Any = None, *rest: Any, **kw: Any) -> Any:
    return data


def _from_type_v2(func: Any, new_type: Any, args: Any, state: Any = None) -> Any:
    if callable(func) and isinstance(args, tuple):
        return func(*args)
    return _Inert()


class _ScanUnpickler(pickle.Unpickler):
    """Never imports: allow-listed globals map to recorders, everything else to inert stubs."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.unsafe: list[str] = []

    def find_class(self, module: str, name: str) -> Any:  # noqa: C901 - one allow-list
        if module == "__builtin__":
            module = "builtins"
        full = f"{module}.{name}"
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        if full in ("builtins.set", "builtins.frozenset", "builtins.bytearray", "builtins.complex"):
            import builtins

            return getattr(builtins, name)
        if full == "_codecs.encode":
            return lambda s, enc="latin1": s.encode(enc) if isinstance(s, str) else b""
        if full == "collections.Counter":
            import collections

            return collections.Counter
        if module == "torch._utils" and name in _REBUILD_FUNCS:
            if name == "_rebuild_tensor_v3":
                return _rebuild_v3
            if name in ("_rebuild_tensor", "_rebuild_tensor_v2"):
                return _rebuild_v2
            if name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
                return _passthrough
            return _Inert()
        if full == "torch._tensor._rebuild_from_type_v2":
            return _from_type_v2
        if full in ("torch.nn.parameter.Parameter", "torch.Tensor", "torch.device", "torch.Size",
                    "torch.serialization._get_layout"):
            return _passthrough if name != "Size" else (lambda x=(): tuple(x))
        if module == "torch" and name.endswith("Storage") and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if full in ("torch.storage.UntypedStorage", "torch.storage.TypedStorage", "torch.UntypedStorage"):
            return _StorageType(None)
        if module == "torch" and name in _TORCH_DTYPES:
            return _DtypeStub(_TORCH_DTYPES[name])
        if module == "torch" and name in ("per_tensor_affine", "per_tensor_symmetric", "per_channel_affine",
                                          "per_channel_symmetric", "per_channel_affine_float_qparams",
                                          "strided", "sparse_coo", "contiguous_format", "channels_last"):
            return _DtypeStub(None)
        self.unsafe.append(full)
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            stype = pid[1]
            dtype = stype.dtype if isinstance(stype, _StorageType) else None
            numel = pid[4] if isinstance(pid[4], int) else 0
            return StorageRef(str(pid[2]), dtype, numel, str(pid[3]))
        return _Inert()


@dataclass
class PickleScan:
    """What a static scan of one torch pickle found."""

    tensors: dict[str, TensorSpec] | None = None  # None: not a flat state dict
    aliases: dict[str, str] = field(default_factory=dict)  # name -> the name it shares storage with
    unsafe: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


def _load(data: bytes, max_pickles: int = 1) -> tuple[list[Any], list[str], str | None]:
    """Run the scanning unpickler over ``max_pickles`` consecutive pickles in ``data``."""
    up = _ScanUnpickler(data)
    out: list[Any] = []
    try:
        for _ in range(max_pickles):
            out.append(up.load())
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            struct.error, UnicodeDecodeError, RecursionError, OverflowError, MemoryError) as exc:
        return out, up.unsafe, f"{type(exc).__name__}: {str(exc)[:160]}"
    return out, up.unsafe, None


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
    if zipfile.is_zipfile(path):
        _scan_zip(path, display, res, add)
    else:
        _scan_legacy(path, display, res, add)
    if res.unsafe:
        names = sorted(set(res.unsafe))
        add("pickle.unsafe_global", ERROR,
            f"{display}: the pickle references {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}, "
            "outside the tensor allow-list; loading it with pickle would run that code (nothing was run)",
            "do not load it with torch.load(weights_only=False); re-create the checkpoint from trusted code",
            globals=names)
    return res


def _scan_zip(path: str, display: str, res: PickleScan, add: Callable[..., None]) -> None:
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
        except (zipfile.BadZipFile, EOFError, ValueError) as exc:
            add("pickle.bad_archive", ERROR, f"{display}: cannot read data.pkl ({exc})",
                "the file is truncated or corrupt: export or download it again")
            return
        objs, unsafe, err = _load(data)
        res.unsafe.extend(unsafe)
        if err:
            add("pickle.unreadable", ERROR, f"{display}: data.pkl is not a valid pickle ({err})",
                "the file is corrupt: export or download it again")
            return
        sizes = {i.filename: i.file_size for i in zf.infolist()}
        _collect(objs[0], display, res, add, records=sizes, prefix=prefix + "data/")


def _scan_legacy(path: str, display: str, res: PickleScan, add: Callable[..., None]) -> None:
    size = os.path.getsize(path)
    if size > _MAX_PICKLE:
        add("pickle.legacy_format", WARNING, f"{display}: not a zip torch.save file and too large to scan",
            "re-save it with a current torch.save")
        return
    with open(path, "rb") as f:
        data = f.read()
    objs, unsafe, err = _load(data, max_pickles=4)
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
        if isinstance(v, TensorRef) and v.storage is not None:
            groups.setdefault((v.storage.key, v.offset, v.shape, v.stride), []).append(str(k))
    for names in groups.values():
        if len(names) > 1:  # tied weights pickled twice: keep the embedding, as transformers does
            keep = sorted(names, key=lambda n: (n.endswith(_DISCARD_SUFFIXES), n))[0]
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
