"""The pickle inside a ``torch.save`` file, read without importing or running anything it names.

One reader for ``verify`` (which reports every unsafe global it meets) and for the torch-free
export source (which refuses them). ``find_class`` never imports: the globals that
``torch.load(weights_only=True)`` accepts for plain tensors map to inert recorders (a tensor
becomes a :class:`TensorRef`: its storage, storage offset, size, stride and dtype, exactly the
arguments torch's ``_rebuild_tensor_v2``/``_v3`` would get), and every other global is recorded
in :attr:`ScanUnpickler.unsafe` and replaced by an inert stub, so a ``__reduce__`` payload can
neither import nor call its target. Before the C unpickler runs, one pass over the opcodes
(:mod:`ckptctl.format.pickle_walk`) checks every length field against the bytes that are there,
so a hostile length is never allocated, and models the objects they build, so none nests deep
enough to crash CPython's recursive hash, costs hours to hash through memo references, or takes
more memory than a state dict of the pickle's size needs. torch is never imported here. A caller may name
globals to read as data (the ZeRO source: :data:`DEEPSPEED_GLOBALS`, DeepSpeed's loss scaler,
stage enum and fragment address): each becomes a :class:`DataObject` recording its arguments and
state, and nothing of DeepSpeed is imported either.
"""

from __future__ import annotations

import io
import pickle
import struct
from dataclasses import dataclass, replace
from typing import Any

from ckptctl.format import dtypes as dt
from ckptctl.format.pickle_walk import check_pickles
from ckptctl.format.tensor import TensorSpec

# torch storage class name -> safetensors dtype
STORAGE_DTYPES = {
    "DoubleStorage": "F64", "FloatStorage": "F32", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
    "ByteStorage": "U8", "BoolStorage": "BOOL", "ComplexFloatStorage": "C64",
}
# torch dtype attribute -> safetensors dtype
TORCH_DTYPES = {**{d.torch_name: d.name for d in dt.DTYPES if d.torch_name},
                "float": "F32", "double": "F64", "half": "F16", "long": "I64", "int": "I32",
                "short": "I16", "complex64": "C64", "cfloat": "C64"}
# torch's legacy storage classes that safetensors has no dtype for: known, not unsafe.
_OTHER_STORAGES = frozenset({"ComplexDoubleStorage", "QInt8Storage", "QInt32Storage", "QUInt8Storage",
                             "QUInt4x2Storage", "QUInt2x4Storage"})
_REBUILD_FUNCS = frozenset({
    "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
    "_rebuild_parameter_with_state", "_rebuild_meta_tensor_no_storage", "_rebuild_qtensor",
    "_rebuild_sparse_tensor", "_rebuild_nested_tensor", "_rebuild_device_tensor_from_numpy",
    "_rebuild_device_tensor_from_cpu_tensor", "_rebuild_wrapper_subclass",
})
# DeepSpeed's globals in a ZeRO checkpoint's pickles (loss scaler, stage enum, fragment address):
# data, never imported. Only a caller that asks for them (``load_pickles(data_globals=...)``, the
# ZeRO source) reads them, as :class:`DataObject` records; for everyone else they stay unsafe.
DEEPSPEED_GLOBALS = frozenset({
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
})
# When tied names alias each other, drop these in favour of the embedding (transformers' choice).
DISCARD_SUFFIXES = ("lm_head.weight", "embed_out.weight", "output.weight", "decoder.weight")
# What a hostile or damaged pickle makes the C unpickler raise.
PICKLE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
                 struct.error, UnicodeDecodeError, RecursionError, OverflowError, MemoryError)


@dataclass
class StorageRef:
    key: str
    dtype: str | None  # None for an untyped (byte) storage, or one safetensors cannot store
    numel: int  # elements of ``dtype`` (bytes when untyped)
    location: str
    type_name: str = ""  # the torch storage class named (``FloatStorage``, ``UntypedStorage``)
    exact: bool = True  # False when a field had to be coerced (a damaged or crafted pickle)
    # the first storage of its key, named again with another type or size (torch.save never
    # writes that): torch.load gives the first, so does this record, but its views are no tie
    retyped: bool = False


