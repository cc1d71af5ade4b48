"""Real DeepSpeed ZeRO checkpoints for the ZeRO source's tests, built once per session.

Run as a script, this module is one rank of a 2-rank Gloo job on DeepSpeed's CPU accelerator
(``DS_BUILD_OPS=0``): it trains tiny transformers models for three steps under ZeRO stages 1, 2
and 3, in fp32 and bf16, and saves each as the HF Trainer lays a checkpoint out
(``<name>/checkpoint-3/{config.json, tokenizer_config.json, model.safetensors, latest,
global_step3/, ...}``), then rank 0 writes DeepSpeed's own reconstruction,
``get_fp32_state_dict_from_zero_checkpoint``, to ``<name>/oracle.safetensors``: the oracle the
tests hold the export to. All the checkpoints are built by one launch (DeepSpeed's import and
first engine cost most of it; each further engine takes about a second).

DeepSpeed's CPU communication backend JIT-compiles a shared-memory op (``deepspeed_shm_comm``)
when it starts, unless DeepSpeed's table of compatible ops says the op cannot be built; the
worker fills that table before DeepSpeed probes it (2 min 41 s on this machine otherwise).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from tests.support.ranks import build_once

REPO = Path(__file__).resolve().parent.parent
STEP = 3
# name: (stage, dtype, model, extra DeepSpeed zero_optimization settings, frozen parameter)
FIXTURES = {
    "s1_fp32": (1, "fp32", "gpt2", {}, None),  # tied, odd parameter counts
    "s1_bf16": (1, "bf16", "llama-tied", {}, None),
    "s2_bf16": (2, "bf16", "llama", {}, None),  # untied head
    "s2_frozen": (2, "fp32", "gpt2", {}, "transformer.wpe.weight"),
    "s3_fp32": (3, "fp32", "gpt2", {"sub_group_size": 2000}, None),  # several flat groups per rank
    "s3_bf16": (3, "bf16", "llama", {}, None),
    "s3_frozen": (3, "fp32", "gpt2", {}, "transformer.wpe.weight"),
}
WORLD = 2
BUILD_TIMEOUT = 600
# found, not imported: the tests' own process never imports deepspeed (nor does ckptctl)
NEEDS_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (a test extra)")


def build(out: Path) -> dict[str, Path]:
    """Every fixture under ``out`` (built once: later calls find them), as ``{name: root}``
    where root holds ``checkpoint-3/`` and ``oracle.safetensors``."""
    build_once(out, [sys.executable, __file__, str(out)], world=WORLD,
               env=dict(DS_ACCELERATOR="cpu", DS_BUILD_OPS="0", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"),
               timeout=BUILD_TIMEOUT, what="DeepSpeed")
    return {name: out / name for name in FIXTURES}


@pytest.fixture(scope="session")
def zero_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{name: root}`` of every fixture (see :data:`FIXTURES`), built once per session (or once
    in ``CKPTCTL_ZERO_FIXTURES``, when set: a directory kept between sessions, for working on the
    tests; remove it after changing this module)."""
    kept = os.environ.get("CKPTCTL_ZERO_FIXTURES")
    return build(Path(kept) if kept else tmp_path_factory.getbasetemp() / "zero-fixtures")


def ckpt(root: Path) -> Path:
    """The Trainer checkpoint folder (the DeepSpeed root, with ``latest``) of a fixture."""
    return root / f"checkpoint-{STEP}"


def step(root: Path) -> Path:
    return ckpt(root) / f"global_step{STEP}"


# ---- the worker (one rank) -------------------------------------------------------------------

def _model(kind: str):
    import torch
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":  # 33 wide: odd element counts, so ZeRO pads every partition
        cfg = transformers.GPT2Config(vocab_size=101, n_embd=33, n_layer=2, n_head=3, n_positions=16,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   tie_word_embeddings=kind == "llama-tied", bos_token_id=0, eos_token_id=0,
                                   pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _groups(model, frozen: str | None):
    """Two optimizer groups, as the HF Trainer makes them (weight decay for matrices only)."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        if name == frozen:
            p.requires_grad_(False)
            continue
        (decay if p.dim() >= 2 else plain).append(p)
    return [{"params": decay, "weight_decay": 0.01}, {"params": plain, "weight_decay": 0.0}]


def _train_and_save(deepspeed, name: str, spec: tuple, out: Path) -> None:
    import torch
    import torch.distributed as dist

    stage, dtype, kind, zero_extra, frozen = spec
    model = _model(kind)
    opt = torch.optim.AdamW(_groups(model, frozen), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": stage, **zero_extra}, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": dtype == "bf16"}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(STEP):
        x = torch.randint(0, 101, (2, 8), generator=g)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    root = out / name / f"checkpoint-{STEP}"
    engine.save_checkpoint(str(root), tag=f"global_step{STEP}")
    if dist.get_rank() == 0:  # what the Trainer writes beside the DeepSpeed files
        from safetensors.torch import save_file

        model.config.save_pretrained(root)
        (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 16}))
        (root / "trainer_state.json").write_text(json.dumps({"global_step": STEP}))
        torch.save({"args": "training"}, root / "training_args.bin")
        # save_pretrained's weights: the bit16 copies (stage 3: 0-element placeholders)
        sd = {k: v.detach().clone().contiguous() for k, v in engine.module.state_dict().items()}
        if "lm_head.weight" in sd and model.config.tie_word_embeddings:
            sd.pop("lm_head.weight")
        save_file(sd, str(root / "model.safetensors"), metadata={"format": "pt"})
    for r in range(dist.get_world_size()):
        if r == dist.get_rank():
            torch.save({"rng": r}, root / f"rng_state_{r}.pth")
    dist.barrier()
    if dist.get_rank() == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        from safetensors.torch import save_file

        oracle = get_fp32_state_dict_from_zero_checkpoint(str(root))
        save_file({k: v.detach().clone().contiguous() for k, v in oracle.items()}, str(out / name / "oracle.safetensors"))
    dist.barrier()


def main() -> None:
    out = Path(sys.argv[1])
    import deepspeed
    import deepspeed.ops

    # DeepSpeed builds its shared-memory op when the table says it can: say it cannot.
    deepspeed.ops.__dict__["__compatible_ops__"] = {"deepspeed_shm_comm": False}
    deepspeed.init_distributed(dist_backend="gloo")
    for name, spec in FIXTURES.items():
        _train_and_save(deepspeed, name, spec, out)
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every file is written and closed: leave without the interpreter's teardown, where a thread
    # DeepSpeed left behind can abort the process ("terminate called without an active exception",
    # seen once in CI after every fixture was built) and fail the build for nothing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
