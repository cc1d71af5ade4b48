"""PyTorch pickles (``.bin``/``.pt``, single or sharded) and in-memory state dicts as sources.

Files are loaded with ``torch.load(weights_only=True, mmap=True)``: no code in the pickle runs and
tensor data stays on disk until a chunk of it is written. Tensors that share storage exactly
(tied weights) are stored once and the alias is recorded, as transformers does.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, Iterator, Mapping

from ckptctl.errors import InputError, from_oserror
from ckptctl.format import dtypes as dt
from ckptctl.format.tensor import TensorSpec
from ckptctl.sources.base import CHUNK_BYTES, Source, SourceTensor

# What torch.load raises on a corrupt zip or pickle besides the cases handled one by one: the
# weights-only unpickler's stack and memo errors, truncated structs, bad rebuild arguments.
_CORRUPT = (EOFError, ValueError, KeyError, IndexError, TypeError, AttributeError, AssertionError, struct.error)

# When tied names alias each other, drop these in favour of the embedding (transformers' choice).
_DISCARD_SUFFIXES = ("lm_head.weight", "embed_out.weight", "output.weight", "decoder.weight")


MAX_CONFIG_BYTES = 64 * 1024 * 1024  # as verify reads JSON files


def heads_tied(config: Any) -> bool:
    """Whether transformers ties the output head to the input embedding for this config.json
    document: unless it says ``tie_word_embeddings: false`` (its default is true, so a missing
    config or field ties too)."""
    from ckptctl.config_fields import ConfigFields

    return not isinstance(config, dict) or ConfigFields(config).get("tie_word_embeddings") is not False


def read_config(root: Path) -> Any:
    """``root/config.json`` parsed, or None when there is none (or it is not a regular file, or
    not JSON: the model's loader would not read it either). A link is followed (a Hugging Face
    cache snapshot links every file); a FIFO is never waited on and the read is bounded."""
    import json
    import stat

    try:
        fd = os.open(root / "config.json", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError:
            return None
    try:
        return json.loads(raw) if len(raw) <= MAX_CONFIG_BYTES else None
    except (ValueError, RecursionError):
        return None


def stored_records(path: Path) -> dict[int, int]:
    """The storage records of a ``torch.save`` zip archive that are stored uncompressed (as
    torch writes them): file offset of the record's data -> its size. Read from the zip's own
    directory and local headers (no pickle is involved); empty when the file is not such an
    archive or is not little-endian."""
    try:
        with open(path, "rb") as f:
            members = zip_members(f)
    except OSError:
        return {}
    return {off: size for name, (off, size) in members.items() if name.split("/")[1:2] == ["data"]}


def zip_members(f: Any) -> dict[str, tuple[int, int]]:
    """The members of the ``torch.save`` zip archive in the seekable binary file ``f`` that are
    stored uncompressed: ``archive/data.pkl`` and the storage records ``archive/data/<key>``, each
    as name -> (offset of its data in ``f``, size). Empty when ``f`` is no such archive or the
    archive is not little-endian (its ``byteorder`` record says so). Raises OSError."""
    import zipfile

    out: dict[str, tuple[int, int]] = {}
    try:
        with zipfile.ZipFile(f) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if len(parts) == 2 and parts[1] == "byteorder":
                    # torch stores it; read only what needs no decompressing (and no password)
                    if (info.file_size >= 64 or info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1
                            or z.read(info).strip() != b"little"):
                        return {}
                record = len(parts) == 3 and parts[1] == "data" and parts[2].isdigit()
                if (not record and parts[1:] != ["data.pkl"]) or info.compress_type != zipfile.ZIP_STORED:
                    continue
                f.seek(info.header_offset)
                local = f.read(30)
                if len(local) != 30 or local[:4] != b"PK\x03\x04":
                    return {}
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                out[info.filename] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    except (zipfile.BadZipFile, EOFError, ValueError, struct.error):
        return {}
    return out


def archive_offsets(path: Path, tensors: Mapping[str, Any]) -> dict[str, int]:
    """Where each contiguous tensor's bytes sit in the ``torch.save`` archive ``path`` that
    ``torch.load(mmap=True)`` mapped them from: {name: absolute file offset}.

    The records of the zip (:func:`stored_records`) are matched against what torch reports: every
    storage must start at one mapping base plus a record's offset and have that record's size,
    and each tensor's first bytes as torch reads them must equal the file's bytes at the offset
    found. Anything else (a record compressed, a base that does not fit every storage, a
    mismatch) gives no offsets: those tensors stream as before. Non-contiguous views stream."""
    import torch

    records = stored_records(path)
    storages: dict[int, int] = {}
    for t in tensors.values():
        st = t.untyped_storage()
        if st.nbytes() and t.device.type == "cpu":
            storages[st.data_ptr()] = st.nbytes()
    if not records or not storages:
        return {}
    first = min(storages)
    base = None
    for off, size in sorted(records.items()):  # the lowest storage is one of the records
        if size == storages[first] and all(records.get(p - (first - off)) == n for p, n in storages.items()):
            base = first - off
            break
    if base is None:
        return {}
    out: dict[str, int] = {}
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for name, t in tensors.items():
            if t.device.type != "cpu" or not t.numel() or not t.is_contiguous():
                continue
            item = t.element_size()
            offset = t.untyped_storage().data_ptr() - base + t.storage_offset() * item
            probe = min(64, t.numel() * item)
            if os.pread(fd, probe, offset) != t.reshape(-1).view(torch.uint8)[:probe].numpy().tobytes():
                return {}
            out[name] = offset
    finally:
        os.close(fd)
    return out


def _keep_name(names: list[str]) -> str:
    preferred = [n for n in sorted(names) if not n.endswith(_DISCARD_SUFFIXES)]
    return (preferred or sorted(names))[0]


def load_pickle(path: Path, key: str | None) -> dict[str, Any]:
    """Load one pickle safely; returns a flat {name: tensor} dict."""
    import pickle

    import stat

    import torch

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise InputError(f"{path} is not a regular file (a FIFO, device or directory)",
                             "replace it with the real checkpoint file")
    except OSError as exc:
        raise from_oserror(exc, "cannot read pickle checkpoint") from None
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unsafe content"
        raise InputError(f"{path}: refused to unpickle: it needs code that weights_only loading does not allow "
                         f"({first[:160]})",
                         "only plain tensor checkpoints are read; convert it with trusted code first") from None
    except RuntimeError as exc:
        text = str(exc)
        if "mmap" in text or "zipfile" in text:
            raise InputError(f"{path}: legacy (pre-zipfile) torch.save format cannot be memory-mapped",
                             "re-save it with a current torch.save, or load and re-export it with trusted code"
                             ) from None
        raise InputError(f"{path}: not a readable torch checkpoint ({text.splitlines()[0][:160]})",
                         "check that the file is a complete torch.save output") from None
    except OSError as exc:
        raise from_oserror(exc, "cannot read pickle checkpoint") from None
    except _CORRUPT as exc:
        raise InputError(f"{path}: not a readable torch checkpoint ({type(exc).__name__}: {str(exc)[:160]})",
                         "check that the file is a complete torch.save output") from None
    if key:
        for part in key.split("."):
            if not isinstance(obj, Mapping) or part not in obj:
                raise InputError(f"{path}: no key {key!r} in the checkpoint",
                                 f"top-level keys: {', '.join(map(str, list(obj)[:10])) if isinstance(obj, Mapping) else type(obj).__name__}")
            obj = obj[part]
    if not isinstance(obj, Mapping):
        raise InputError(f"{path}: holds a {type(obj).__name__}, not a state dict", "pass --key to select one")
    flat: dict[str, Any] = {}
    nested = []
    for k, v in obj.items():
        if isinstance(v, torch.Tensor):
            flat[str(k)] = v
        else:
            nested.append(str(k))
    if not flat:
        hint = "pass --key " + (nested[0] if nested else "state_dict") + " to select the nested state dict"
        raise InputError(f"{path}: no tensors at the top level (keys: {', '.join(nested[:8])})", hint)
    if nested:
        raise InputError(f"{path}: mixes tensors with non-tensor entries ({', '.join(nested[:5])})",
                         "pass --key to select the state dict inside the training checkpoint")
    return flat


class TorchSource(Source):
    """Tensors held by torch (mmap-backed for files)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tensors: dict[str, Any] = {}
        self._file_backed = False  # tensors are private, read-only mappings of the pickle files

    @classmethod
    def open(cls, root: Path, files: list[str], *, kind: str = "pytorch", key: str | None = None
             ) -> "TorchSource":
        src = cls(path=root, kind=kind)
        state: dict[str, Any] = {}
        per_file: list[tuple[Path, dict[str, Any]]] = []
        for name in files:
            loaded = load_pickle(root / name, key)
            for k, v in loaded.items():
                src.claim(k, name)
                state[k] = v
            per_file.append((root / name, loaded))
        src._fill(state, tie_heads=heads_tied(read_config(root)))
        src._file_backed = True
        offsets = {k: off for path, loaded in per_file for k, off in archive_offsets(path, loaded).items()}
        origin = {k: str(path) for path, loaded in per_file for k in loaded}
        for t in src.tensors:  # the file each tensor is stored in (``--max-shard-size keep`` groups by it)
            t.file = origin[t.name]
            if t.name in offsets and t.dtype != "F4":  # copied by the kernel straight from the archive
                t.offset = offsets[t.name]
        return src

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *, path: Path | None = None,
                        kind: str = "state_dict", tie_heads: bool = True) -> "TorchSource":
        src = cls(path=path or Path("."), kind=kind)
        src._fill(state, tie_heads=tie_heads)
        return src

    def _fill(self, state: Mapping[str, Any], *, tie_heads: bool = True) -> None:
        """List ``state``'s tensors in its order; tensors that share storage exactly are listed
        once (the name :func:`_keep_name` picks) and the others recorded as aliases. With
        ``tie_heads`` False (config.json says ``tie_word_embeddings: false``) an output head
        (``lm_head.weight`` ...) is never an alias: the loader would leave it randomly
        initialised, so it is stored with its own copy of the shared bytes."""
        import torch

        groups: dict[tuple, list[str]] = {}
        for name, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise InputError(f"state dict entry {name!r} is a {type(t).__name__}, not a tensor",
                                 "pass only tensors")
            if t.layout != torch.strided:
                raise InputError(f"tensor {name!r} has layout {t.layout}", "convert sparse tensors to dense first")
            if t.device.type == "meta":
                raise InputError(f"tensor {name!r} is on the meta device and has no data",
                                 "materialise the model's weights before exporting")
            try:
                dt.from_torch(t.dtype)
            except ValueError:
                raise InputError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store",
                                 "convert it to a supported dtype first") from None
            if t.device.type == "cpu" and t.numel() > 0:
                ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                         tuple(t.stride()), t.dtype)
                groups.setdefault(ident, []).append(name)
            else:
                groups.setdefault((id(t),), []).append(name)
        keep: dict[str, Any] = {}
        if not tie_heads:
            split: dict[tuple, list[str]] = {}
            for ident, names in groups.items():
                for n in names:
                    split.setdefault((*ident, n) if n.endswith(_DISCARD_SUFFIXES) else ident, []).append(n)
            groups = split
        for names in groups.values():
            kept = _keep_name(names)
            keep[kept] = state[kept]
            for n in names:
                if n != kept:
                    self.aliases[n] = kept
        for name in state:  # keep the caller's order for listing
            if name in keep:
                t = keep[name]
                d = dt.from_torch(t.dtype)
                shape = tuple(t.shape)
                if d.name == "F4":  # torch packs two values per element; the header counts values
                    shape = shape[:-1] + (shape[-1] * 2,) if shape else (2,)
                self.tensors.append(SourceTensor(TensorSpec(name, d.name, shape)))
                self._tensors[name] = t

    def tensor(self, name: str) -> Any:
        return self._tensors[name]

    def chunks(self, t: SourceTensor, target_dtype: str | None = None,
               chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
        import torch

        tensor = self._tensors[t.name].detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        flat = tensor.reshape(-1)
        if flat.numel() == 0:
            return
        convert = target_dtype and target_dtype != t.dtype
        itemsize = flat.element_size()
        per = max(1, chunk_bytes // itemsize)
        for i in range(0, flat.numel(), per):
            part = flat[i:i + per]
            if convert:
                part = part.to(getattr(torch, dt.BY_NAME[target_dtype].torch_name))
            yield memoryview(part.view(torch.uint8).numpy())
        if self._file_backed:
            _drop_pages(self._tensors[t.name])

    def close(self) -> None:
        self._tensors.clear()



_MADV_DONTNEED = 4
_libc: Any = None


def _drop_pages(tensor: Any) -> None:
    """Give back the page cache pages a file-backed (MAP_PRIVATE, never written) tensor mapped
    in, so a multi-GB pickle does not accumulate in our RSS. Only ever called for tensors that
    ``torch.load(mmap=True)`` created: pages are re-read from the file if touched again."""
    import ctypes
    import mmap

    global _libc
    storage = tensor.untyped_storage()
    start, size = storage.data_ptr(), storage.nbytes()
    if not start or not size:
        return
    page = mmap.PAGESIZE
    lo = start - start % page
    hi = start + size
    hi += -hi % page
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)
