"""A safetensors file or sharded directory as a source: metadata from headers, bytes by range.

Also the source of byte ranges fed one by one (``CheckpointWriter.add_range``): any tensor whose
``file`` and ``offset`` are known is read with ``pread`` (and converted chunk by chunk)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from ckptctl.errors import InputError, from_oserror
from ckptctl.format import dtypes as dt
from ckptctl.format.header import load_header
from ckptctl.sources.base import CHUNK_BYTES, Source, SourceTensor, convert_bytes


class SafetensorsSource(Source):
    @classmethod
    def open(cls, root: Path, files: list[str], *, kind: str = "safetensors") -> "SafetensorsSource":
        src = cls(path=root, kind=kind)
        for name in files:
            fpath = root / name
            hdr = load_header(fpath, display=str(fpath))
            for t in hdr.tensors.values():
                src.add(SourceTensor(t.spec, file=str(fpath), offset=hdr.data_start + t.begin), name)
            if len(files) == 1 and hdr.metadata:
                src.metadata = {k: v for k, v in hdr.metadata.items() if k != "format"}
        return src

    def chunks(self, t: SourceTensor, target_dtype: str | None = None,
               chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        assert t.file is not None and t.offset is not None
        total = t.nbytes
        src_bits = dt.BY_NAME[t.dtype].bits
        # Keep chunks on element boundaries so each one converts on its own.
        step = max(8, chunk_bytes - chunk_bytes % 8)
        try:
            fd = os.open(t.file, os.O_RDONLY)
        except OSError as exc:
            raise from_oserror(exc, "cannot read source shard") from None
        try:
            done = 0
            while done < total:
                n = min(step, total - done)
                data = os.pread(fd, n, t.offset + done)
                if len(data) != n:
                    raise InputError(f"{t.file} is shorter than its header says (tensor {t.name!r})",
                                     "the source shard is truncated: restore it or export it again")
                done += n
                if target_dtype and target_dtype != t.dtype and src_bits >= 8:
                    yield convert_bytes(data, t.dtype, target_dtype)
                else:
                    yield data
        finally:
            os.close(fd)
