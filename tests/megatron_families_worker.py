"""One rank of the 2-rank Gloo job that builds the newer Megatron families' checkpoints (issue 43).

Run by ``tests/test_megatron_families_build.py`` (``python tests/megatron_families_worker.py OUT
NAME...``, RANK/WORLD_SIZE/MASTER_ADDR/PORT set), never imported by the tests' own process. Each
fixture of ``FIXTURES`` is a ``GPTModel`` of megatron-core 0.16.1 built with the local spec at its
parallel degrees, moved by one Adam step on random gradients, saved ``torch_dist`` as Megatron-LM
lays a checkpoint out (tracker, ``iter_0000007/``, ``common.pt`` with the ``args`` of Megatron-LM
field names), then loaded at degree 1 by Megatron's own loader, whose forward on fixed tokens gives
``oracle_logits.pt`` (every padded column: the test keeps the vocabulary it expects).

- ``qwen3_tp2``: QK norms, ``kv_channels`` (24) other than hidden / heads (16), GQA, TP2,
  NullTokenizer (vocabulary ``vocab_size + 1``).
- ``qwen3_moe_ep2`` / ``qwen3_moe_grouped_ep2``: QK norms + 4 experts top-2 at EP2, sequential
  and grouped experts (``moe_grouped_gemm``); the grouped one records a HuggingFaceTokenizer
  (its size is not in the arguments).
- ``qwen3_moe_dense_ep2``: 3 layers, the middle one dense (``moe_layer_freq=[1, 0, 1]``, HF's
  ``mlp_only_layers=[1]``): per-layer keys.

Shims (``/work/shared/reference/frameworks-on-cpu.md``): those of ``tests/megatron_worker.py``,
and for grouped experts ``grouped_gemm.ops.gmm`` as a loop of matmuls, ``config.bf16`` set after
building (the weights stay fp32).

Each fixture also gets ``bridge_run_config.yaml`` beside its ``--save`` root: the model's
TransformerConfig as Megatron-Bridge records it in ``run_config.yaml`` (tests put it in the
iteration folder in place of ``common.pt``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.megatron_worker import ITERATION, _shims, causal_logits, degree1, run, write_oracle  # noqa: E402

HIDDEN, VOCAB, PADDED = 64, 101, 128
FIXTURES = {
    "qwen3_tp2": dict(tp=2, ep=1, layers=2, heads=4, groups=2, kv=24, ffn=96, experts=None, grouped=False,
                      tied=False, eps=1e-6, rotary_base=1000000.0, tokenizer="NullTokenizer"),
    "qwen3_moe_ep2": dict(tp=1, ep=2, layers=2, heads=4, groups=2, kv=16, ffn=96, experts=4, moe_ffn=32,
                          grouped=False, tied=False, eps=1e-6, rotary_base=1000000.0, tokenizer="NullTokenizer"),
    "qwen3_moe_dense_ep2": dict(tp=1, ep=2, layers=3, heads=4, groups=2, kv=16, ffn=96, experts=4, moe_ffn=32,
                                grouped=False, tied=False, eps=1e-6, rotary_base=1000000.0, tokenizer="NullTokenizer",
                                freq=[1, 0, 1]),
    "qwen3_moe_grouped_ep2": dict(tp=1, ep=2, layers=2, heads=4, groups=2, kv=16, ffn=96, experts=4, moe_ffn=32,
                                  grouped=True, tied=True, eps=1e-6, rotary_base=1000000.0,
                                  tokenizer="HuggingFaceTokenizer"),
}


def _grouped_shim() -> None:
    import torch
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    def gmm(a, b, batch_sizes, trans_b=False):
        outs, start = [], 0
        for e, n in enumerate(batch_sizes.tolist()):
            w = b[e].t() if trans_b else b[e]
            outs.append(a[start:start + n] @ w)
            start += n
        return torch.cat(outs) if outs else a.new_zeros((0, b.shape[-1]))

    gg.grouped_gemm = SimpleNamespace(ops=SimpleNamespace(gmm=gmm))
    gg.ops = gg.grouped_gemm.ops


def _config(spec: dict, tp: int, ep: int):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    experts = spec["experts"]
    return TransformerConfig(
        num_layers=spec["layers"], hidden_size=HIDDEN, num_attention_heads=spec["heads"],
        num_query_groups=spec["groups"], kv_channels=spec["kv"], ffn_hidden_size=spec["ffn"], gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=spec["eps"], add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, num_moe_experts=experts, moe_router_topk=2,
        moe_ffn_hidden_size=spec.get("moe_ffn"), moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=spec["grouped"], moe_layer_freq=spec.get("freq", 1), bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, init_method_std=0.05)


def _model(spec: dict, tp: int, ep: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    cfg = _config(spec, tp, ep)
    layer = get_gpt_layer_local_spec(num_experts=spec["experts"], moe_grouped_gemm=spec["grouped"],
                                     qk_layernorm=True, normalization="RMSNorm")
    if "freq" in spec:  # layers that differ: the block spec (saved with per-layer keys)
        layer = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(cfg, layer, vocab_size=PADDED, max_sequence_length=64, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=spec["tied"], position_embedding_type="rope",
                     rotary_base=int(spec["rotary_base"]), parallel_output=False)
    if spec["grouped"]:
        cfg.bf16 = True  # GroupedMLP's forward asserts it; the weights stay fp32
    return model


def _args(spec: dict, tp: int, ep: int) -> argparse.Namespace:
    import torch

    experts = spec["experts"]
    return argparse.Namespace(
        num_layers=spec["layers"], hidden_size=HIDDEN, ffn_hidden_size=spec["ffn"], num_attention_heads=spec["heads"],
        group_query_attention=True, num_query_groups=spec["groups"], kv_channels=spec["kv"],
        max_position_embeddings=64, seq_length=64, position_embedding_type="rope", rotary_base=spec["rotary_base"],
        rotary_percent=1.0, use_rope_scaling=False, normalization="RMSNorm", norm_epsilon=spec["eps"],
        apply_layernorm_1p=False, qk_layernorm=True, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=not spec["tied"], vocab_size=VOCAB if spec["tokenizer"] == "NullTokenizer"
        else None, padded_vocab_size=PADDED, make_vocab_size_divisible_by=64, tokenizer_type=spec["tokenizer"],
        num_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=spec.get("moe_ffn"),
        moe_router_score_function="softmax", moe_router_pre_softmax=False, moe_shared_expert_intermediate_size=None,
        moe_grouped_gemm=spec["grouped"], moe_layer_freq=spec.get("freq", 1), moe_aux_loss_coeff=0.0,
        multi_latent_attention=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, expert_model_parallel_size=ep,
        transformer_impl="local", ckpt_format="torch_dist", bf16=False, fp16=False, params_dtype=torch.float32,
        iteration=ITERATION, lr=0.05)


def _run_config(cfg, spec: dict) -> dict:
    """What Megatron-Bridge records as ``run_config.yaml`` for this model: the model provider's
    fields (TransformerConfig's, plain values; functions as OmegaConf ``_target_`` records) and
    the tokenizer section."""
    import dataclasses

    model = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v is None or isinstance(v, (bool, int, float, str)) or (
                isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)):
            model[f.name] = v
        elif callable(v) and getattr(v, "__module__", None) and getattr(v, "__name__", None):
            model[f.name] = {"_target_": f"{v.__module__}.{v.__name__}", "_call_": False}
    model.update(share_embeddings_and_output_weights=spec["tied"], seq_length=64, position_embedding_type="rope",
                 rotary_base=spec["rotary_base"], rotary_percent=1.0, vocab_size=PADDED,
                 make_vocab_size_divisible_by=64)
    return {"model": model, "tokenizer": {"tokenizer_type": spec["tokenizer"],
                                          "vocab_size": VOCAB if spec["tokenizer"] == "NullTokenizer" else None}}


def _step(model) -> None:
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(4321 + dist.get_rank())
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=0.05)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
            p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def _save(name: str, spec: dict, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    tp, ep = spec["tp"], spec["ep"]
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    torch.manual_seed(42)
    model = _model(spec, tp, ep)
    _step(model)
    root = out / name
    it_dir = root / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        it_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"args": _args(spec, tp, ep), "checkpoint_version": 3.0, "iteration": ITERATION,
             "model": model.sharded_state_dict()}
    dist_checkpointing.save(state, str(it_dir))
    if dist.get_rank() == 0:
        import yaml

        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        # beside the save (a Bridge checkpoint has it in the iteration folder, and no args)
        (root / "bridge_run_config.yaml").write_text(yaml.safe_dump(_run_config(model.config, spec)))
    dist.barrier()
    ps.destroy_model_parallel()


def _oracle(name: str, spec: dict, out: Path) -> None:
    write_oracle(out / name, *causal_logits(degree1(name, out, lambda: _model(spec, 1, 1))))


def main() -> None:
    run(FIXTURES, _save, _oracle, _shims, _grouped_shim)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
