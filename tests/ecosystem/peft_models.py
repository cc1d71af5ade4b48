"""peft: adapters (LoRA, DoRA, IA3, LoKr, LoRA with ``modules_to_save``) on the tiny Llama.

``get_peft_model(base, config).save_pretrained(d)`` writes ``adapter_config.json`` +
``adapter_model.safetensors`` (``adapter_model.bin`` with ``safe_serialization=False``). Adapter
weights are drawn under a fixed seed (not peft's zero/one init, so a lost or zeroed adapter shows).
The base model is not in the directory: like a real adapter it is rebuilt from its config
(``make_model("llama")``, seed 0) and ``PeftModel.from_pretrained(base, d)`` loads the adapter.
Tensors are ``get_peft_model_state_dict`` (the names as stored, adapter name removed);
``parameters`` is peft's trainable count, which equals the stored elements.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .entry import Recipe, seeded
from .transformers_models import make_model, run_model

ATTN = ["q_proj", "v_proj"]

# peft's trainable parameter count (get_nb_trainable_parameters), equal to the elements stored
PARAMETERS: dict[str, int] = {
    "lora": 896, "dora": 992, "ia3": 192, "lokr": 256, "lora-modules-to-save": 3968, "lora-bin": 896,
}


def _configs() -> dict[str, Any]:
    import peft

    return {
        "lora": peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTN, init_lora_weights=False),
        "dora": peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTN, use_dora=True, init_lora_weights=False),
        "ia3": peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
        "lokr": peft.LoKrConfig(r=4, alpha=8, target_modules=ATTN),
        "lora-modules-to-save": peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTN, init_lora_weights=False,
                                                modules_to_save=["lm_head"]),
        "lora-bin": peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTN, init_lora_weights=False),
    }


def make_adapter(kind: str) -> Any:
    """The PeftModel of ``kind`` on the seed-0 tiny Llama, with seeded non-trivial adapter weights."""
    import peft
    import torch

    with seeded(1):  # peft draws its own initial adapter weights from the global RNG
        model = peft.get_peft_model(make_model("llama"), _configs()[kind])
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:  # the adapter (and the modules_to_save copies)
                    p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def load_adapter(d: Path) -> Any:
    import peft

    return peft.PeftModel.from_pretrained(make_model("llama"), d).eval()


def adapter_tensors(model: Any) -> dict[str, Any]:
    from peft import get_peft_model_state_dict

    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


def trainable(model: Any) -> int:
    return model.get_nb_trainable_parameters()[0]


def recipes() -> list[Recipe]:
    notes = {
        "lora": "LoRA r=4 on q_proj/v_proj: lora_A/lora_B",
        "dora": "LoRA with use_dora=True: lora_A/lora_B + lora_magnitude_vector",
        "ia3": "IA3 on k_proj/v_proj/down_proj (down_proj as feedforward): ia3_l vectors",
        "lokr": "LoKr r=4 on q_proj/v_proj: lokr_w1, lokr_w2",
        "lora-modules-to-save": "LoRA + modules_to_save=['lm_head']: a full lm_head copy stored with the adapter",
        "lora-bin": "LoRA saved with safe_serialization=False: adapter_model.bin",
    }
    out = []
    for kind, note in notes.items():
        safe = kind != "lora-bin"
        out.append(Recipe(
            name=f"peft/{kind}", library="peft", layout="adapter", parameters=PARAMETERS[kind],
            make=lambda kind=kind: make_adapter(kind),
            save=lambda m, d, safe=safe: m.save_pretrained(d, safe_serialization=safe),
            reload=load_adapter, tensors=adapter_tensors, run=run_model, count=trainable, notes=note,
            requires=("transformers", "peft")))
    return out

