"""A safetensors file or sharded directory as a source: metadata from headers, bytes by range.

Also the source of byte ranges fed one by one (``CheckpointWriter.add_range``): any tensor whose
``file`` and ``offset`` are known is read with ``pread`` (and converted chunk by chunk).

Each file's header is read with the file held open and pinned (:meth:`Source.pin`): its bytes
are copied only from that version (a file replaced or rewritten since is refused, exit 3)."""

from __future__ import annotations

from itertools import repeat
from pathlib import Path
from typing import Any, Iterator

from ckptctl.layout.reading import MetadataReading
from ckptctl.sources.base import CHUNK_BYTES, Source, SourceTensor, file_chunks, read_pinned


class SafetensorsSource(Source):
    @classmethod
    def open(cls, root: Path, files: list[str], *, kind: str = "safetensors", reading: MetadataReading | None = None,
             **fields: Any) -> "SafetensorsSource":
        """The tensors of ``files`` in ``root``, their headers read by ``reading`` (the command's:
        a header it kept is not decoded again; these are not kept, the source holds them);
        ``fields``: the rest of the source's identity (extras, stem, variant, is_adapter)."""
        src = cls(path=root, kind=kind, **fields)
        reading = reading or MetadataReading()
        for name in files:
            fpath = root / name
            file = str(fpath)
            # the version of the file whose header this is: its bytes are copied from it only
            hdr, ident = read_pinned(file, lambda: reading.load_header(fpath, display=file, keep=False))
            src.pin(file, ident)
            table = hdr.tensors  # by column: a spec and an offset per tensor, no TensorInfo
            src.add_all(list(map(SourceTensor, table.spec_list(), repeat(None), repeat(None), repeat(file),
                                 map(hdr.data_start.__add__, table.begins))), list(table), name)
            if len(files) == 1 and hdr.metadata:
                src.metadata = {k: v for k, v in hdr.metadata.items() if k != "format"}
        return src

    def chunks(self, t: SourceTensor, target_dtype: str | None = None,
               chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        assert t.file is not None and t.offset is not None
        return file_chunks(t.file, t.offset, t.nbytes, t.dtype, target_dtype, chunk_bytes,
                           f"{t.file} is shorter than its header says (tensor {t.name!r})", self.identity(t.file))