@dataclass
class TensorRef:
    """What ``torch._utils._rebuild_tensor*`` was called with: a view into a storage. The tensor
    gets its name from the state dict key it is stored under."""

    storage: StorageRef | None
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str | None
    exact: bool = True  # False when an argument had to be coerced (not what torch would build)
    rebuild: str = "_rebuild_tensor_v2"

    def spec(self, name: str) -> TensorSpec:
        return TensorSpec(name, self.dtype, self.shape)


def keep_name(names: list[str]) -> str:
    """Of names that share one view (tied weights), the one stored: the first in sorted order
    that is not an output head, as transformers keeps the embedding."""
    preferred = [n for n in sorted(names) if not n.endswith(DISCARD_SUFFIXES)]
    return (preferred or sorted(names))[0]


class Inert:
    """What a refused global turns into: accepts any call and any state, does nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "Inert":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> "Inert":
        return Inert()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class DataObject:
    """An instance of a data-only class the caller allowed (:data:`DEEPSPEED_GLOBALS`), recorded
    instead of built: the global it names (``global_name``), the arguments it was called or
    created with (``args``) and the state it was given (``state``). Nothing of the class runs."""

    global_name = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> "DataObject":
        obj = object.__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def value(self) -> Any:
        """The first argument (an enum's value: ``ZeroStageEnum(3)``), or None."""
        return self.args[0] if self.args else None


@dataclass(frozen=True)
class _DtypeStub:
    name: str | None


class _StorageType:
    def __init__(self, dtype: str | None, type_name: str) -> None:
        self.dtype = dtype
        self.type_name = type_name


def _ints(x: Any) -> tuple[tuple[int, ...], bool]:
    """``x`` as a tuple of ints, and whether it was one (a tuple or torch.Size of ints)."""
    if isinstance(x, tuple) and all(type(v) is int for v in x):
        return x, True
    try:
        return tuple(int(v) for v in x), False
    except (TypeError, ValueError, OverflowError):
        return (), False


def _rebuild_v2(storage: Any, offset: Any = 0, size: Any = (), stride: Any = (), *rest: Any, **kw: Any) -> TensorRef:
    st = storage if isinstance(storage, StorageRef) else None
    shape, shape_ok = _ints(size)
    strides, stride_ok = _ints(stride)
    exact = st is not None and st.exact and type(offset) is int and shape_ok and stride_ok and not kw
    return TensorRef(st, offset if type(offset) is int else 0, shape, strides, st.dtype if st else None, exact)


def _rebuild_v3(storage: Any, offset: Any = 0, size: Any = (), stride: Any = (), requires_grad: Any = False,
                hooks: Any = None, dtype: Any = None, *rest: Any, **kw: Any) -> TensorRef:
    t = _rebuild_v2(storage, offset, size, stride, **kw)
    t.rebuild = "_rebuild_tensor_v3"
    if isinstance(dtype, _DtypeStub):
        t.dtype = dtype.name
    else:
        t.exact = False
    return t


def _passthrough(data: Any = None, *rest: Any, **kw: Any) -> Any:
    return data


def _from_type_v2(func: Any, new_type: Any, args: Any, state: Any = None) -> Any:
    if callable(func) and isinstance(args, tuple):
        return func(*args)
    return Inert()


def _bytearray(data: Any = b"", *rest: Any) -> Any:
    """``bytearray`` of bytes (or of a str and its encoding), never of a count: a pickle must not
    make us allocate and zero what it asks for."""
    if isinstance(data, (bytes, bytearray)) and not rest:
        return bytearray(data)
    if isinstance(data, str) and len(rest) == 1 and isinstance(rest[0], str):
        return bytearray(data, rest[0])
    raise pickle.UnpicklingError("bytearray of something other than bytes")


class ScanUnpickler(pickle.Unpickler):
    """Never imports: allow-listed globals map to recorders, everything else to inert stubs."""

    def __init__(self, data: bytes, data_globals: frozenset[str] = frozenset()) -> None:
        super().__init__(io.BytesIO(data))
        self.unsafe: list[str] = []
        self.data_globals = data_globals  # read as DataObject records (the caller's allow-list)
        # torch.load keeps the first typed storage loaded under a key: a later persistent id of
        # the same key (another storage type or size: a crafted or damaged pickle) gets it too
        self._storages: dict[str, StorageRef] = {}
        self._classes: dict[str, type] = {}  # the DataObject class of each data global named

    def find_class(self, module: str, name: str) -> Any:  # noqa: C901 - one allow-list
        if module == "__builtin__":
            module = "builtins"
        full = f"{module}.{name}"
        if module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        if full in ("builtins.set", "builtins.frozenset", "builtins.complex"):
            import builtins

            return getattr(builtins, name)
        if full == "builtins.bytearray":
            return _bytearray
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
            return Inert()
        if full == "torch._tensor._rebuild_from_type_v2":
            return _from_type_v2
        if full in ("torch.nn.parameter.Parameter", "torch.Tensor", "torch.device", "torch.Size",
                    "torch.serialization._get_layout"):
            return _passthrough if name != "Size" else (lambda x=(): tuple(x))
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name], name)
        if module == "torch" and name in _OTHER_STORAGES:
            return _StorageType(None, name)
        if full in ("torch.storage.UntypedStorage", "torch.storage.TypedStorage", "torch.UntypedStorage"):
            return _StorageType(None, name)
        if module == "torch" and name in TORCH_DTYPES:
            return _DtypeStub(TORCH_DTYPES[name])
        if module == "torch" and name in ("per_tensor_affine", "per_tensor_symmetric", "per_channel_affine",
                                          "per_channel_symmetric", "per_channel_affine_float_qparams",
                                          "strided", "sparse_coo", "contiguous_format", "channels_last"):
            return _DtypeStub(None)
        if full in self.data_globals:  # a class of its own per global (made once), so the record names it
            if full not in self._classes:
                self._classes[full] = type(name, (DataObject,), {"global_name": full, "__module__": __name__})
            return self._classes[full]
        self.unsafe.append(full)
        return Inert

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            stype = pid[1]
            dtype = stype.dtype if isinstance(stype, _StorageType) else None
            numel = pid[4] if type(pid[4]) is int else 0
            exact = (len(pid) == 5 and isinstance(stype, _StorageType) and isinstance(pid[2], str)
                     and type(pid[4]) is int and pid[4] >= 0)
            if exact and pid[2] in self._storages:
                first = self._storages[pid[2]]
                if (first.type_name, first.numel) != (stype.type_name, numel):
                    return replace(first, retyped=True)
                return first
            ref = StorageRef(str(pid[2]), dtype, numel, str(pid[3]),
                             stype.type_name if isinstance(stype, _StorageType) else "", exact)
            if exact:
                self._storages[pid[2]] = ref
            return ref
        return Inert()


def load_pickles(data: bytes, max_pickles: int = 1, data_globals: frozenset[str] = frozenset()
                 ) -> tuple[list[Any], list[str], str | None]:
    """Run the scanning unpickler over ``max_pickles`` consecutive pickles in ``data`` (a legacy
    ``torch.save`` stream is several): (the objects read, the unsafe globals named, the error
    that stopped it or None). ``data_globals``: globals read as :class:`DataObject` records
    instead of counted unsafe (the ZeRO source's :data:`DEEPSPEED_GLOBALS`).
    :func:`ckptctl.format.pickle_walk.check_pickles` first walks each pickle's opcodes, checking
    every length field against the bytes that are there, what the objects would cost to hash and
    the memory they would take (its budget); only pickles that pass are unpickled."""
    checked, err = check_pickles(data, max_pickles)
    up = ScanUnpickler(data, data_globals)
    out: list[Any] = []
    try:
        for _ in range(checked):
            out.append(up.load())
    except PICKLE_ERRORS as exc:
        return out, up.unsafe, f"{type(exc).__name__}: {str(exc)[:160]}"
    return out, up.unsafe, err
