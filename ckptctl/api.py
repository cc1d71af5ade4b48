"""``export``: any source to a published HF safetensors checkpoint; and the library API.

Library use::

    from ckptctl import save_state_dict, CheckpointWriter
    save_state_dict(model.state_dict(), "out/step_1000", max_shard_size="2GB", overwrite=True)

    w = CheckpointWriter("out/step_1000", overwrite=True)
    w.add("model.embed_tokens.weight", tensor)          # a torch tensor (kept by reference)
    w.add_range("lm_head.weight", "BF16", (32000, 4096), "/src/model.safetensors", offset)
    w.add_extra("config.json", config_bytes)
    result = w.write()                                   # plan, stage, stream, publish
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from ckptctl.errors import CkptctlError, InputError, UsageError
from ckptctl.format import dtypes as dt
from ckptctl.sources.base import Source, SourceTensor, open_source
from ckptctl.writer import Entry, ExportOptions, ExportResult, entries_for, write_checkpoint


def _inside(child: Path, parent: Path) -> bool:
    c, p = os.path.realpath(child), os.path.realpath(parent)
    return c == p or c.startswith(p.rstrip(os.sep) + os.sep)


@contextmanager
def prepare_export(src: str | os.PathLike[str], dst: str | os.PathLike[str], opts: ExportOptions, *,
                   key: str | None = None, only: str | None = None):
    """Open the source and work out the entries, options and extras of an export."""
    src_p, dst_p = Path(src), Path(dst)
    if os.path.isdir(src_p) and os.path.realpath(src_p) == os.path.realpath(dst_p):
        raise UsageError(f"source and destination are the same directory: {src_p}",
                         "use `ckptctl resave DIR` to rewrite a checkpoint in place")
    src_dir = src_p if src_p.is_dir() else src_p.parent
    if _inside(dst_p, src_dir) and src_p.is_dir():
        raise UsageError(f"destination {dst_p} is inside the source {src_p}",
                         "choose a destination outside the source directory")
    if _inside(src_p, dst_p) and os.path.lexists(dst_p):
        raise UsageError(f"source {src_p} is inside the destination {dst_p}",
                         "replacing the destination would remove the source; export elsewhere")
    try:
        source = open_source(src_p, key=key, only=only)
    except CkptctlError as exc:
        if exc.phase is None and exc.exit_code != 2:
            exc.phase = "read-source"  # an I/O failure reading the source's metadata
        raise
    with source:
        entries = entries_for(source, opts.dtype)
        if source.is_adapter:
            extras = {p.name: p for p in source.extras if p.name == "adapter_config.json"}
            if "adapter_config.json" not in extras:
                raise InputError(f"{src_p}: adapter weights without adapter_config.json",
                                 "copy the adapter_config.json that belongs to the adapter next to it")
            opts = replace(opts, prefix="adapter_model", single_file=True)
        else:
            extras = {p.name: p for p in source.extras if p.name != "adapter_config.json"}
        metadata = dict(source.metadata)
        metadata.update(opts.metadata or {})
        opts = replace(opts, metadata=metadata or None)
        yield source, entries, opts, extras, source.is_adapter


def export(src: str | os.PathLike[str], dst: str | os.PathLike[str], opts: ExportOptions | None = None, *,
           key: str | None = None, only: str | None = None) -> ExportResult:
    """Export the checkpoint at ``src`` to ``dst`` (see module docstring for the guarantees)."""
    with prepare_export(src, dst, opts or ExportOptions(), key=key, only=only) as (source, entries, o, extras,
                                                                                    adapter):
        return write_checkpoint(entries, dst, o, extras=extras, aliases=source.aliases, adapter=adapter)


def save_state_dict(state_dict: Mapping[str, Any], dest: str | os.PathLike[str], *,
                    extras: Mapping[str, bytes | os.PathLike[str]] | None = None, **options: Any) -> ExportResult:
    """Write an in-memory torch state dict as a published safetensors checkpoint.

    Tied tensors (same storage, same view) are stored once and the alias recorded; non-contiguous
    tensors are written in bounded chunks. ``options`` are :class:`ExportOptions` fields.
    """
    from ckptctl.sources.torch_source import TorchSource

    opts = ExportOptions(**options)
    source = TorchSource.from_state_dict(state_dict, path=Path(dest))
    entries = entries_for(source, opts.dtype)
    return write_checkpoint(entries, dest, opts, extras={k: (v if isinstance(v, bytes) else Path(v))
                                                         for k, v in (extras or {}).items()},
                            aliases=source.aliases)


class _RangeSource(Source):
    """Byte ranges of existing files, fed one by one (CheckpointWriter.add_range)."""

    def chunks(self, t: SourceTensor, target_dtype: str | None = None, chunk_bytes: int = 16 << 20):
        from ckptctl.sources.safetensors_source import SafetensorsSource

        return SafetensorsSource.chunks(self, t, target_dtype, chunk_bytes)  # type: ignore[arg-type]


class CheckpointWriter:
    """Feed tensors (or byte ranges of existing files), then :meth:`write` plans and publishes."""

    def __init__(self, dest: str | os.PathLike[str], **options: Any) -> None:
        self.dest = Path(dest)
        self.options = ExportOptions(**options)
        self._state: dict[str, Any] = {}
        self._ranges = _RangeSource(path=self.dest, kind="ranges")
        self._extras: dict[str, bytes | Path] = {}
        self._order: list[str] = []

    def add(self, name: str, tensor: Any) -> None:
        if name in self._order:
            raise InputError(f"tensor {name!r} added twice", "tensor names must be unique")
        self._state[name] = tensor
        self._order.append(name)

    def add_range(self, name: str, dtype: str, shape: tuple[int, ...], file: str | os.PathLike[str],
                  offset: int) -> None:
        if dtype not in dt.BY_NAME:
            raise InputError(f"unknown dtype {dtype!r}", "use a safetensors dtype name such as BF16")
        if name in self._order:
            raise InputError(f"tensor {name!r} added twice", "tensor names must be unique")
        self._ranges.tensors.append(SourceTensor(name, dtype, tuple(shape), file=os.fspath(file), offset=offset))
        self._order.append(name)

    def add_extra(self, name: str, content: bytes | os.PathLike[str]) -> None:
        self._extras[name] = content if isinstance(content, bytes) else Path(content)

    def plan_entries(self) -> tuple[list[Entry], dict[str, str]]:
        entries: dict[str, Entry] = {}
        aliases: dict[str, str] = {}
        if self._state:
            from ckptctl.sources.torch_source import TorchSource

            ts = TorchSource.from_state_dict(self._state, path=self.dest)
            aliases = ts.aliases
            entries.update({e.tensor.name: e for e in entries_for(ts, self.options.dtype)})
        entries.update({e.tensor.name: e for e in entries_for(self._ranges, self.options.dtype)})
        return [entries[n] for n in self._order if n in entries], aliases

    def write(self) -> ExportResult:
        entries, aliases = self.plan_entries()
        return write_checkpoint(entries, self.dest, self.options, extras=self._extras, aliases=aliases)
