"""A torch DCP family: ``.metadata`` read with the allow-list reader, every storage file it names
present and long enough, every ``*.distcp`` file named. torch is not imported."""

from __future__ import annotations

from ckptctl import layout as L
from ckptctl.findings import ERROR, WARNING
from ckptctl.verify.context import Context

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
