"""Export of a Megatron-core ``torch_dist`` checkpoint (2 GB of fp32 weights, tensor-parallel 2)
to Hugging Face safetensors, as a ratio to ``cp -r`` + ``sync`` of the iteration folder.

The checkpoint is made by Megatron itself (this module run as a 2-rank Gloo job on the CPU,
megatron-core 0.16.1 with the shims of ``tests/megatron_worker.py``): a Llama-shaped GPTModel
(GQA, SwiGLU, RMSNorm, untied head) of ``CKPTCTL_BENCH_MEGATRON_SIZE`` bytes (default 2GB),
initialised and saved at once with ``dist_checkpointing.save`` in Megatron-LM's layout
(tracker, ``iter_0000001/``, ``common.pt`` with the arguments). At tensor-parallel 2 the
q/k/v and gate/up splits are row runs (kernel copies) and ``linear_proj``/``linear_fc2`` are
column shards (streamed in windows), so both paths are measured.
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

SIZE = parse_size(os.environ.get("CKPTCTL_BENCH_MEGATRON_SIZE", "2GB"))  # bytes of fp32 weights
WORLD = 2
HIDDEN, FFN, HEADS, GROUPS, VOCAB = 2048, 5632, 16, 4, 32000


def layers_for(size: int) -> int:
    per_layer = HIDDEN * (HEADS + 2 * GROUPS) * (HIDDEN // HEADS) + HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN
    return max(1, round((size / 4 - 2 * VOCAB * HIDDEN) / per_layer))


def root() -> Path:
    return WORK / f"megatron-{SIZE // 10**6}MB-fp32-tp2"


def make() -> None:
    """The checkpoint (built once: a ``done.json`` stamp beside it)."""
    stamp = root() / "done.json"
    if stamp.exists():
        return
    clear(root())()
    root().mkdir(parents=True)
    launch("bench.cases.megatron", [str(root()), str(SIZE)], world=WORLD, what="Megatron checkpoint",
           env=dict(PYTHONWARNINGS="ignore"))
    stamp.write_text(json.dumps({"size": SIZE, "layers": layers_for(SIZE)}))


def _case() -> Case:
    folder = root() / "iter_0000001"
    cp_dst, ours, names = (WORK / "out" / f"megatron-{x}" for x in ("cp", "ckptctl", "names"))
    return Case("megatron-export", f"Megatron-core torch_dist, {SIZE / 1e9:.2f} GB fp32, tensor-parallel 2: "
                                   "to HF safetensors (Llama names, config.json)",
                [Command("cp -r + sync", f"cp -r {folder} {cp_dst} && sync {cp_dst}/* {cp_dst}",
                         setup=clear(cp_dst), teardown=clear(cp_dst)),
                 Command("ckptctl export", [*CKPTCTL, "export", str(root()), str(ours), "-q"], setup=clear(ours),
                         teardown=clear(ours)),
                 Command("ckptctl export --names megatron", [*CKPTCTL, "export", str(root()), str(names), "-q",
                                                             "--names", "megatron"],
                         setup=clear(names), teardown=clear(names))],
                prepare=make, prefault=3 * SIZE + 2**29)


CASES = [_case()]


def _worker(out: Path, size: int) -> None:
    """One rank: a Llama-shaped GPTModel of ``size`` bytes of fp32 weights, saved at once."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo")
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.transformer_config import TransformerConfig

    mrandom.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    ps.initialize_model_parallel(tensor_model_parallel_size=WORLD)
    layers = layers_for(size)
    cfg = TransformerConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                            ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=F.silu,
                            normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
                            params_dtype=torch.float32, tensor_model_parallel_size=WORLD, hidden_dropout=0.0,
                            attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
                            apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                     max_sequence_length=4096, position_embedding_type="rope")
    folder = out / "iter_0000001"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    args = argparse.Namespace(num_layers=layers, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
                              group_query_attention=True, num_query_groups=GROUPS, kv_channels=HIDDEN // HEADS,
                              max_position_embeddings=4096, position_embedding_type="rope", rotary_base=10000,
                              normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
                              add_qkv_bias=False, untie_embeddings_and_output_weights=True, vocab_size=VOCAB,
                              padded_vocab_size=VOCAB, tensor_model_parallel_size=WORLD, ckpt_format="torch_dist")
    dist_checkpointing.save({"args": args, "checkpoint_version": 3.0, "iteration": 1,
                             "model": model.sharded_state_dict()}, str(folder))
    if dist.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text("1")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), int(sys.argv[2]))
