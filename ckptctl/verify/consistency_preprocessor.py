"""An image preprocessor that disagrees with the vision tower it feeds (issue 45): the model and
its processor each load, and the first image fails (``Input image size (48*48) doesn't match
model (32*32)``) or is cut into another number of patches than the model was built for.

The image size the processor produces (its ``crop_size`` when it center-crops, else a ``size``
with both ``height`` and ``width``; a ``shortest_edge`` alone depends on the image and is not
judged) is held to the vision config's ``image_size``, for vision towers whose position embeddings
have one fixed size (CLIP, SigLIP, ViT: they do not interpolate unless asked).

A processor that cuts the image into patches itself (SigLIP2's ``patch_size``) is held to the vision
config's ``patch_size`` (its patch embedding is a linear layer of ``3 * patch_size^2`` inputs; a
``max_num_patches`` of another size is interpolated and judged by no one).

The number of image tokens the processor puts in the text is held to the number of features the
vision tower gives (the model raises ``Image features and image tokens do not match`` at the first
image): PaliGemma's ``image_seq_length`` against ``(image_size // patch_size)^2`` of its SigLIP
tower; a ``Gemma3Processor``'s ``image_seq_length`` (256 unless stated) against the tower's patch
grid pooled to ``sqrt(mm_tokens_per_image)`` a side; a ``LlavaProcessor``'s count,
``(height // patch_size) * (width // patch_size) + num_additional_image_tokens`` (less one with
``vision_feature_select_strategy: default``), against the CLIP or SigLIP tower's patches (plus
CLIP's class token, less one with the model's ``default`` strategy). Other processors' token counts
are not judged.

Read from ``preprocessor_config.json`` (or a ``processor_config.json``'s ``image_processor``), the
processor's own fields in ``processor_config.json``, and config.json's ``vision_config`` (or
config.json itself for a vision model), bounded; config.json through the context's parsed copy.
"""

from __future__ import annotations

import math
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
# vision towers fed patches the processor has already cut and flattened (``pixel_values`` of
# ``[patches, channels * patch_size^2]``): a processor patch size of another size fails the first matmul
PATCHIFIED = frozenset({"siglip2_vision_model"})
_HINT = ("save the processor that belongs to this model (processor.save_pretrained), or fix the field the "
         "message names in the processor's file")


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


