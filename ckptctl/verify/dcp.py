"""A torch DCP family: ``.metadata`` read with the allow-list reader, every storage file it names
present and long enough, every ``*.distcp`` file named. torch is not imported."""

from __future__ import annotations

import os

from ckptctl import layout as L
from ckptctl.findings import ERROR, INFO, WARNING
from ckptctl.format.dcp_hf_names import SHARD_NAME as DCP_HF_SHARD, missing_models
from ckptctl.verify.context import Context, FamilyTensors

_AGAIN = "save the checkpoint again"


def check_dcp(ctx: Context, fam: L.Family) -> None:
    from ckptctl.format.dcp_metadata import missing_chunks, read_dcp_metadata, storage_needs

    for n in fam.files:
        ctx.record(n, "weights")
        ctx.deep_queue.setdefault(n, None)
    if not fam.index:
        return  # layout.dcp_without_metadata
    shown = ctx.disp(fam.index)
    ctx.record(fam.index, "metadata")
    if ctx.regular_size(fam.index, _AGAIN) is None:
        return
    try:
        md, found = read_dcp_metadata(ctx.root / fam.index, shown)
    except OSError as exc:
        ctx.io(fam.index, exc)
        return
    ctx.extend(found)
    if md is None:
        return
    tensors, missing = missing_chunks(md)
    ctx.result.tensors += tensors
    if missing:
        ctx.add("dcp.chunk_missing", ERROR, shown,
                f"{shown}: {len(missing)} tensor chunks or objects have no storage entry ({', '.join(missing[:5])})",
                "the save did not finish on every rank: save it again", missing=missing[:100])
    named: set[object] = set()
    for need in storage_needs(md):
        rel = need.relative_path
        named.add(rel)
        size = ctx.listed_file(
            rel, code_outside="dcp.path_outside", source=shown, what="storage file",
            code_missing="dcp.file_missing", missing="is referenced by .metadata but does not exist",
            hint_missing="the save did not finish on every rank (or the file was not copied): save it again",
            hint_not_file=_AGAIN)
        if size is None:
            continue
        ctx.record(rel, "weights")
        ctx.deep_queue.setdefault(rel, None)
        if size < need.end:
            ctx.add("dcp.file_truncated", ERROR, ctx.disp(rel), f"{rel} is {size:,} bytes but .metadata needs "
                    f"{need.end:,}", "the file is truncated: copy it again or save the checkpoint again",
                    size=size, needed=need.end)
    for n in fam.files:
        if n not in named:
            ctx.add("dcp.unreferenced_file", WARNING, ctx.disp(n),
                    f"{n} is not referenced by .metadata (left over from another save?)",
                    "remove it: it is not part of this checkpoint")


def dcp_hf_located(ctx: Context, found: object) -> None:
    """The DCP-HF kind's verify hook (``sources/kinds.py``): nothing of its own. The layout lists
    the same ``sharded/`` files as a DCP-HF family, which the weights step checks with
    :func:`check_dcp_hf`, through the export source's own reader."""


def check_dcp_hf(ctx: Context, fam: L.Family) -> FamilyTensors:
    """torch's DCP-HF shards (``HuggingFaceStorageWriter`` with ``save_distributed=True``): every
    header read like any safetensors file, then the sharding info of each read by the export
    source's own reader (:class:`~ckptctl.sources.dcp.hf.DcpHfSource`): each tensor's shards must
    tile it exactly. The family's tensors are the global ones (the shape torch's reader infers).
    ``dcp.hf_sharded`` (info) describes the save, ``dcp.hf_damaged`` (error)
    says why it cannot be assembled."""
    from ckptctl.errors import CkptctlError
    from ckptctl.format.tensor import TensorSpec
    from ckptctl.sources.dcp.hf import DcpHfSource
    from ckptctl.verify.weights import read_file

    reads = [read_file(ctx, n, L.SAFETENSORS) for n in fam.files]
    shown = ctx.disp()
    if any(r.header is None or not r.header.ok for r in reads):
        return FamilyTensors(fam, {}, False)  # the header findings say why
    gone = missing_models([os.path.basename(n) for n in fam.files])
    if gone:
        ctx.add("dcp.hf_damaged", ERROR, shown, f"{shown}: DCP-HF: {gone}: tensors stored only there are gone",
                "copy the missing shard files, or save the checkpoint again")
        return FamilyTensors(fam, {}, False)
    try:
        src = DcpHfSource.open(ctx.root / os.path.dirname(fam.files[0]), reading=ctx.reading)
    except CkptctlError as exc:
        ctx.add("dcp.hf_damaged", ERROR, shown, f"{shown}: torch DCP-HF shards that cannot be assembled: {exc.message}",
                exc.hint)
        return FamilyTensors(fam, {}, False)
    try:
        tensors = {t.name: TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in src.tensors}
    finally:
        src.close()
    ranks = sorted({m.group(1) for n in fam.files if (m := DCP_HF_SHARD.fullmatch(os.path.basename(n)))})
    ctx.add("dcp.hf_sharded", INFO, shown,
            f"{shown}: torch DCP-HF sharded save ({len(fam.files)} files of {len(ranks)} ranks, {len(tensors)} "
            "tensors, each tiled exactly by its shards); transformers cannot load it as it is",
            f"export it to a Hugging Face checkpoint: `ckptctl export {shown} DST`",
            files=len(fam.files), ranks=len(ranks), tensors=len(tensors))
    return FamilyTensors(fam, tensors, True)
