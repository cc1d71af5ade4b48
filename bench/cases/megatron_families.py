"""Export of a Megatron-core ``torch_dist`` mixture-of-experts checkpoint (Qwen3-MoE style: QK
norms, 32 experts top-4, about 1 GB of fp32 weights saved expert-parallel 2) to Hugging Face
safetensors, as a ratio to ``cp -r`` + ``sync`` of the iteration folder (issue 43).

The checkpoint is made by Megatron itself (this module run as a 2-rank Gloo job on the CPU,
megatron-core 0.16.1 with the shims of ``tests/megatron_worker.py``), initialised and saved at
once with ``dist_checkpointing.save`` in Megatron-LM's layout (tracker, ``iter_0000001/``,
``common.pt`` with the arguments, NullTokenizer). Each expert's gate, up and down projections
are contiguous runs of the stacked expert tensors: kernel copies.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from bench.cases._ranks import launch
from bench.gen import WORK
from bench.harness import CKPTCTL, Case, Command, clear
from ckptctl.sizes import parse_size

SIZE = parse_size(os.environ.get("CKPTCTL_BENCH_MEGATRON_MOE_SIZE", "1GB"))  # bytes of fp32 weights
WORLD = 2
HIDDEN, HEADS, GROUPS, KV, EXPERTS, MOE_FFN, TOPK, VOCAB = 1024, 16, 4, 64, 32, 512, 4, 32000


def layers_for(size: int) -> int:
    attn = HIDDEN * (HEADS + 2 * GROUPS) * KV + HIDDEN * HEADS * KV + 2 * KV + 2 * HIDDEN
    per_layer = attn + EXPERTS * 3 * HIDDEN * MOE_FFN + EXPERTS * HIDDEN
    return max(1, round((size / 4 - 2 * VOCAB * HIDDEN) / per_layer))


def root() -> Path:
    return WORK / f"megatron-moe{EXPERTS}-{SIZE // 10**6}MB-fp32-ep2"


def make() -> None:
    """The checkpoint (built once: a ``done.json`` stamp beside it)."""
    stamp = root() / "done.json"
    if stamp.exists():
        return
    clear(root())()
    root().mkdir(parents=True)
    launch("bench.cases.megatron_families", [str(root()), str(SIZE)], world=WORLD, what="Megatron MoE checkpoint",
           env=dict(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
    stamp.write_text(json.dumps({"size": SIZE, "layers": layers_for(SIZE), "experts": EXPERTS}))


def _case() -> Case:
    folder = root() / "iter_0000001"
    cp_dst, ours = (WORK / "out" / f"megatron-moe-{x}" for x in ("cp", "ckptctl"))
    return Case("megatron-moe-export", f"Megatron-core torch_dist MoE ({EXPERTS} experts, Qwen3-MoE), "
                                       f"{SIZE / 1e9:.2f} GB fp32, expert-parallel 2: to HF safetensors",
                [Command("cp -r + sync", f"cp -r {folder} {cp_dst} && sync {cp_dst}/* {cp_dst}",
                         setup=clear(cp_dst), teardown=clear(cp_dst)),
                 Command("ckptctl export", [*CKPTCTL, "export", str(root()), str(ours), "-q"], setup=clear(ours),
                         teardown=clear(ours))],
                prepare=make, prefault=3 * SIZE + 2**29)


CASES = [_case()]


def _worker(out: Path, size: int) -> None:
    """One rank: a Qwen3-MoE-shaped GPTModel of ``size`` bytes of fp32 weights, saved at once."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo")
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    mrandom.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    moe_utils.te_general_gemm = None
    ps.initialize_model_parallel(expert_model_parallel_size=WORLD)
    layers = layers_for(size)
    cfg = TransformerConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                            kv_channels=KV, ffn_hidden_size=MOE_FFN, gated_linear_unit=True, activation_func=F.silu,
                            normalization="RMSNorm", add_bias_linear=False, qk_layernorm=True,
                            use_cpu_initialization=True, params_dtype=torch.float32, expert_model_parallel_size=WORLD,
                            num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN,
                            moe_token_dispatcher_type="allgather", hidden_dropout=0.0, attention_dropout=0.0,
                            bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
                            gradient_accumulation_fusion=False, persist_layer_norm=False)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=4096, position_embedding_type="rope")
    folder = out / "iter_0000001"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    args = argparse.Namespace(
        num_layers=layers, hidden_size=HIDDEN, ffn_hidden_size=MOE_FFN, num_attention_heads=HEADS,
        group_query_attention=True, num_query_groups=GROUPS, kv_channels=KV, max_position_embeddings=4096,
        position_embedding_type="rope", rotary_base=1000000, normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True, untie_embeddings_and_output_weights=True,
        vocab_size=VOCAB - 1, padded_vocab_size=VOCAB, tokenizer_type="NullTokenizer", num_experts=EXPERTS,
        moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN, moe_router_score_function="softmax",
        expert_model_parallel_size=WORLD, ckpt_format="torch_dist")
    dist_checkpointing.save({"args": args, "checkpoint_version": 3.0, "iteration": 1,
                             "model": model.sharded_state_dict()}, str(folder))
    if dist.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text("1")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), int(sys.argv[2]))
