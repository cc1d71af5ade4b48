"""What an export writes: one :class:`Entry` per tensor, and the :class:`ExportInputs` value that
carries them with the options, the extra files and the alias records.

:func:`build_inputs` is the one function that makes an :class:`ExportInputs` (adapter naming,
metadata, plain extra names); :func:`open_inputs` opens a path for it (``api.export``, the CLI,
``export_distributed``) and :func:`state_dict_inputs` takes an in-memory state dict
(``save_state_dict`` and its multi-rank twin). Both validate the options before anything else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ckptctl.errors import CkptctlError, InputError, UsageError
from ckptctl.format import dtypes as dt
from ckptctl.format import names as N
from ckptctl.format.tensor import TensorSpec
from ckptctl.sources.base import Source, SourceTensor, SpecFields
from ckptctl.sources.opener import open_source
from ckptctl.write.options import ExportOptions, ExportSettings, target_dtype, validate

if TYPE_CHECKING:
    from ckptctl.layout import Layout


@dataclass(slots=True)
class Entry(SpecFields):
    """One tensor to write: ``spec`` is what is stored (the dtype after any ``--dtype``
    conversion); ``source`` gives the bytes of ``tensor``, the source's own record of it."""

    spec: TensorSpec
    source: Source
    tensor: SourceTensor
    # stored in another dtype than the source's: streamed through a conversion (asked several
    # times per tensor by the writer; fixed at construction, as spec and tensor are)
    converted: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.converted = self.spec.dtype != self.tensor.spec.dtype


def entries_for(source: Source, dtype_option: str | None) -> list[Entry]:
    """An entry per tensor of ``source``; with a ``--dtype`` value (keep, bf16, fp16, fp32) the
    floating tensors are stored as that dtype, every other tensor as it is."""
    target = target_dtype(dtype_option)
    return [Entry(t.spec.with_dtype(target) if target and t.dtype in dt.CONVERTIBLE else t.spec, source, t)
            for t in source.tensors]


@dataclass
class ExportInputs:
    """Everything an export job reads, resolved: the entries in plan order, the options (with
    the adapter's naming and the source's metadata applied), the validated settings, the extra
    files (name -> path or bytes) and the tied-tensor aliases. Owns ``source`` when it has one:
    close it (or use ``with``) when the job is done."""

    entries: list[Entry]
    options: ExportOptions
    settings: ExportSettings
    extras: dict[str, Path | bytes] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    is_adapter: bool = False
    source: Source | None = None
    # Files of the source's other complete variant families (``model.fp16.safetensors`` beside
    # ``model.safetensors``), carried verbatim: another slot, never rewritten nor dropped.
    variants: dict[str, Path] = field(default_factory=dict)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()

    def __enter__(self) -> "ExportInputs":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def build_inputs(entries: list[Entry], opts: ExportOptions, settings: ExportSettings, *,
                 extras: Mapping[str, Path | bytes | os.PathLike[str]] | None = None,
                 aliases: dict[str, str] | None = None, adapter: bool = False,
                 metadata: dict[str, str] | None = None, source: Source | None = None) -> ExportInputs:
    """The :class:`ExportInputs` of ``entries``. Files are named after ``source``'s own stem and
    variant when it has them (``diffusion_pytorch_model``, ``model.fp16``). An adapter is written
    as one ``adapter_model.safetensors``; ``metadata`` (a source's own) is kept unless the options
    override a key. Extra file names must be plain names."""
    files: dict[str, Path | bytes] = {}
    for name, content in (extras or {}).items():
        if "/" in name or name in ("", ".", ".."):
            raise InputError(f"extra file name {name!r} is not a plain file name", "pass plain names")
        files[name] = bytes(content) if isinstance(content, (bytes, bytearray)) else Path(content)
    if source is not None and source.stem:  # a library's own names stay its own (never renamed)
        opts = replace(opts, prefix=source.stem, variant=source.variant)
    if adapter:
        opts = replace(opts, prefix=N.ADAPTER_STEM, single_file=True)
    merged = dict(metadata or {})
    merged.update(opts.metadata or {})
    opts = replace(opts, metadata=merged or None)
    return ExportInputs(entries, opts, settings, files, dict(aliases or {}), adapter, source)


