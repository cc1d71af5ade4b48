"""transformers: tiny random models of 40 classes built from configs, written by ``save_pretrained``.

Every class gets a ``transformers/<model_type>`` entry (one ``model.safetensors``). The other
layouts transformers and its neighbours produce use Llama, and Qwen2 / Qwen3 / GPT-2 where tying or
dtype matters: sharded (untied, and tied), Llama tied, Qwen3 in bfloat16, ``variant="fp16"`` alone and
beside the main family (single and sharded), and the legacy pickles (``pytorch_model.bin``, and
GPT-2 sharded). transformers 5 no longer writes pickles, so
those are written as transformers 4 did with ``safe_serialization=False``: accelerate's
``save_model(safe_serialization=False)`` (the same ``torch.save`` of huggingface_hub's shard split,
same names, same index) beside ``config.json``. Loading is always ``from_pretrained`` of the
directory; a missing or unexpected key is an error, never a silent re-initialisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .entry import Recipe, count_parameters, fp16_beside_main, module_tensors, seeded

T = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
DEC = dict(T, intermediate_size=64, max_position_embeddings=64)
ENC = dict(DEC, type_vocab_size=2)
CLIP_TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=16)
CLIP_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                   patch_size=8)
SEQ2SEQ = dict(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
               pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)

IDS = [[1, 5, 9, 13, 17, 21, 25, 29]]

# sum(p.numel() for p in model.parameters()) of each tiny model (tied parameters once); checked by
# tests/test_ecosystem_corpus.py against the model the library builds
PARAMETERS: dict[str, int] = {
    "llama": 24736, "mistral": 23712, "qwen2": 21792, "qwen3": 24768, "gemma": 20640, "gemma2": 21792,
    "phi": 23264, "phi3": 26784, "gpt2": 30592, "gpt_neo": 30400, "gptj": 31328, "gpt_bigcode": 27424,
    "gpt_neox": 23296, "falcon": 25920, "bloom": 28608, "opt": 22336, "stablelm": 24896, "cohere": 21600,
    "olmo": 26624, "mixtral": 61856, "qwen2_moe": 31328, "deepseek_v3": 25936, "olmoe": 61952, "bert": 23552,
    "roberta": 23616, "xlm-roberta": 23456, "electra": 21345, "deberta-v2": 28224, "mpnet": 23680,
    "albert": 12368, "distilbert": 23488, "t5": 44480, "bart": 28800, "marian": 28544, "pegasus": 28672,
    "whisper": 29920, "clip": 45313, "siglip": 53762, "llava": 50400, "qwen2_vl": 35968, "llama-tied": 21664,
}
SHARD = "20KB"


@dataclass(frozen=True)
class Model:
    """A class, its config and the input its forward takes."""

    cls: str
    config: str
    kwargs: dict[str, Any]
    inputs: str = "ids"          # ids | seq2seq | whisper | image-text
    nested: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)  # sub-config name -> (class, kwargs)
    note: str = ""


MOE = ("experts stored one tensor per expert and projection (transformers' original format), loaded fused "
       "(experts.gate_up_proj / experts.down_proj): load() keys are not the file's")
VLM = ("stored under the original names ({stored}), loaded as {loaded}: load() keys are not the file's; "
       "forward is text only")


MODELS: dict[str, Model] = {
    # decoders
    "llama": Model("LlamaForCausalLM", "LlamaConfig", dict(DEC, num_key_value_heads=2)),
    "mistral": Model("MistralForCausalLM", "MistralConfig", dict(DEC, num_key_value_heads=1)),
    "qwen2": Model("Qwen2ForCausalLM", "Qwen2Config", dict(DEC, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": Model("Qwen3ForCausalLM", "Qwen3Config", dict(DEC, num_key_value_heads=2, head_dim=8)),
    "gemma": Model("GemmaForCausalLM", "GemmaConfig", dict(DEC, num_key_value_heads=1, head_dim=8)),
    "gemma2": Model("Gemma2ForCausalLM", "Gemma2Config", dict(DEC, num_key_value_heads=2, head_dim=8)),
    "phi": Model("PhiForCausalLM", "PhiConfig", dict(DEC)),
    "phi3": Model("Phi3ForCausalLM", "Phi3Config", dict(DEC, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gpt2": Model("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                        bos_token_id=0, eos_token_id=0)),
    "gpt_neo": Model("GPTNeoForCausalLM", "GPTNeoConfig",
                     dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
                          attention_types=[[["global", "local"], 1]], window_size=8, bos_token_id=0, eos_token_id=0)),
    "gptj": Model("GPTJForCausalLM", "GPTJConfig", dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                        rotary_dim=4, bos_token_id=0, eos_token_id=0)),
    "gpt_bigcode": Model("GPTBigCodeForCausalLM", "GPTBigCodeConfig",
                         dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                              eos_token_id=0)),
    "gpt_neox": Model("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(DEC, bos_token_id=0, eos_token_id=0)),
    "falcon": Model("FalconForCausalLM", "FalconConfig", dict(T, new_decoder_architecture=True, num_kv_heads=2,
                                                             bos_token_id=0, eos_token_id=0)),
    "bloom": Model("BloomForCausalLM", "BloomConfig", dict(vocab_size=96, hidden_size=32, n_layer=2, n_head=4,
                                                           bos_token_id=0, eos_token_id=0)),
    "opt": Model("OPTForCausalLM", "OPTConfig", dict(T, ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32,
                                                     pad_token_id=1, bos_token_id=2, eos_token_id=2)),
    "stablelm": Model("StableLmForCausalLM", "StableLmConfig", dict(DEC, num_key_value_heads=2, bos_token_id=0,
                                                                    eos_token_id=0)),
    "cohere": Model("CohereForCausalLM", "CohereConfig", dict(DEC, num_key_value_heads=2, pad_token_id=0,
                                                              bos_token_id=1, eos_token_id=2)),
    "olmo": Model("OlmoForCausalLM", "OlmoConfig", dict(DEC, pad_token_id=1, bos_token_id=0, eos_token_id=0)),
    # mixture of experts
    "mixtral": Model("MixtralForCausalLM", "MixtralConfig", dict(DEC, num_key_value_heads=2, num_local_experts=4,
                                                                 num_experts_per_tok=2), note=MOE),
    "qwen2_moe": Model("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                       dict(DEC, num_key_value_heads=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                            num_experts=4, num_experts_per_tok=2), note=MOE),
    "deepseek_v3": Model("DeepseekV3ForCausalLM", "DeepseekV3Config",
                         dict(DEC, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4,
                              n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                              first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4,
                              qk_nope_head_dim=4, v_head_dim=8), note=MOE),
    "olmoe": Model("OlmoeForCausalLM", "OlmoeConfig", dict(DEC, num_key_value_heads=2, num_experts=4,
                                                           num_experts_per_tok=2, pad_token_id=1, bos_token_id=0,
                                                           eos_token_id=0), note=MOE),
    # encoders
    "bert": Model("BertForMaskedLM", "BertConfig", dict(ENC)),
    "roberta": Model("RobertaForMaskedLM", "RobertaConfig", dict(ENC, max_position_embeddings=66, pad_token_id=1)),
    "xlm-roberta": Model("XLMRobertaModel", "XLMRobertaConfig", dict(ENC, max_position_embeddings=66, pad_token_id=1)),
    "electra": Model("ElectraForPreTraining", "ElectraConfig", dict(ENC, embedding_size=16)),
    "deberta-v2": Model("DebertaV2ForMaskedLM", "DebertaV2Config",
                        dict(ENC, relative_attention=True, position_buckets=8, max_relative_positions=16,
                             pos_att_type=["p2c", "c2p"], type_vocab_size=0)),
    "mpnet": Model("MPNetForMaskedLM", "MPNetConfig", dict(DEC, max_position_embeddings=66, pad_token_id=1)),
    "albert": Model("AlbertForMaskedLM", "AlbertConfig", dict(ENC, embedding_size=16, pad_token_id=0)),
    "distilbert": Model("DistilBertForMaskedLM", "DistilBertConfig",
                        dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64)),
    # encoder-decoders
    "t5": Model("T5ForConditionalGeneration", "T5Config",
                dict(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
                     relative_attention_num_buckets=8), "seq2seq"),
    "bart": Model("BartForConditionalGeneration", "BartConfig", dict(SEQ2SEQ), "seq2seq"),
    "marian": Model("MarianMTModel", "MarianConfig", dict(SEQ2SEQ, decoder_start_token_id=1), "seq2seq"),
    "pegasus": Model("PegasusForConditionalGeneration", "PegasusConfig", dict(SEQ2SEQ, decoder_start_token_id=1),
                     "seq2seq"),
    "whisper": Model("WhisperForConditionalGeneration", "WhisperConfig",
                     dict(SEQ2SEQ, num_mel_bins=8, max_source_positions=16, max_target_positions=32,
                          pad_token_id=1, decoder_start_token_id=3, suppress_tokens=[], begin_suppress_tokens=[]),
                     "whisper"),
    # multimodal
    "clip": Model("CLIPModel", "CLIPConfig", dict(projection_dim=16), "image-text",
                  nested={"text_config": ("CLIPTextConfig", CLIP_TEXT),
                          "vision_config": ("CLIPVisionConfig", CLIP_VISION)}),
    "siglip": Model("SiglipModel", "SiglipConfig", {}, "image-text",
                    nested={"text_config": ("SiglipTextConfig", dict(CLIP_TEXT)),
                            "vision_config": ("SiglipVisionConfig", CLIP_VISION)}),
    "llava": Model("LlavaForConditionalGeneration", "LlavaConfig",
                   dict(image_token_id=95, projector_hidden_act="gelu", vision_feature_layer=-1),
                   nested={"text_config": ("LlamaConfig", dict(DEC, num_key_value_heads=2)),
                           "vision_config": ("CLIPVisionConfig", CLIP_VISION)},
                   note=VLM.format(stored="language_model.model.*, language_model.lm_head, vision_tower.*, "
                                          "multi_modal_projector.*",
                                   loaded="model.language_model.*, lm_head, model.vision_tower.*, "
                                          "model.multi_modal_projector.*")),
    "qwen2_vl": Model("Qwen2VLForConditionalGeneration", "Qwen2VLConfig",
                      dict(image_token_id=94, video_token_id=95, vision_start_token_id=93, vision_end_token_id=92),
                      nested={"text_config": ("Qwen2VLTextConfig",
                                              dict(DEC, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                    "mrope_section": [1, 1, 2]})),
                              "vision_config": ("Qwen2VLVisionConfig",
                                                dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2,
                                                     patch_size=2, spatial_merge_size=1, temporal_patch_size=1))},
                      note=VLM.format(stored="model.layers.*, model.embed_tokens, visual.*",
                                      loaded="model.language_model.*, model.visual.*")),
}


def transformers_module() -> Any:
    import transformers

    return transformers


def make_model(model_type: str, *, seed: int = 0, dtype: str | None = None, **overrides: Any) -> Any:
    """The tiny ``model_type`` model with weights drawn under ``seed``, built in ``dtype`` ("bfloat16"...)."""
    import torch

    t = transformers_module()
    m = MODELS[model_type]
    kwargs = dict(m.kwargs, **overrides)
    for key, (cfg_cls, sub) in m.nested.items():
        kwargs[key] = getattr(t, cfg_cls)(**sub)
    config = getattr(t, m.config)(**kwargs)
    with seeded(seed):
        if dtype is None:
            model = getattr(t, m.cls)(config)
        else:
            # built in ``dtype`` as from_pretrained builds it (a later .to() would also cast the rotary buffers)
            model = t.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model.eval()


def load_model(d: Path, *, variant: str | None = None, dtype: Any = "auto") -> Any:
    """``from_pretrained(d)`` of the class config.json names; strict (see ``from_pretrained_strict``)."""
    import json

    arch = json.loads((d / "config.json").read_text())["architectures"][0]
    return from_pretrained_strict(arch, d, variant=variant, dtype=dtype)


def from_pretrained_strict(cls: str, source: Any, **kwargs: Any) -> Any:
    """``<cls>.from_pretrained(source, **kwargs)`` that raises on any missing, unexpected or mismatched key."""
    model, info = getattr(transformers_module(), cls).from_pretrained(source, output_loading_info=True, **kwargs)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise AssertionError(f"{source}: from_pretrained did not load every weight: {problems}")
    return model.eval()


def run_model(model: Any) -> Any:
    """The model's main output on a fixed input chosen by its kind (see ``Model.inputs``)."""
    out = model(**_inputs(model))
    for attr in ("logits", "logits_per_image", "last_hidden_state"):
        value = getattr(out, attr, None)
        if value is not None:
            return value
    raise AssertionError(f"{type(model).__name__} returned no logits or hidden states: {type(out).__name__}")


