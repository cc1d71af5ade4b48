"""PyTorch pickles (``.bin``/``.pt``, single or sharded) and in-memory state dicts as sources.

A ``torch.save`` archive is listed from its records without importing torch
(:mod:`ckptctl.sources.torch_archive`): contiguous tensors are copied by the kernel straight from
the archive, converted ones read by ``pread`` and converted chunk by chunk; only a view that must
be gathered makes torch load its file (``torch.load(weights_only=True, mmap=True)``), and a file
the records cannot describe is loaded that way whole. No code in a pickle ever runs. Tensors that
share storage exactly (tied weights) are stored once and the alias is recorded, as transformers
does.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, Iterator, Mapping

from ckptctl import _libc
from ckptctl.config_fields import read_config
from ckptctl.errors import InputError, from_oserror
from ckptctl.format import dtypes as dt
from ckptctl.format.tensor import TensorSpec
from ckptctl.format.torch_pickle import DISCARD_SUFFIXES, keep_name
from ckptctl.sources.base import CHUNK_BYTES, Source, SourceTensor, changed, file_chunks, read_pinned, same_file
from ckptctl.sources.torch_archive import ArchiveTensor, open_regular, read_archive, select
from ckptctl.sources.zero.files import ZERO_HINT, is_states_file, refuse_placeholders

# What torch.load raises on a corrupt zip or pickle besides the cases handled one by one: the
# weights-only unpickler's stack and memo errors, truncated structs, bad rebuild arguments.
_CORRUPT = (EOFError, ValueError, KeyError, IndexError, TypeError, AttributeError, AssertionError, struct.error)





def heads_tied(config: Any) -> bool:
    """Whether transformers ties the output head to the input embedding for this config.json
    document: unless it says ``tie_word_embeddings: false`` (its default is true, so a missing
    config or field ties too)."""
    from ckptctl.config_fields import ConfigFields

    return not isinstance(config, dict) or ConfigFields(config).get("tie_word_embeddings") is not False


def load_pickle(path: Path, key: str | None) -> dict[str, Any]:
    """Load one pickle safely; returns a flat {name: tensor} dict."""
    import pickle

    import torch

    os.close(open_regular(path))
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
    return select(obj, path, key, lambda v: isinstance(v, torch.Tensor))


def _tie(idents: Mapping[str, tuple[Any, ...]], tie_heads: bool) -> tuple[set[str], dict[str, str]]:
    """Which names to keep and which are aliases ({removed: kept}) among tensors whose views
    have the same identity (tied weights). With ``tie_heads`` False (config.json says
    ``tie_word_embeddings: false``) an output head (``lm_head.weight`` ...) is never an alias:
    the loader would leave it randomly initialised, so it is stored with its own copy."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, ident in idents.items():
        key = (*ident, name) if not tie_heads and name.endswith(DISCARD_SUFFIXES) else ident
        groups.setdefault(key, []).append(name)
    keep: set[str] = set()
    aliases: dict[str, str] = {}
    for names in groups.values():
        kept = keep_name(names)
        keep.add(kept)
        aliases.update({n: kept for n in names if n != kept})
    return keep, aliases


def _read_records(path: Path, key: str | None) -> dict[str, ArchiveTensor] | None:
    """:func:`read_archive`; a DeepSpeed rank file it refuses is refused with the ZeRO source's hint."""
    try:
        return read_archive(path, key)
    except InputError as exc:
        if is_states_file(path.name):
            raise InputError(exc.message, ZERO_HINT.format(folder=path.parent)) from None
        raise


