"""diffusers: tiny components (UNet2DConditionModel, AutoencoderKL) and a StableDiffusionPipeline.

Components are written by ``ModelMixin.save_pretrained`` in every layout diffusers produces:
``diffusion_pytorch_model.safetensors``, sharded ``diffusion_pytorch_model-0000i-of-0000N.safetensors``
+ ``diffusion_pytorch_model.safetensors.index.json``, ``.bin`` (``safe_serialization=False``), and an
``fp16`` variant alone or beside the fp32 family (main family saved first, as with transformers).
The pipeline root is ``StableDiffusionPipeline(...).save_pretrained``: ``model_index.json`` +
``unet/``, ``vae/``, ``text_encoder/`` (a transformers CLIPTextModel), ``tokenizer/`` (a tiny
WordLevel tokenizer), ``scheduler/`` (DDPM). Pipeline tensors are ``<component>/<name>``; its forward
is two denoising steps on a fixed prompt and generator (``output_type="pt"``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .entry import Recipe, count_parameters, fp16_beside_main, module_tensors, prefixed, seeded
from .transformers_models import tiny_tokenizer, transformers_module

SHARD = "40KB"
PIPELINE_SHARD = "10KB"  # small enough to split the 16 KB text encoder too
PROMPT = "w1 w2 w3"

# parameters of each component and of the pipeline's three models together
PARAMETERS: dict[str, int] = {
    "unet": 52004, "vae": 43711, "pipeline": 99763,
}


def make_unet(seed: int = 0) -> Any:
    with seeded(seed):
        return diffusers_module().UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
            norm_num_groups=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16, attention_head_dim=4).eval()


def make_vae(seed: int = 0) -> Any:
    with seeded(seed):
        return diffusers_module().AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16), latent_channels=4,
            norm_num_groups=4, sample_size=16, layers_per_block=1).eval()


def make_pipeline() -> Any:
    diffusers = diffusers_module()
    t = transformers_module()
    with seeded(2):
        text_encoder = t.CLIPTextModel(t.CLIPTextConfig(
            vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
    return diffusers.StableDiffusionPipeline(
        vae=make_vae(1), text_encoder=text_encoder, tokenizer=tiny_tokenizer(), unet=make_unet(0),
        scheduler=diffusers.DDPMScheduler(num_train_timesteps=100), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)


# -- components -----------------------------------------------------------------------------------


def run_unet(unet: Any) -> Any:
    import torch

    g = torch.Generator().manual_seed(3)
    sample = torch.randn(1, 4, 8, 8, generator=g).to(unet.dtype)
    cond = torch.randn(1, 4, 16, generator=g).to(unet.dtype)
    return unet(sample, 10, encoder_hidden_states=cond).sample


def run_vae(vae: Any) -> Any:
    import torch

    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(3)).to(vae.dtype)
    return vae(x, sample_posterior=False).sample


def diffusers_module() -> Any:
    import diffusers

    return diffusers


def load_component(d: Path, variant: str | None = None) -> Any:
    """``<_class_name>.from_pretrained(d)``: the class the component's config.json names. diffusers loads
    in float32 unless told otherwise, so a variant is loaded with ``torch_dtype=float16``."""
    import torch

    cls = json.loads((d / "config.json").read_text())["_class_name"]
    kw = {"variant": variant, "torch_dtype": torch.float16} if variant else {}
    return getattr(diffusers_module(), cls).from_pretrained(d, **kw).eval()


def _component(name: str, layout: str, make: Any, run: Any, *, save: Any = None, reload: Any = None,
               notes: str) -> Recipe:
    return Recipe(name=f"diffusers/{name}", library="diffusers", layout=layout,
                  parameters=PARAMETERS[name.split("-")[0]], make=make, save=save or (lambda m, d: m.save_pretrained(d)),
                  reload=reload or load_component, tensors=module_tensors, run=run, count=count_parameters,
                  notes=notes, requires=("diffusers",))


def _beside(name: str, make: Any, run: Any, shard: str | None, notes: str) -> Recipe:
    return fp16_beside_main(
        name=f"diffusers/{name}", library="diffusers", layout="variant-beside-main",
        parameters=PARAMETERS[name.split("-")[0]], make=make, shard=shard, load=load_component,
        tensors=module_tensors, run=run, count=count_parameters, notes=notes + "; tensors as main/<k> and fp16/<k>",
        requires=("diffusers",))


# -- pipelines ------------------------------------------------------------------------------------

COMPONENTS = ("unet", "vae", "text_encoder")


def load_pipeline(d: Path, variant: str | None = None, dtype: Any = None) -> Any:
    """``DiffusionPipeline.from_pretrained(d)`` (a variant in float16; ``dtype`` forces one for all)."""
    import torch

    kw = {"variant": variant, "torch_dtype": torch.float16} if variant else {}
    if dtype is not None:
        kw["torch_dtype"] = dtype
    return diffusers_module().DiffusionPipeline.from_pretrained(d, **kw)


def pipeline_tensors(pipe: Any) -> dict[str, Any]:
    return prefixed({c: module_tensors(getattr(pipe, c)) for c in COMPONENTS})


def pipeline_parameters(pipe: Any) -> int:
    return sum(count_parameters(getattr(pipe, c)) for c in COMPONENTS)


def run_pipeline(pipe: Any) -> Any:
    import torch

    return pipe(PROMPT, num_inference_steps=2, height=16, width=16, guidance_scale=1.0, output_type="pt",
                generator=torch.Generator().manual_seed(0)).images


def _load_pipeline_family(d: Path, variant: str | None) -> Any:
    """text_encoder/config.json names the dtype of the last save only: the main family is forced to float32."""
    import torch

    return load_pipeline(d, variant) if variant else load_pipeline(d, dtype=torch.float32)


def _pipeline(name: str, layout: str, notes: str, *, shard: str | None = None) -> Recipe:
    kw = {"max_shard_size": shard} if shard else {}
    return Recipe(name=f"diffusers/{name}", library="diffusers", layout=layout, parameters=PARAMETERS["pipeline"],
                  make=make_pipeline, save=lambda p, d: p.save_pretrained(d, **kw), reload=load_pipeline,
                  tensors=pipeline_tensors, run=run_pipeline, count=pipeline_parameters, notes=notes,
                  requires=("diffusers", "transformers"))


def make_unet_fp16() -> Any:
    import torch

    return make_unet().to(torch.float16)


def recipes() -> list[Recipe]:
    return [
        _component("unet", "component", make_unet, run_unet,
                   notes="UNet2DConditionModel: diffusion_pytorch_model.safetensors + config.json"),
        _component("vae", "component", make_vae, run_vae,
                   notes="AutoencoderKL: diffusion_pytorch_model.safetensors + config.json"),
        _component("unet-sharded", "sharded", make_unet, run_unet,
                   save=lambda m, d: m.save_pretrained(d, max_shard_size=SHARD),
                   notes="diffusion_pytorch_model-0000i-of-0000N.safetensors + "
                         "diffusion_pytorch_model.safetensors.index.json"),
        _component("unet-bin", "bin", make_unet, run_unet,
                   save=lambda m, d: m.save_pretrained(d, safe_serialization=False),
                   notes="safe_serialization=False: diffusion_pytorch_model.bin"),
        _component("unet-fp16", "variant", make_unet_fp16, run_unet,
                   save=lambda m, d: m.save_pretrained(d, variant="fp16"),
                   reload=lambda d: load_component(d, "fp16"),
                   notes="diffusion_pytorch_model.fp16.safetensors alone (loaded in the files' dtype)"),
        _beside("vae-fp16-beside-main", make_vae, run_vae, None,
                "diffusion_pytorch_model.safetensors + diffusion_pytorch_model.fp16.safetensors"),
        _beside("unet-fp16-beside-main-sharded", make_unet, run_unet, SHARD,
                "both families sharded: diffusion_pytorch_model-0000i-of-0000N + "
                "diffusion_pytorch_model.fp16-0000i-of-0000M, each with its index "
                "(...safetensors.index.json, ...safetensors.index.fp16.json)"),
        _pipeline("pipeline", "pipeline", "StableDiffusionPipeline root: model_index.json + unet/ vae/ "
                  "text_encoder/ tokenizer/ scheduler/; tensors as <component>/<name>"),
        _pipeline("pipeline-sharded", "pipeline", "the pipeline with max_shard_size=10KB: unet/ and vae/ "
                  "sharded diffusion_pytorch_model-*, text_encoder/ sharded model-*", shard=PIPELINE_SHARD),
        fp16_beside_main(
            name="diffusers/pipeline-fp16-beside-main", library="diffusers", layout="pipeline-variant",
            parameters=PARAMETERS["pipeline"], make=make_pipeline, shard=None, load=_load_pipeline_family,
            tensors=pipeline_tensors, run=run_pipeline, count=pipeline_parameters,
            notes="the pipeline saved in fp32, then save_pretrained(variant='fp16') of its fp16 copy: every "
                  "component holds both families; tensors as main/<component>/<k> and fp16/<component>/<k>. "
                  "text_encoder/config.json says float16 (the last save wins): without torch_dtype=float32 "
                  "the main family's text encoder loads as float16 and the pipeline fails",
            requires=("diffusers", "transformers")),
    ]