def open_inputs(src: str | os.PathLike[str], dst: str | os.PathLike[str], opts: ExportOptions, *,
                key: str | None = None, only: str | None = None, root_module: bool = False,
                layout: Layout | None = None) -> ExportInputs:
    """Validate the options, check the two paths, open the source at ``src``; the inputs of its
    export to ``dst``. The caller closes the result. A multi-component root is refused (its
    export is ``ckptctl.write.tree.export_root``), unless ``root_module``: then its own root
    module (a sentence-transformers root's module 0) is what is opened. ``layout``: the scan
    of the directory ``src``, when the caller has it (not scanned again)."""
    settings = validate(opts, only=only, key=key)
    src_p, dst_p = Path(src), Path(dst)
    check_paths(src_p, dst_p)
    if src_p.is_dir() and layout is None:
        from ckptctl import layout as L

        layout = L.scan(src_p)
    if not root_module and layout is not None:
        _refuse_multi_component(src_p, layout)
    try:
        source = open_source(src_p, key=settings.key, only=settings.only, names=settings.names,
                             reading=layout.reading if layout is not None else None,
                             **dict(settings.source_options))
    except CkptctlError as exc:
        if exc.phase is None and exc.exit_code != 2:
            exc.phase = "read-source"  # an I/O failure reading the source's metadata
        raise
    try:
        if source.is_adapter:
            extras = {p.name: p for p in source.extras if p.name == N.ADAPTER_CONFIG}
            if N.ADAPTER_CONFIG not in extras:
                raise InputError(f"{src_p}: adapter weights without {N.ADAPTER_CONFIG}",
                                 f"copy the {N.ADAPTER_CONFIG} that belongs to the adapter next to it")
        else:
            extras = {p.name: p for p in source.extras if p.name != N.ADAPTER_CONFIG}
        inputs = build_inputs(entries_for(source, opts.dtype), opts, settings, extras=extras,
                              aliases=source.aliases, adapter=source.is_adapter, metadata=source.metadata,
                              source=source)
        if layout is not None and not source.is_adapter:
            inputs.variants = other_variants(src_p, (source.stem or "model", source.variant), layout)
        return inputs
    except BaseException:
        source.close()
        raise


def other_variants(src: Path, slot: tuple[str, str | None], lay: Layout) -> dict[str, Path]:
    """The files of ``src``'s complete variant families outside ``slot`` (the slot an export
    writes): name -> path. ``lay`` is the scan of ``src``. A family with a layout error, a
    missing shard or a header error is not complete and is left out (an export never publishes
    a broken family)."""
    from ckptctl import layout as L
    from ckptctl.findings import ERROR
    damaged = {Path(f.path).name for f in lay.findings if f.severity == ERROR}
    reading = lay.reading
    per_slot: dict[tuple[str, str | None], int] = {}
    for fam in lay.families:
        per_slot[fam.slot] = per_slot.get(fam.slot, 0) + 1
    out: dict[str, Path] = {}
    for fam in lay.variants:
        if fam.slot == L.slot_of(*slot) or fam.container != L.SAFETENSORS or damaged & set(fam.all_files) \
                or per_slot[fam.slot] > 1:
            continue  # two families in one slot (both containers, index and single) is not one variant
        doc = fam.index_doc
        if (fam.index is None and len(fam.files) > 1) or (
                fam.index is not None and (doc is None or not doc.ok or set(doc.shards) != set(fam.files))):
            continue
        headers = [reading.header(src / n, display=str(src / n)) for n in fam.files]
        if any(f.severity == ERROR for h in headers for f in h.findings):
            continue
        if doc is not None and set(doc.weight_map) != {t for h in headers for t in h.tensors}:
            continue
        out.update({n: src / n for n in fam.all_files})
    return out


def state_dict_inputs(state_dict: Mapping[str, Any], dest: str | os.PathLike[str], opts: ExportOptions, *,
                      extras: Mapping[str, bytes | os.PathLike[str]] | None = None) -> ExportInputs:
    """The inputs of writing an in-memory torch state dict (tied tensors stored once)."""
    settings = validate(opts)
    from ckptctl.sources.torch_source import TorchSource

    source = TorchSource.from_state_dict(state_dict, path=Path(dest))
    return build_inputs(entries_for(source, opts.dtype), opts, settings, extras=extras, aliases=source.aliases,
                        source=source)


def _refuse_multi_component(src: Path, lay: Layout) -> None:
    """A diffusers pipeline or sentence-transformers root is several models, written whole by
    ``ckptctl.write.tree.export_root`` (``api.export`` sends it there); this writer of one model
    (``export_distributed`` under torchrun) refuses it rather than write one of them as the whole.
    ``lay`` is the scan of the directory ``src``."""
    from ckptctl import layout as L

    if lay.kind == L.MODEL:
        return
    parts = [c.path or "(root)" for c in lay.components if c.has_weights or (c.path == "" and lay.families)]
    raise UsageError(f"{src} is a {lay.kind} root with several components ({', '.join(parts) or 'none with weights'}): "
                     "this writer writes one model",
                     f"run `ckptctl export {src} DST` in one process (without torchrun): it writes the whole root, "
                     "each component under its own names")


def _inside(child: Path, parent: Path) -> bool:
    c, p = os.path.realpath(child), os.path.realpath(parent)
    return c == p or c.startswith(p.rstrip(os.sep) + os.sep)


def check_paths(src: Path, dst: Path) -> None:
    """Refuse a destination that is the source, inside it, or that contains it."""
    if os.path.isdir(src) and os.path.realpath(src) == os.path.realpath(dst):
        raise UsageError(f"source and destination are the same directory: {src}",
                         "use `ckptctl resave DIR` to rewrite a checkpoint in place")
    src_dir = src if src.is_dir() else src.parent
    if _inside(dst, src_dir) and src.is_dir():
        raise UsageError(f"destination {dst} is inside the source {src}",
                         "choose a destination outside the source directory")
    if _inside(src, dst) and os.path.lexists(dst):
        raise UsageError(f"source {src} is inside the destination {dst}",
                         "replacing the destination would remove the source; export elsewhere")