class TorchSource(Source):
    """Tensors of ``torch.save`` files, listed from the archives' records without torch
    (:mod:`ckptctl.sources.torch_archive`; contiguous tensors are copied by the kernel from the
    archive), or held by torch: files the records cannot describe (``torch.load(mmap=True)``),
    a view that must be gathered (loaded when it is written), in-memory state dicts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tensors: dict[str, Any] = {}
        self._records: dict[str, tuple[Path, ArchiveTensor]] = {}
        self._key: str | None = None
        self._file_backed = False  # tensors are private, read-only mappings of the pickle files

    @classmethod
    def open(cls, root: Path, files: list[str], *, kind: str = "pytorch", key: str | None = None,
             **fields: Any) -> "TorchSource":
        """The tensors of ``files`` in ``root``; ``fields``: the rest of the source's identity
        (extras, stem, variant, is_adapter)."""
        src = cls(path=root, kind=kind, **fields)
        src._key = key
        tie_heads = heads_tied(read_config(root))
        per_file = []
        for name in files:
            # the version whose records these are: the tensors' bytes come from it only
            records, ident = read_pinned(root / name, lambda: _read_records(root / name, key))
            src.pin(root / name, ident)
            if records is None:  # torch must load the files: every tensor streams from its mapping
                return cls._loaded(root, files, kind, key, tie_heads, fields)
            refuse_placeholders(root / name, [k for k, r in records.items() if 0 in r.shape])
            per_file.append((name, records))
        idents: dict[str, tuple[Any, ...]] = {}
        for name, records in per_file:
            for k, r in records.items():
                src.claim(k, name)
                src._records[k] = (root / name, r)
                idents[k] = (name, *r.ident)
        keep, src.aliases = _tie(idents, tie_heads)
        for k, (path, r) in src._records.items():
            if k in keep:
                src.tensors.append(SourceTensor(TensorSpec(k, r.dtype, r.shape), file=str(path), offset=r.offset))
        return src

    @classmethod
    def _loaded(cls, root: Path, files: list[str], kind: str, key: str | None, tie_heads: bool,
                fields: dict[str, Any]) -> "TorchSource":
        src = cls(path=root, kind=kind, **fields)
        state: dict[str, Any] = {}
        origin: dict[str, str] = {}
        for name in files:
            loaded, ident = read_pinned(root / name, lambda: load_pickle(root / name, key))
            src.pin(root / name, ident)  # torch maps this version: it must still be there when read
            refuse_placeholders(root / name, [k for k, v in loaded.items() if v.numel() == 0])
            src.torch_loaded.append(str(root / name))
            for k, v in loaded.items():
                src.claim(k, name)
                state[k] = v
                origin[k] = str(root / name)
        src._fill(state, tie_heads=tie_heads)
        src._file_backed = True
        for t in src.tensors:  # the file each tensor is stored in (``--max-shard-size keep`` groups by it)
            t.file = origin[t.name]
        return src

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *, path: Path | None = None,
                        kind: str = "state_dict", tie_heads: bool = True) -> "TorchSource":
        src = cls(path=path or Path("."), kind=kind)
        src._fill(state, tie_heads=tie_heads)
        return src

    def _fill(self, state: Mapping[str, Any], *, tie_heads: bool = True) -> None:
        """List ``state``'s tensors in its order; tensors that share storage exactly are listed
        once (the name :func:`keep_name` picks) and the others recorded as aliases
        (:func:`_tie`)."""
        import torch

        idents: dict[str, tuple[Any, ...]] = {}
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
                idents[name] = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                                tuple(t.stride()), t.dtype)
            else:
                idents[name] = (id(t),)
        keep, aliases = _tie(idents, tie_heads)
        self.aliases.update(aliases)
        for name, t in state.items():  # keep the caller's order for listing
            if name in keep:
                d = dt.from_torch(t.dtype)
                shape = tuple(t.shape)
                if d.name == "F4":  # torch packs two values per element; the header counts values
                    shape = shape[:-1] + (shape[-1] * 2,) if shape else (2,)
                self.tensors.append(SourceTensor(TensorSpec(name, d.name, shape)))
                self._tensors[name] = t

    def _load_file(self, path: Path) -> None:
        """Load ``path`` with torch (mmap) for the tensors of it that must be gathered; each must
        be what its record says."""
        loaded, ident = read_pinned(path, lambda: load_pickle(path, self._key))
        if self.identity(path) not in (None, ident):
            raise changed(path)
        self.torch_loaded.append(str(path))
        self._file_backed = True
        for name, t in loaded.items():
            rec = self._records.get(name)
            if rec is None or rec[0] != path:
                continue
            if dt.from_torch(t.dtype).name != rec[1].dtype or tuple(t.shape) != rec[1].shape:
                raise InputError(f"{path}: torch.load and the archive's records disagree on tensor {name!r}",
                                 "the file changed while it was read: export it again")
            self._tensors[name] = t

    def tensor(self, name: str) -> Any:
        return self._tensors[name]

    def chunks(self, t: SourceTensor, target_dtype: str | None = None,
               chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
        rec = self._records.get(t.name)
        if rec is not None and t.name not in self._tensors:
            if not t.nbytes:
                return
            if t.file is not None and t.offset is not None:  # contiguous in the archive: no torch
                yield from file_chunks(t.file, t.offset, t.nbytes, t.dtype, target_dtype, chunk_bytes,
                                       f"{t.file} is shorter than its zip directory says (tensor {t.name!r})",
                                       self.identity(t.file))
                return
            self._load_file(rec[0])  # a view to gather (or a caller that wants torch's bytes)
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
            if t.file is not None:  # the mapped file was not rewritten or replaced while it was read
                same_file(t.file, self.identity(t.file))
            _drop_pages(self._tensors[t.name])

    def close(self) -> None:
        self._tensors.clear()
        self._records.clear()



_MADV_DONTNEED = 4


def _drop_pages(tensor: Any) -> None:
    """Give back the page cache pages a file-backed (MAP_PRIVATE, never written) tensor mapped
    in, so a multi-GB pickle does not accumulate in our RSS. Only ever called for tensors that
    ``torch.load(mmap=True)`` created: pages are re-read from the file if touched again."""
    import mmap

    storage = tensor.untyped_storage()
    start, size = storage.data_ptr(), storage.nbytes()
    if not start or not size:
        return
    page = mmap.PAGESIZE
    lo = start - start % page
    hi = start + size
    hi += -hi % page
    try:
        _libc.madvise(lo, hi - lo, _MADV_DONTNEED)
    except OSError:
        pass  # only a saving of memory: the bytes are the same either way
