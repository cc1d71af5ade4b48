"""A diffusers pipeline whose components disagree with each other (issue 45): each component
loads, and ``DiffusionPipeline.from_pretrained`` assembles them without a word, but the first
generation fails with a shape error (or decodes latents of the wrong width), because what one
component hands the next does not fit:

- the text encoders' width against the denoiser's: a UNet's ``cross_attention_dim`` is the width of
  the prompt embeddings (the text encoders' ``hidden_size``, summed where the pipeline concatenates
  two, as SDXL's does); SD3's and Flux's transformers take ``joint_attention_dim`` from the T5
  encoder (``d_model``) and ``pooled_projection_dim`` from the CLIP encoders' pooled outputs;
- the denoiser's latents against the VAE's: a UNet or SD3 transformer predicts ``out_channels``
  (``in_channels`` when unset) latent channels, which the VAE decodes (``latent_channels``); Flux
  packs 2 x 2 latent patches, so its ``in_channels`` is 4 x ``latent_channels``.

Only these classes are judged (read from ``model_index.json`` and each component's
``config.json``, bounded); another pipeline is left alone: its own components' checks still run.
"""

from __future__ import annotations

from typing import Any

from ckptctl.config_fields import as_int
from ckptctl.findings import ERROR
from ckptctl.format import names as N
from ckptctl.format import small
from ckptctl.layout import PIPELINE
from ckptctl.verify.context import MAX_JSON_BYTES, Context

UNET = "UNet2DConditionModel"
SD3 = "SD3Transformer2DModel"
FLUX = "FluxTransformer2DModel"
CLIP_TEXT = ("CLIPTextModel", "CLIPTextModelWithProjection")
_HINT = ("save the pipeline again from components that belong together (each component was saved from "
         "another model), or fix the component's config.json")


def _config(ctx: Context, folder: str) -> dict[str, Any] | None:
    target = ctx.inside(f"{folder}/{N.CONFIG}")
    if target is None:
        return None
    try:
        doc = small.loads(small.read_small(target, limit=MAX_JSON_BYTES, follow=True).decode("utf-8"))
    except (OSError, ValueError):
        return None  # a component's unreadable config is that component's finding
    return doc if isinstance(doc, dict) else None


def _width(cfg: dict[str, Any] | None, field: str) -> int | None:
    return as_int(cfg.get(field)) if cfg is not None else None


def pipeline_components(ctx: Context) -> None:
    """``config.pipeline_mismatch``: the components of a diffusers pipeline root disagree (module
    docstring)."""
    assert ctx.layout is not None
    if ctx.prefix or ctx.layout.kind != PIPELINE:
        return
    classes = {c.name: c.cls for c in ctx.layout.components if c.path}
    cfgs = {c.name: _config(ctx, c.path) for c in ctx.layout.components if c.path}
    denoiser = next((n for n in ("unet", "transformer") if classes.get(n) in (UNET, SD3, FLUX)), None)
    if denoiser is None or cfgs.get(denoiser) is None:
        return
    kind, dcfg = classes[denoiser], cfgs[denoiser]
    assert dcfg is not None
    shown = ctx.disp(f"{denoiser}/{N.CONFIG}")

    def mismatch(field: str, stated: Any, actual: int, source: str, why: str) -> None:
        ctx.add("config.pipeline_mismatch", ERROR, shown,
                f"{shown}: {field} is {stated}, but {source} gives {actual}: the pipeline loads, and {why}", _HINT,
                field=field, stated=stated, actual=actual, component=denoiser)

    vae = _width(cfgs.get("vae"), "latent_channels")
    if vae is not None:
        if kind == FLUX:
            n_in = _width(dcfg, "in_channels")
            if n_in is not None and n_in != 4 * vae:
                mismatch("in_channels", n_in, 4 * vae, "the VAE's latent_channels (x 4: Flux packs 2 x 2 patches)",
                         "the first denoising step fails with a shape error")
        else:
            out = _width(dcfg, "out_channels") or _width(dcfg, "in_channels")
            if out is not None and out != vae:
                mismatch("out_channels", out, vae, "the VAE's latent_channels",
                         "decoding its latents fails with a shape error")
    encoders = [n for n in ("text_encoder", "text_encoder_2") if classes.get(n) in CLIP_TEXT]
    widths = [_width(cfgs.get(n), "hidden_size") for n in encoders]
    # a UNet that projects the prompt first (encoder_hid_dim) takes another width: not judged here
    if kind == UNET and encoders and None not in widths and dcfg.get("encoder_hid_dim") is None:
        cross = dcfg.get("cross_attention_dim")
        stated = cross if isinstance(cross, int) and not isinstance(cross, bool) else None
        if isinstance(cross, list) and cross and all(isinstance(x, int) and x == cross[0] for x in cross):
            stated = cross[0]
        total = sum(w for w in widths if w is not None)
        if stated is not None and stated != total:
            mismatch("cross_attention_dim", cross, total, " + ".join(f"{n}'s hidden_size" for n in encoders),
                     "the first denoising step fails with a matmul shape error in cross-attention")
    if kind in (SD3, FLUX):
        t5 = "text_encoder_3" if kind == SD3 else "text_encoder_2"
        d_model = _width(cfgs.get(t5), "d_model") if classes.get(t5) == "T5EncoderModel" else None
        joint = _width(dcfg, "joint_attention_dim")
        if d_model is not None and joint is not None and joint != d_model:
            mismatch("joint_attention_dim", joint, d_model, f"{t5}'s d_model (T5)",
                     "the first step fails with a matmul shape error on the prompt embeddings")
        pooled_from = [n for n in (("text_encoder", "text_encoder_2") if kind == SD3 else ("text_encoder",))
                       if classes.get(n) in CLIP_TEXT]
        field = "projection_dim" if kind == SD3 else "hidden_size"
        sizes = [_width(cfgs.get(n), field) for n in pooled_from]
        pooled = _width(dcfg, "pooled_projection_dim")
        if pooled_from and None not in sizes and pooled is not None and pooled != sum(s for s in sizes if s):
            mismatch("pooled_projection_dim", pooled, sum(s for s in sizes if s),
                     " + ".join(f"{n}'s {field}" for n in pooled_from),
                     "the first step fails with a matmul shape error on the pooled prompt embedding")