def _patches(vision: dict[str, Any]) -> int | None:
    """The patch tokens of a square vision tower (its patch embedding strides by patch_size)."""
    size, patch = as_int(vision.get("image_size")), as_int(vision.get("patch_size"))
    return (size // patch) ** 2 if size is not None and patch is not None and size > 0 and patch > 0 else None


def _llava_tokens(doc: dict[str, Any], out: tuple[int, int] | None) -> int | None:
    """The image tokens a LlavaProcessor puts in the text for one image (``replace_image_token``)."""
    patch, extra = as_int(doc.get("patch_size")), as_int(doc.get("num_additional_image_tokens", 0))
    if out is None or patch is None or patch <= 0 or extra is None:
        return None
    return (out[0] // patch) * (out[1] // patch) + extra - (doc.get("vision_feature_select_strategy") == "default")


def _llava_features(cfg: dict[str, Any], vision: dict[str, Any]) -> int | None:
    """The image features LlavaForConditionalGeneration gives for one image (``get_image_features``)."""
    patches, mt = _patches(vision), vision.get("model_type")
    if patches is None or mt not in ("clip_vision_model", "siglip_vision_model"):
        return None
    return patches + (mt == "clip_vision_model") - (cfg.get("vision_feature_select_strategy", "default") == "default")


def _gemma3_features(cfg: dict[str, Any], vision: dict[str, Any]) -> int | None:
    """The image features Gemma3ForConditionalGeneration gives for one image: the tower's patch grid
    average-pooled to ``sqrt(mm_tokens_per_image)`` a side (``Gemma3MultiModalProjector``)."""
    size, patch, mm = as_int(vision.get("image_size")), as_int(vision.get("patch_size")), \
        as_int(cfg.get("mm_tokens_per_image", 256))
    if size is None or patch is None or mm is None or patch <= 0 or mm <= 0 or vision.get("model_type") not in (
            None, "siglip_vision_model"):
        return None
    side = size // patch
    kernel = side // math.isqrt(mm)
    return (side // kernel) ** 2 if kernel > 0 else None


def _image_tokens(cfg: dict[str, Any], vision: dict[str, Any], proc: dict[str, Any], doc: Any,
                  out: tuple[int, int] | None, source: str) -> tuple[str, str, int, int, dict[str, Any]] | None:
    """(file, field, tokens the processor makes, features the model gives, details) where they
    differ; ``source`` is the file ``proc`` (the image processor's fields) came from."""
    mt = cfg.get("model_type")
    if mt == "paligemma" and vision.get("model_type", "siglip_vision_model") == "siglip_vision_model":
        seq, patches = as_int(proc.get("image_seq_length")), _patches(vision)
        if seq is not None and patches is not None and seq != patches:
            return source, "image_seq_length", seq, patches, {}
    if mt == "gemma3" and isinstance(doc, dict) and doc.get("processor_class") == "Gemma3Processor":
        seq, features = as_int(doc.get("image_seq_length", 256)), _gemma3_features(cfg, vision)
        if seq is not None and features is not None and seq != features:
            return PROCESSOR, "image_seq_length", seq, features, {}
    if mt == "llava" and isinstance(doc, dict) and doc.get("processor_class") == "LlavaProcessor":
        tokens, features = _llava_tokens(doc, out), _llava_features(cfg, vision)
        if tokens is not None and features is not None and tokens != features:
            field = ("patch_size" if doc.get("patch_size") != vision.get("patch_size") else
                     "vision_feature_select_strategy" if doc.get("vision_feature_select_strategy")
                     != cfg.get("vision_feature_select_strategy", "default") else "num_additional_image_tokens")
            return PROCESSOR, field, tokens, features, {"processor_patch_size": doc.get("patch_size"),
                                             "model_patch_size": vision.get("patch_size")}
    return None


def preprocessor_vision(ctx: Context) -> None:
    """``config.preprocessor_mismatch`` (module docstring)."""
    if ctx.prefix:
        return
    doc = _json(ctx, PROCESSOR)
    proc, source = _json(ctx, PREPROCESSOR), PREPROCESSOR
    if not isinstance(proc, dict):
        proc, source = (doc.get("image_processor") if isinstance(doc, dict) else None), PROCESSOR
    present, cfg = ctx.open_json(N.CONFIG, "config", "config.bad_json")
    if not present or not isinstance(proc, dict) or not isinstance(cfg, dict):
        return
    vision = cfg.get("vision_config") if isinstance(cfg.get("vision_config"), dict) else cfg
    mt = vision.get("model_type") if vision is not cfg else cfg.get("model_type")
    shown = ctx.disp(source)
    image = _hw(vision.get("image_size"))
    out = _output_size(proc)
    if isinstance(mt, str) and mt in FIXED_SIZE and out is not None and image is not None and out != image:
        ctx.add("config.preprocessor_mismatch", ERROR, shown,
                f"{shown}: the processor makes {out[0]} x {out[1]} images, but the vision config's image_size is "
                f"{image[0]} x {image[1]}: the model and its processor load, and the first image fails (its "
                "position embeddings have one size)", _HINT, field="image_size", stated=list(out), model=list(image))
        return
    patch, model_patch = as_int(proc.get("patch_size")), as_int(vision.get("patch_size"))
    if mt in PATCHIFIED and patch is not None and model_patch is not None and patch != model_patch:
        ctx.add("config.preprocessor_mismatch", ERROR, shown,
                f"{shown}: the processor cuts images into {patch} x {patch} patches, but the vision tower's patch "
                f"embedding takes {model_patch} x {model_patch}: the model and its processor load, and the first "
                "image fails (a matmul shape error)", _HINT, field="patch_size", stated=patch, model=model_patch)
        return
    found = _image_tokens(cfg, vision, proc, doc, out, source)
    if found is not None:
        name, field, tokens, features, details = found
        shown = ctx.disp(name)
        ctx.add("config.preprocessor_mismatch", ERROR, shown,
                f"{shown}: the processor puts {tokens} image tokens in the text for an image ({field}), but the vision "
                f"tower gives {features} features: the model and its processor load, and the first image fails "
                "(Image features and image tokens do not match)", _HINT, field=field, stated=tokens, model=features,
                **details)