def _inputs(model: Any) -> dict[str, Any]:
    import torch

    cfg = model.config
    ids = torch.tensor(IDS)
    kind = next((m.inputs for m in MODELS.values() if m.cls == type(model).__name__), "ids")
    g = torch.Generator().manual_seed(1)
    if kind == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :4]}
    if kind == "whisper":
        feats = torch.randn(1, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g)
        return {"input_features": feats.to(model.dtype), "decoder_input_ids": ids[:, :4]}
    if kind == "image-text":
        size = cfg.vision_config.image_size
        pixels = torch.randn(2, 3, size, size, generator=g).to(model.dtype)
        return {"input_ids": torch.tensor([IDS[0], IDS[0][::-1]]), "pixel_values": pixels}
    return {"input_ids": ids}


def model_recipe(name: str, layout: str, make: Any, *, save: Any = None, variant: str | None = None,
                 dtype: Any = "auto", parameters: int | None, notes: str = "", requires: tuple[str, ...] = ()
                 ) -> Recipe:
    """A transformers model written by ``save`` (default ``save_pretrained``) and loaded strictly."""
    return Recipe(
        name=name, library="transformers", layout=layout, parameters=parameters, make=make,
        save=save or (lambda m, d: m.save_pretrained(d, variant=variant)),
        reload=lambda d: load_model(d, variant=variant, dtype=dtype),
        tensors=module_tensors, run=run_model, count=count_parameters, notes=notes,
        requires=("transformers", *requires))


