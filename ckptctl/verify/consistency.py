"""Consistency checks no loader reports (issue 30, item 4): files beside the weights that a
library reads silently, or whose disagreement with the weights no loader notices.

- token ids: ``generation_config.json`` that does not parse, or whose ids fall outside the
  vocabulary; added tokens of the tokenizer files outside it (:mod:`.consistency_tokens`);
- files: a Trainer checkpoint folder without the model, ZeRO-3's 0-element placeholders, torch's
  DCP-HF ``sharded/`` folder left inside a Hugging Face root, the headers of a model's native
  weights (:mod:`.consistency_files`);
- a sentence-transformers root's module dimensions (:mod:`.consistency_st`), a diffusers
  pipeline's components against each other (:mod:`.consistency_pipeline`), an image processor
  against the vision tower it feeds (:mod:`.consistency_preprocessor`), a GPTQ/AWQ
  quantization_config against how the weights are packed (:mod:`.consistency_quantized`);
- with ``--deep``, the bytes of a pickle family that holds the same tensors as the safetensors
  family beside it (:mod:`.consistency_twins`).
"""

from __future__ import annotations

from ckptctl.verify import consistency_files as F
from ckptctl.verify.consistency_pipeline import pipeline_components
from ckptctl.verify.consistency_preprocessor import preprocessor_vision
from ckptctl.verify.consistency_quantized import quantized_packing
from ckptctl.verify.consistency_st import st_dimensions
from ckptctl.verify.consistency_tokens import generation_config, tokenizer_added, vocab_size
from ckptctl.verify.context import Context


def consistency_step(ctx: Context) -> str | None:
    """Every check above; they always run on a directory (each decides from what is there)."""
    if ctx.layout is None:
        return "no layout"
    F.native_headers(ctx)
    F.trainer_state(ctx)
    F.placeholders(ctx)
    if not ctx.prefix:
        F.leftover_sharded(ctx)
    vocab = vocab_size(ctx)
    generation_config(ctx, vocab)
    tokenizer_added(ctx, vocab)
    st_dimensions(ctx)
    pipeline_components(ctx)
    preprocessor_vision(ctx)
    quantized_packing(ctx)
    if ctx.options.deep and any(f.twin_of for f in ctx.layout.families):
        from ckptctl.verify.consistency_twins import compare_twins

        compare_twins(ctx)
    return None
