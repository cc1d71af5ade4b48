"""The ckptctl manifest (``ckptctl.manifest.json``): every listed file present with its size,
every weights file listed. The sha256 digests are compared by the deep step."""

from __future__ import annotations

from ckptctl.findings import ERROR
from ckptctl.format.names import MANIFEST_NAME
from ckptctl.verify.context import Context


def manifest_step(ctx: Context) -> str | None:
    """The manifest's files against the directory; why it did not run, or None."""
    if MANIFEST_NAME not in ctx.names or ctx.layout is None:
        return f"no {MANIFEST_NAME}"
    if MANIFEST_NAME in ctx.hidden:
        return f"{MANIFEST_NAME} is not a readable file: see its finding"
    ctx.record(MANIFEST_NAME, "manifest")
    if ctx.regular_size(MANIFEST_NAME, "re-export with --manifest") is None:
        return f"{MANIFEST_NAME} is not a readable file: see its finding"
    from ckptctl.manifest import read_manifest  # here: the manifest module brings hashing threads

    doc, found = read_manifest(ctx.root / MANIFEST_NAME)
    ctx.extend(found)
    if doc is None:
        return None  # read: its findings say what is wrong
    shown = ctx.disp(MANIFEST_NAME)
    ctx.manifest = {}
    for name, entry in sorted(doc["files"].items()):
        size = ctx.listed_file(
            name, code_outside="manifest.path_outside", source=shown, what="file",
            code_missing="manifest.file_missing", missing="is listed in the manifest but does not exist",
            hint_missing="restore the file or re-export the checkpoint", hint_not_file="restore the file")
        if size is None:
            continue
        ctx.record(name, "extra")
        if size != entry["size"]:
            ctx.add("manifest.size_mismatch", ERROR, ctx.disp(name),
                    f"{name} is {size:,} bytes, the manifest says {entry['size']:,}",
                    "the file changed or is incomplete: copy it again or re-export", name=name,
                    size=size, expected=entry["size"])
            continue
        ctx.manifest[name] = entry
    weights = set(ctx.layout.weight_files)
    for comp in ctx.layout.components:
        if comp.path and comp.layout is not None:
            weights.update(f"{comp.path}/{n}" for n in comp.layout.weight_files)
    for n in sorted(weights):
        if n not in doc["files"]:
            ctx.add("manifest.unlisted_file", ERROR, ctx.disp(n),
                    f"{n} is a weights file the manifest does not list (added after the export?)",
                    "remove it, or re-export the checkpoint so the manifest covers it", name=n)
    return None