def _class_recipe(model_type: str, parameters: int) -> Recipe:
    m = MODELS[model_type]
    return model_recipe(f"transformers/{model_type}", "single", lambda: make_model(model_type),
                        parameters=parameters, notes=f"{m.cls} ({m.inputs} input)" + (f"; {m.note}" if m.note else ""))


def _save_sharded(model: Any, d: Path, variant: str | None = None) -> None:
    model.save_pretrained(d, max_shard_size=SHARD, variant=variant)


def _load_family(d: Path, variant: str | None) -> Any:
    """One family of a directory holding two: config.json names the dtype of the last save only."""
    import torch

    return load_model(d, variant=variant, dtype=torch.float16 if variant else torch.float32)


def _beside_main_recipe(sharded: bool, parameters: int) -> Recipe:
    suffix = "-sharded" if sharded else ""
    return fp16_beside_main(
        name=f"transformers/llama-fp16-beside-main{suffix}", library="transformers", layout="variant-beside-main",
        parameters=parameters, make=lambda: make_model("llama"), shard=SHARD if sharded else None,
        load=_load_family, tensors=module_tensors, run=run_model, count=count_parameters,
        notes="model family (fp32) and model.fp16 family side by side" + (", both sharded" if sharded else "")
              + "; tensors as main/<k> and fp16/<k>; forward runs the main family. config.json says float16 "
              "(the last save wins): from_pretrained without dtype would load the fp32 family as float16, so each "
              "family is loaded with its dtype", requires=("transformers",))


