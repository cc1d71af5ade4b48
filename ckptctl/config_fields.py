"""config.json fields under every name the libraries use for them, in one table.

GPT-2, GPT-NeoX, Falcon, T5 and others name the same facts differently (``n_embd`` for
``hidden_size``, ``torch_dtype`` for ``dtype`` ...), and multimodal models keep the text tower's
dimensions in a nested ``text_config``. :class:`ConfigFields` looks a field up under its names, in
the order the table gives; ``verify``'s model rules and ``inspect``'s summary both read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# canonical (Llama-style) name -> every name it is stored under, preferred first
NAMES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "dtype": ("dtype", "torch_dtype"),  # transformers >= 4.56 writes "dtype", older ones "torch_dtype"
}

# config.json's dtype names -> the safetensors dtype they build the model in
CONFIG_DTYPES = {"float32": "F32", "float": "F32", "float16": "F16", "half": "F16", "bfloat16": "BF16",
                 "float64": "F64", "double": "F64"}

# Fields about the whole model: the top level wins over text_config. Every other field describes
# the text tower, where a multimodal config's text_config wins.
MODEL_LEVEL = frozenset({"model_type", "architectures", "dtype", "tie_word_embeddings"})


def as_int(v: Any) -> int | None:
    """A JSON integer (``true`` is not 1 here), or None."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class ConfigFields:
    """Field lookup across a config and its nested ``text_config``: the first value that is not
    null, under the field's names (:data:`NAMES`), text_config first except for
    :data:`MODEL_LEVEL` fields."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.top = cfg
        tc = cfg.get("text_config")
        self.text: dict[str, Any] = tc if isinstance(tc, dict) else {}

    def get(self, field: str) -> Any:
        order = (self.top, self.text) if field in MODEL_LEVEL else (self.text, self.top)
        for src in order:
            for name in NAMES.get(field, (field,)):
                v = src.get(name)
                if v is not None:
                    return v
        return None

    def summary(self, fields: tuple[str, ...]) -> dict[str, Any]:
        """``fields`` (canonical names) that have a value, in that order."""
        return {f: v for f in fields if (v := self.get(f)) is not None}


def read_config(root: Path) -> dict[str, Any] | None:
    """``root/config.json`` as a dict, or None when it is missing, unreadable, too large, not JSON
    or not an object (the model's loader would not read it either). A link is followed (a Hugging
    Face cache snapshot links every file); a FIFO is never waited on and the read is bounded."""
    from ckptctl.format import names as N
    from ckptctl.format import small

    try:
        cfg = small.read_json(root / N.CONFIG, follow=True)
    except (OSError, ValueError, RecursionError):
        return None
    return cfg if isinstance(cfg, dict) else None


def config_dtype(cfg: Any) -> str | None:
    """The safetensors dtype config.json's dtype field names, or None."""
    raw = ConfigFields(cfg).get("dtype") if isinstance(cfg, dict) else None
    return CONFIG_DTYPES.get(raw.removeprefix("torch.")) if isinstance(raw, str) else None
