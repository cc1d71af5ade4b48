"""Files beside (or instead of) the weights that no loader reports: a Trainer checkpoint folder
holding an optimizer state but no model, weights that are ZeRO-3's 0-element placeholders, torch's
DCP-HF ``sharded/`` folder left inside a Hugging Face root, and a model's native weights (their
headers read like any safetensors file)."""

from __future__ import annotations

from ckptctl import layout as L
from ckptctl.errors import CkptctlError
from ckptctl.findings import ERROR, WARNING
from ckptctl.format import names as N
from ckptctl.format.dcp_hf_names import SHARDED_DIR
from ckptctl.layout.native import TRAINER_STATE
from ckptctl.verify.context import Context
from ckptctl.verify.weights import read_file

TRAINER_STATE_JSON = "trainer_state.json"
# a family whose tensors average fewer bytes than this is worth counting its empty tensors
_SMALL_AVERAGE = 64


def native_headers(ctx: Context) -> None:
    """The headers of a model's native safetensors files (``layout.native_weights``)."""
    assert ctx.layout is not None
    for n in ctx.layout.native:
        if N.is_safetensors(n) and ctx.inside(n) is not None:
            read_file(ctx, n, L.SAFETENSORS)


def trainer_state(ctx: Context) -> None:
    """``dir.trainer_state_without_weights``: a Trainer (or accelerate) checkpoint folder whose
    optimizer, scheduler and RNG states are there but not the model. ``Trainer.train(
    resume_from_checkpoint=...)`` fails on it, ``from_pretrained`` finds no weights."""
    assert ctx.layout is not None
    states = sorted(n for n in ctx.names if TRAINER_STATE.fullmatch(n) and n not in ctx.hidden)
    if not states or ctx.layout.families or any(c.has_weights for c in ctx.layout.components):
        return
    if TRAINER_STATE_JSON not in ctx.names and not any(n.startswith(("optimizer.", "scheduler.")) for n in states):
        return
    from ckptctl.sources.zero.locate import find_zero

    try:
        if find_zero(ctx.root) is not None:
            return  # a DeepSpeed checkpoint: its ZeRO files are the weights (zero.checkpoint)
    except CkptctlError:
        return  # zero.damaged says why
    ctx.add("dir.trainer_state_without_weights", ERROR, ctx.disp(),
            f"{ctx.disp()} is a training checkpoint ({', '.join(states[:4])}) without the model's weights: an "
            "optimizer state is not a model",
            "copy the model's weights (model.safetensors) into it, or save the checkpoint again "
            "(Trainer.save_model / save_pretrained)", files=states)


def placeholders(ctx: Context) -> None:
    """``dir.placeholder_tensors``: most tensors of the weights transformers would load hold 0
    elements while a config.json describes the model (what a ZeRO-3 model's parameters are on a
    rank before they are gathered: ``save_pretrained`` under ZeRO-3 without gathering writes
    them)."""
    if N.CONFIG not in ctx.names:
        return
    for table in ctx.tables:
        if table.family.kind not in (L.SAFETENSORS, L.PYTORCH) or not table.tensors:
            continue
        headers = [ctx.reads[n].header for n in table.family.files if n in ctx.reads]
        if headers and all(h is not None for h in headers):
            stored = sum(h.data_bytes for h in headers if h is not None)
            if stored >= _SMALL_AVERAGE * len(table.tensors):
                continue
        empty = [n for n, spec in table.tensors.items() if spec.numel == 0]
        if empty and 2 * len(empty) >= len(table.tensors):
            ctx.add("dir.placeholder_tensors", ERROR, ctx.disp(table.family.files[0]),
                    f"{len(empty)} of the {len(table.tensors)} tensors of {table.family.describe()} hold 0 elements "
                    f"(e.g. {sorted(empty)[0]!r}) while config.json describes the model: placeholders, as a ZeRO-3 "
                    "model's parameters are before they are gathered",
                    "save the model again with its parameters gathered (Trainer.save_model, or "
                    "stage3_gather_16bit_weights_on_model_save), or export the ZeRO checkpoint with "
                    "`ckptctl export CHECKPOINT DST`", tensor=sorted(empty)[0], empty=len(empty),
                    tensors=len(table.tensors))


def leftover_sharded(ctx: Context) -> None:
    """``dir.leftover_weights_folder``: torch's DCP-HF ``sharded/`` folder inside a root that
    holds its consolidated Hugging Face files (``enable_consolidation`` leaves it there). Loaders
    read only the consolidated files; an upload pushes the folder too (a warning). When the two
    do not hold the same tensors, which one is the checkpoint is not certain (an error; export
    refuses it too)."""
    assert ctx.layout is not None
    if SHARDED_DIR not in ctx.names or SHARDED_DIR in ctx.hidden or not any(
            f.container == L.SAFETENSORS for f in ctx.layout.families):
        return
    from ckptctl.sources.dcp.hf import open_dcp_hf
    from ckptctl.sources.dcp.locate import find_sharded

    found = find_sharded(ctx.root)
    if found is None or not found[0]:
        return
    where = ctx.disp(SHARDED_DIR)
    try:
        src = open_dcp_hf(ctx.root, reading=ctx.reading)
    except CkptctlError as exc:
        ctx.add("dir.leftover_weights_folder", ERROR, where, f"{where}: torch's DCP-HF shards beside the "
                f"consolidated files, and they disagree: {exc.message}", exc.hint)
        return
    if src is not None:  # the consolidated files are not complete: sharded/ is the checkpoint
        src.close()
        ctx.add("dir.leftover_weights_folder", ERROR, where,
                f"{where} holds torch's DCP-HF shards, and the consolidated files beside it are not a complete "
                "copy of them (torch's consolidation did not finish): loaders read the consolidated files",
                f"export the shards: `ckptctl export {where} DST`")
        return
    ctx.add("dir.leftover_weights_folder", WARNING, where,
            f"{where} holds torch's DCP-HF shards of the same tensors as the consolidated files (torch's "
            "consolidation leaves it): loaders ignore it, an upload pushes it",
            f"remove {where} before uploading (the consolidated files hold the checkpoint)")