def _save_legacy_bin(sharded: bool) -> Any:
    def save(model: Any, d: Path) -> None:
        from accelerate import Accelerator

        Accelerator(cpu=True).save_model(model, d, max_shard_size=SHARD if sharded else "10GB",
                                         safe_serialization=False)
        model.config.architectures = [type(model).__name__]  # as save_pretrained records it
        model.config.save_pretrained(d)
    return save


def recipes() -> list[Recipe]:
    out = [_class_recipe(k, PARAMETERS[k]) for k in MODELS]
    llama = lambda: make_model("llama")  # noqa: E731
    out += [
        model_recipe("transformers/llama-sharded", "sharded", llama, save=_save_sharded, parameters=PARAMETERS["llama"],
                     notes="untied lm_head; model-0000i-of-0000N.safetensors + model.safetensors.index.json"),
        model_recipe("transformers/qwen2-tied-sharded", "sharded", lambda: make_model("qwen2"), save=_save_sharded,
                     parameters=PARAMETERS["qwen2"], notes="tie_word_embeddings=True: lm_head not stored"),
        model_recipe("transformers/llama-tied", "single", lambda: make_model("llama", tie_word_embeddings=True),
                     parameters=PARAMETERS["llama-tied"], notes="Llama with tie_word_embeddings=True"),
        model_recipe("transformers/qwen3-bf16", "single", lambda: make_model("qwen3", dtype="bfloat16"),
                     parameters=PARAMETERS["qwen3"], notes="bfloat16 weights, config dtype bfloat16"),
        model_recipe("transformers/llama-fp16", "variant", lambda: make_model("llama", dtype="float16"),
                     variant="fp16", parameters=PARAMETERS["llama"], notes="model.fp16.safetensors alone"),
        model_recipe("transformers/llama-fp16-sharded", "variant", lambda: make_model("llama", dtype="float16"),
                     save=lambda m, d: _save_sharded(m, d, "fp16"), variant="fp16", parameters=PARAMETERS["llama"],
                     notes="model.fp16-0000i-of-0000N.safetensors + model.safetensors.index.fp16.json alone"),
        _beside_main_recipe(False, PARAMETERS["llama"]),
        _beside_main_recipe(True, PARAMETERS["llama"]),
        model_recipe("transformers/llama-bin", "bin", llama, save=_save_legacy_bin(False),
                     parameters=PARAMETERS["llama"], requires=("accelerate",),
                     notes="pytorch_model.bin + config.json (transformers 4 safe_serialization=False layout, "
                           "written by accelerate.save_model)"),
        model_recipe("transformers/gpt2-bin-sharded", "bin-sharded", lambda: make_model("gpt2"),
                     save=_save_legacy_bin(True), parameters=PARAMETERS["gpt2"], requires=("accelerate",),
                     notes="pytorch_model-0000i-of-0000N.bin + pytorch_model.bin.index.json + config.json; tied "
                           "wte/lm_head pickled once per shard that holds them"),
    ]
    return out



def tiny_tokenizer(model_max_length: int = 16) -> Any:
    """A WordLevel tokenizer over ``<pad> <s> </s> <unk> w0..w59`` (built in code, nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = transformers_module()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(60)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return t.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                     unk_token="<unk>", model_max_length=model_max_length)
