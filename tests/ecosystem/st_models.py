"""sentence-transformers: a root of four modules written by ``SentenceTransformer.save``.

``SentenceTransformer(modules=[Transformer, Pooling, Dense, Normalize])`` over a tiny BERT and a
WordLevel tokenizer (both built in code, handed to ``models.Transformer`` through a scratch
directory, as it only loads from a path). ``save`` writes the root: ``modules.json``,
``sentence_bert_config.json``, ``config_sentence_transformers.json``, the BERT's ``config.json`` +
``model.safetensors`` + tokenizer at the root (module 0), ``1_Pooling/config.json``,
``2_Dense/config.json`` + ``2_Dense/model.safetensors`` (its own weights), ``3_Normalize/``.
Loaded with ``SentenceTransformer(d)``; tensors are its state dict (``0.…``, ``2.linear.…``);
forward is ``encode`` of two fixed sentences.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from .entry import Recipe, count_parameters, module_tensors, seeded
from .transformers_models import tiny_tokenizer, transformers_module

SENTENCES = ["w1 w2 w3", "w4 w5 w6 w7"]

# parameters of the whole SentenceTransformer (BERT + Dense)
PARAMETERS: dict[str, int] = {
    "root": 23920,
}


def make_st() -> Any:
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    t = transformers_module()
    with seeded(0):
        bert = t.BertModel(t.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=64, pad_token_id=0))
    with tempfile.TemporaryDirectory(prefix="ecosystem-st-") as scratch:
        bert.save_pretrained(scratch)
        tiny_tokenizer(model_max_length=32).save_pretrained(scratch)
        transformer = modules.Transformer(scratch, max_seq_length=32)
    with seeded(1):
        dense = modules.Dense(in_features=32, out_features=16, activation_function=torch.nn.Tanh())
    pooling = modules.Pooling(embedding_dimension=32, pooling_mode="mean")
    return SentenceTransformer(modules=[transformer, pooling, dense, modules.Normalize()], device="cpu").eval()


def load_st(d: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(d), device="cpu", local_files_only=True).eval()


def run_st(model: Any) -> Any:
    return model.encode(SENTENCES, convert_to_tensor=True, batch_size=2, show_progress_bar=False)


def recipes() -> list[Recipe]:
    return [Recipe(name="sentence-transformers/root", library="sentence-transformers", layout="st-root",
                   parameters=PARAMETERS["root"], make=make_st, save=lambda m, d: m.save(str(d)),
                   reload=load_st, tensors=module_tensors, run=run_st, count=count_parameters,
                   notes="Transformer (BERT) + Pooling(mean) + Dense(32->16, tanh) + Normalize; module 0 at the "
                         "root, 2_Dense/model.safetensors holds the Dense weights",
                   requires=("sentence_transformers", "transformers"))]

