"""An image preprocessor that disagrees with the vision tower it feeds (issue 45): the model and
its processor each load, and the first image fails (``Input image size (48*48) doesn't match
model (32*32)``) or is cut into another number of patches than the model was built for.

The image size the processor produces (its ``crop_size`` when it center-crops, else a ``size``
with both ``height`` and ``width``; a ``shortest_edge`` alone depends on the image and is not
judged) is held to the vision config's ``image_size``, for vision towers whose position embeddings
have one fixed size (CLIP, SigLIP, ViT: they do not interpolate unless asked).

Read from ``preprocessor_config.json`` (or a ``processor_config.json``'s ``image_processor``) and
config.json's ``vision_config`` (or config.json itself for a vision model), bounded.
"""

from __future__ import annotations

from typing import Any

from ckptctl.config_fields import as_int
from ckptctl.findings import ERROR
from ckptctl.format import names as N
from ckptctl.format import small
from ckptctl.verify.context import MAX_JSON_BYTES, Context

PREPROCESSOR = "preprocessor_config.json"
PROCESSOR = "processor_config.json"
# vision towers whose position embeddings have one size: an image of another size fails
FIXED_SIZE = frozenset({"clip", "clip_vision_model", "siglip", "siglip_vision_model", "vit"})
_HINT = ("save the processor that belongs to this model (processor.save_pretrained), or fix the sizes in "
         "preprocessor_config.json")


def _json(ctx: Context, name: str) -> Any:
    if name not in ctx.names or name in ctx.hidden:
        return None
    try:
        return small.loads(small.read_small(ctx.root / name, limit=MAX_JSON_BYTES, follow=True).decode("utf-8"))
    except (OSError, ValueError):
        return None  # unreadable: not judged here


def _hw(value: Any) -> tuple[int, int] | None:
    """(height, width) of a size a processor or config states: an int, [h, w], or {height, width}."""
    if isinstance(value, dict):
        h, w = as_int(value.get("height")), as_int(value.get("width"))
        return (h, w) if h is not None and w is not None else None
    if isinstance(value, list) and len(value) == 2:
        h, w = as_int(value[0]), as_int(value[1])
        return (h, w) if h is not None and w is not None else None
    n = as_int(value)
    return (n, n) if n is not None else None


def _output_size(proc: dict[str, Any]) -> tuple[int, int] | None:
    if proc.get("do_center_crop") is True and (crop := _hw(proc.get("crop_size"))) is not None:
        return crop
    size = proc.get("size")
    if proc.get("do_resize", True) is not False and isinstance(size, dict):
        return _hw(size)
    return None


def preprocessor_vision(ctx: Context) -> None:
    """``config.preprocessor_mismatch`` (module docstring)."""
    if ctx.prefix:
        return
    proc = _json(ctx, PREPROCESSOR)
    if not isinstance(proc, dict):
        doc = _json(ctx, PROCESSOR)
        proc = doc.get("image_processor") if isinstance(doc, dict) else None
    cfg = _json(ctx, N.CONFIG)
    if not isinstance(proc, dict) or not isinstance(cfg, dict):
        return
    vision = cfg.get("vision_config") if isinstance(cfg.get("vision_config"), dict) else cfg
    mt = vision.get("model_type") if vision is not cfg else cfg.get("model_type")
    shown = ctx.disp(PREPROCESSOR if PREPROCESSOR in ctx.names else PROCESSOR)
    image = _hw(vision.get("image_size"))
    out = _output_size(proc)
    if isinstance(mt, str) and mt in FIXED_SIZE and out is not None and image is not None and out != image:
        ctx.add("config.preprocessor_mismatch", ERROR, shown,
                f"{shown}: the processor makes {out[0]} x {out[1]} images, but the vision config's image_size is "
                f"{image[0]} x {image[1]}: the model and its processor load, and the first image fails (its "
                "position embeddings have one size)", _HINT, stated=list(out), model=list(image))
