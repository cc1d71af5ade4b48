"""One rank of the 2-rank Gloo job that builds the real Megatron-core checkpoints of the tests.

Run by ``tests/test_megatron_build.py`` (``python tests/megatron_worker.py OUT`` with RANK,
WORLD_SIZE, MASTER_ADDR/PORT set), never imported by the tests' own process. For each fixture of
``FIXTURES`` it builds a ``GPTModel`` with Megatron's local (non-Transformer-Engine) layer spec
at the fixture's tensor-, pipeline- and expert-parallel degrees, moves every weight with one Adam
step on random gradients (so that biases and norm weights are not their initial constants),
and saves it with ``dist_checkpointing.save`` (``torch_dist``) as Megatron-LM's
``save_checkpoint`` lays it out: ``<name>/latest_checkpointed_iteration.txt`` and
``<name>/iter_0000007/`` with, in ``common.pt``, the ``args`` namespace of Megatron-LM 0.16.1
field names, ``checkpoint_version`` 3.0 and ``iteration``; one fixture also saves Adam's state
(the non-distributed-optimizer layout).

The oracle: after every save, the parallel state is set up again at degree 1 and each
checkpoint is loaded by ``dist_checkpointing.load`` into a fresh full model, whose own forward on
fixed tokens gives ``<name>/oracle_logits.pt`` (rank 0): what the exported HF model must give, over
the NullTokenizer's ``VOCAB + 1`` columns (its EOD row is a trained row).

Shims for megatron-core 0.16.1 on CPU (facts in /work/shared/reference/frameworks-on-cpu.md):
``torch.cuda.synchronize`` a no-op, ``torch.cuda.current_device`` the CPU, ``Tensor.cuda`` the tensor itself (pipeline
stages tie the head), the CUDA RNG tracker's
``fork`` a null context, ``moe_utils.te_general_gemm = None``, and an explicit causal mask.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

ITERATION = 7
TOKENS = [[3, 17, 42, 99, 5, 64, 88, 12, 7, 31, 0, 100]]
# name: model settings (the Megatron-LM arguments they become) and parallel degrees (tp, pp, ep)
FIXTURES = {
    "llama_tp2": dict(tp=2, pp=1, ep=1, layers=2, heads=4, groups=2, tied=False, qkv_bias=False, experts=None,
                      rotary_base=500000.0, eps=1e-6, optimizer=True),
    "llama_pp2_tied": dict(tp=1, pp=2, ep=1, layers=4, heads=4, groups=1, tied=True, qkv_bias=False, experts=None,
                           rotary_base=10000.0, eps=1e-5, optimizer=False),
    "qwen2_tp2": dict(tp=2, pp=1, ep=1, layers=2, heads=4, groups=2, tied=False, qkv_bias=True, experts=None,
                      rotary_base=1000000.0, eps=1e-6, optimizer=False),
    "mixtral_ep2": dict(tp=1, pp=1, ep=2, layers=2, heads=4, groups=2, tied=False, qkv_bias=False, experts=4,
                        rotary_base=1000000.0, eps=1e-5, optimizer=False),
}
HIDDEN, FFN, VOCAB, KV = 64, 96, 101, 16
PADDED_VOCAB = 128  # make_vocab_size_divisible_by 64 (times tp)


def _shims() -> None:
    import torch

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self  # the tied head's all-reduce across pipeline stages
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    mrandom.CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    moe_utils.te_general_gemm = None


def _config(spec: dict, tp: int, pp: int, ep: int):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=spec["layers"], hidden_size=HIDDEN, num_attention_heads=spec["heads"],
        num_query_groups=spec["groups"], kv_channels=KV, ffn_hidden_size=FFN, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=spec["eps"], add_bias_linear=False,
        add_qkv_bias=spec["qkv_bias"], hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, num_moe_experts=spec["experts"], moe_router_topk=2,
        moe_ffn_hidden_size=FFN if spec["experts"] else None, moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, init_method_std=0.05)


def _model(spec: dict, tp: int, pp: int, ep: int):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = _config(spec, tp, pp, ep)
    layer = get_gpt_layer_local_spec(num_experts=spec["experts"], normalization="RMSNorm")
    return GPTModel(cfg, layer, vocab_size=PADDED_VOCAB, max_sequence_length=64,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=spec["tied"], position_embedding_type="rope",
                    rotary_base=int(spec["rotary_base"]), parallel_output=False)


def _args(spec: dict, tp: int, pp: int, ep: int) -> argparse.Namespace:
    """What Megatron-LM 0.16.1's ``save_checkpoint`` pickles as ``args`` (the fields that say
    what the model is, plus a few others as they appear there, the ``AttnBackend`` enum too)."""
    import torch
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=spec["layers"], hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=spec["heads"],
        group_query_attention=spec["groups"] != spec["heads"], num_query_groups=spec["groups"], kv_channels=KV,
        max_position_embeddings=64, seq_length=64, position_embedding_type="rope", rotary_base=spec["rotary_base"],
        rotary_percent=1.0, use_rope_scaling=False, normalization="RMSNorm", norm_epsilon=spec["eps"],
        apply_layernorm_1p=False, qk_layernorm=False, swiglu=True, add_bias_linear=False,
        add_qkv_bias=spec["qkv_bias"], untie_embeddings_and_output_weights=not spec["tied"],
        vocab_size=VOCAB, padded_vocab_size=PADDED_VOCAB, make_vocab_size_divisible_by=64,
        num_experts=spec["experts"], moe_router_topk=2, moe_ffn_hidden_size=FFN if spec["experts"] else None,
        moe_router_score_function="softmax", moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=None,
        moe_grouped_gemm=False, moe_layer_freq=1, multi_latent_attention=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        transformer_impl="local", ckpt_format="torch_dist", bf16=False, fp16=False, params_dtype=torch.float32,
        attention_backend=AttnBackend.auto, tokenizer_type="NullTokenizer", iteration=ITERATION,
        consumed_train_samples=ITERATION * 2, lr=0.05)


def _step(model, spec: dict):
    """One Adam step on random gradients (seeded by rank): every weight moves."""
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    params = [p for p in model.parameters()]
    opt = torch.optim.Adam(params, lr=0.05)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
            p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return opt


def _save(name: str, spec: dict, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    tp, pp, ep = spec["tp"], spec["pp"], spec["ep"]
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    torch.manual_seed(42)
    model = _model(spec, tp, pp, ep)
    opt = _step(model, spec)
    root = out / name
    it_dir = root / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        it_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    model_sd = model.sharded_state_dict()
    state = {"args": _args(spec, tp, pp, ep), "checkpoint_version": 3.0, "iteration": ITERATION,
             "model": model_sd, "num_floating_point_operations_so_far": 0,
             "opt_param_scheduler": {"max_lr": 0.05, "num_steps": ITERATION}}
    if spec["optimizer"]:
        from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                                optim_state_to_sharding_state)

        osd = opt.state_dict()
        for st in osd["state"].values():  # Megatron keeps the step in the param groups
            osd["param_groups"][0]["step"] = int(st.pop("step"))
        id_map = get_param_id_to_sharded_param_map(model_sd, iter(model.parameters()))
        optim_state_to_sharding_state(osd, id_map)
        state["optimizer"] = osd
    dist_checkpointing.save(state, str(it_dir))
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()
    ps.destroy_model_parallel()


def degree1(name: str, out: Path, make: Callable[[], Any]) -> Any:
    """Fixture ``name`` under ``out`` loaded by Megatron's own loader into ``make()`` (a model at
    degree 1, built after seed 7), in eval mode: the oracle's model (every worker's)."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(7)
    model = make()
    it_dir = out / name / f"iter_{ITERATION:07d}"
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(it_dir))
    model.load_state_dict(loaded["model"])
    model.eval()
    return model


