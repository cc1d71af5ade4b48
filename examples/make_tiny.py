"""Regenerate examples/tiny-llama: a tiny random Llama saved the PyTorch way, for the README demo.

    python examples/make_tiny.py [OUT_DIR]

Writes ``pytorch_model.bin`` (``torch.save(model.state_dict())``), ``config.json`` and
``generation_config.json``. Deterministic: the same torch and transformers versions give
byte-identical files (torch.manual_seed, CPU init, fixed file names).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "tiny-llama"
SEED = 0


def config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


def make(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config()).eval()
    torch.save(model.state_dict(), out_dir / "pytorch_model.bin")
    # What save_pretrained would record, so loaders and `ckptctl inspect` see the architecture.
    model.config.architectures = [type(model).__name__]
    model.config.dtype = "float32"
    model.config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(model.config).save_pretrained(out_dir)
    return [out_dir / n for n in ("pytorch_model.bin", "config.json", "generation_config.json")]


def main(argv: list[str]) -> int:
    for path in make(Path(argv[0]) if argv else DEFAULT_OUT):
        print(f"{path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