def causal_logits(model: Any) -> tuple[Any, Any]:
    """``TOKENS`` and Megatron's own forward of them, with an explicit causal mask (its default
    mask is made on cuda)."""
    import torch

    tokens = torch.tensor(TOKENS)
    s = tokens.shape[1]
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True: masked
    with torch.no_grad():
        return tokens, model(tokens, torch.arange(s).unsqueeze(0), mask)


def write_oracle(folder: Path, tokens: Any, logits: Any, files: dict[str, str] | None = None) -> None:
    """Rank 0 writes ``oracle_logits.pt`` (and ``files``: name -> text) into ``folder``; then the
    degree-1 model's parallel state goes."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if dist.get_rank() == 0:
        torch.save({"tokens": tokens, "logits": logits.contiguous().clone()}, folder / "oracle_logits.pt")
        for fname, text in (files or {}).items():
            (folder / fname).write_text(text)
    dist.barrier()
    ps.destroy_model_parallel()


def run(fixtures: dict[str, dict], save: Callable[..., None], oracle: Callable[..., None],
        *shims: Callable[[], None]) -> None:
    """A worker's main: ``argv`` is the output directory and the fixtures to build (all by
    default); on Gloo, the ``shims`` applied, each fixture saved, then each one's oracle."""
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(fixtures)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for shim in shims:
        shim()
    for name in names:
        save(name, fixtures[name], out)
    for name in names:
        oracle(name, fixtures[name], out)
    dist.destroy_process_group()


def _oracle(name: str, spec: dict, out: Path) -> None:
    """Megatron's own loader and forward, at degree 1, on the saved checkpoint."""
    tokens, logits = causal_logits(degree1(name, out, lambda: _model(spec, 1, 1, 1)))
    # NullTokenizer: Megatron-LM's vocabulary is vocab_size + 1 (its EOD id is vocab_size)
    write_oracle(out / name, tokens, logits[..., :VOCAB + 1], {"spec.json": json.dumps(spec)})


def main() -> None:
    run(FIXTURES, _save, _oracle, _shims)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # a normal exit: its teardown stops the processes Megatron's saving started (os._exit would
    # leave them running, holding the log pipe the fixture builder reads to its end)
    main()
