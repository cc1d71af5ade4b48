"""One rank of the 2-rank Gloo job that builds the DeepSeek-V3-style and GLM-4.5-style Megatron
checkpoints (issue 43); run by ``tests/test_megatron_families_build.py``, never imported by the
tests' own process.

- ``deepseek_tp2ep2``: MLA (q_lora_rank, kv_lora_rank, YaRN), a leading dense layer
  (``moe_layer_freq=[0, 1]``), 4 experts top-2 in 2 groups (1 chosen), the sigmoid router with
  expert bias and a scaling factor, one shared expert; TP2 x EP2 (expert TP 1); per-layer keys.
- ``glm_ep2_mtp``: QKV bias, QK norms, partial rotary (0.5), a leading dense layer, a shared
  expert, the sigmoid router with expert bias, one MTP layer; EP2; per-layer keys.

Each is saved ``torch_dist`` as Megatron-LM lays it out, then loaded at degree 1 by Megatron's own
loader; its forward (MTP off: the main logits do not depend on it) gives ``oracle_logits.pt``.
Shims beyond ``tests/megatron_worker.py``'s (``/work/shared/reference/frameworks-on-cpu.md``):
MLA's ``HAVE_TE = False`` and a plain softmax core attention that takes MLA's ``k_channels``/
``v_channels``, set on the local spec provider.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.megatron_worker import ITERATION, _shims, causal_logits, degree1, run, write_oracle  # noqa: E402

HIDDEN, VOCAB, PADDED = 64, 101, 128
COMMON = dict(layers=2, heads=4, ffn=96, experts=4, moe_ffn=32, shared=32, topk=2, groups=2, group_topk=1,
              scaling=2.5, eps=1e-6, freq=[0, 1])
FIXTURES = {
    "deepseek_tp2ep2": dict(COMMON, tp=2, ep=2, mla=True, q_lora=32, kv_lora=24, qk_head=16, qk_rope=8, v_head=16,
                            rotary_base=10000.0, yarn=dict(factor=4.0, original=16, beta_fast=32.0, beta_slow=1.0,
                                                           mscale=1.0, mscale_all_dim=1.0), mtp=None, qkv_bias=False,
                            kv=None, query_groups=4, rotary_percent=1.0),
    "glm_ep2_mtp": dict(COMMON, tp=1, ep=2, mla=False, kv=16, query_groups=2, qkv_bias=True, rotary_percent=0.5,
                        rotary_base=1000000.0, yarn=None, mtp=1),
}




def _attention_shim() -> None:
    import torch
    from megatron.core.models import backends
    from megatron.core.transformer import multi_latent_attention as mla

    class Plain(torch.nn.Module):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None,
                     **_):
            super().__init__()
            self.k_channels = k_channels or config.kv_channels
            self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **_):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
            if k.shape[1] != q.shape[1]:
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            scores = (q @ k.transpose(-1, -2)) * self.scale
            s = q.shape[2]
            causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
            scores = scores.masked_fill(causal, float("-inf"))
            out = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v  # [b, h, s, dv]
            return out.permute(2, 0, 1, 3).reshape(s, out.shape[0], -1)

    mla.HAVE_TE = False
    backends.LocalSpecProvider.core_attention = lambda self: Plain


def _config(spec: dict, tp: int, ep: int):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kw = dict(
        num_layers=spec["layers"], hidden_size=HIDDEN, num_attention_heads=spec["heads"], ffn_hidden_size=spec["ffn"],
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=spec["eps"],
        add_bias_linear=False, add_qkv_bias=spec["qkv_bias"], qk_layernorm=True, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        num_moe_experts=spec["experts"], moe_router_topk=spec["topk"], moe_ffn_hidden_size=spec["moe_ffn"],
        moe_shared_expert_intermediate_size=spec["shared"], moe_layer_freq=spec["freq"],
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=spec["scaling"], moe_router_num_groups=spec["groups"],
        moe_router_group_topk=spec["group_topk"], moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        init_method_std=0.05, mtp_num_layers=spec["mtp"])
    if spec["mla"]:
        y = spec["yarn"]
        return MLATransformerConfig(
            **kw, multi_latent_attention=True, q_lora_rank=spec["q_lora"], kv_lora_rank=spec["kv_lora"],
            qk_head_dim=spec["qk_head"], qk_pos_emb_head_dim=spec["qk_rope"], v_head_dim=spec["v_head"],
            rope_type="yarn", rotary_base=spec["rotary_base"], rotary_scaling_factor=y["factor"],
            original_max_position_embeddings=y["original"], beta_fast=y["beta_fast"], beta_slow=y["beta_slow"],
            mscale=y["mscale"], mscale_all_dim=y["mscale_all_dim"], rotary_percent=spec["rotary_percent"])
    return TransformerConfig(**kw, num_query_groups=spec["query_groups"], kv_channels=spec["kv"])


def _model(spec: dict, tp: int, ep: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    cfg = _config(spec, tp, ep)
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(cfg, block, use_transformer_engine=False) if spec["mtp"] else None
    return GPTModel(cfg, block, vocab_size=PADDED, max_sequence_length=64, pre_process=True, post_process=True,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    rotary_base=int(spec["rotary_base"]), rotary_percent=spec["rotary_percent"],
                    parallel_output=False, mtp_block_spec=mtp)


def _args(spec: dict, tp: int, ep: int) -> argparse.Namespace:
    import torch

    a = dict(
        num_layers=spec["layers"], hidden_size=HIDDEN, ffn_hidden_size=spec["ffn"], num_attention_heads=spec["heads"],
        group_query_attention=not spec["mla"], num_query_groups=spec["query_groups"], kv_channels=spec["kv"],
        max_position_embeddings=64, seq_length=64, position_embedding_type="rope", rotary_base=spec["rotary_base"],
        rotary_percent=spec["rotary_percent"], use_rope_scaling=False, normalization="RMSNorm",
        norm_epsilon=spec["eps"], apply_layernorm_1p=False, qk_layernorm=True, swiglu=True, add_bias_linear=False,
        add_qkv_bias=spec["qkv_bias"], untie_embeddings_and_output_weights=True, vocab_size=VOCAB,
        padded_vocab_size=PADDED, make_vocab_size_divisible_by=64, tokenizer_type="NullTokenizer",
        num_experts=spec["experts"], moe_router_topk=spec["topk"], moe_ffn_hidden_size=spec["moe_ffn"],
        moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
        moe_shared_expert_intermediate_size=spec["shared"], moe_shared_expert_overlap=False,
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=spec["scaling"],
        moe_router_num_groups=spec["groups"], moe_router_group_topk=spec["group_topk"], moe_grouped_gemm=False,
        moe_layer_freq=list(spec["freq"]), moe_aux_loss_coeff=0.0, multi_latent_attention=spec["mla"],
        mtp_num_layers=spec["mtp"], tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=1, transformer_impl="local",
        ckpt_format="torch_dist", bf16=False, fp16=False, params_dtype=torch.float32, iteration=ITERATION, lr=0.05)
    if spec["mla"]:
        y = spec["yarn"]
        a.update(q_lora_rank=spec["q_lora"], kv_lora_rank=spec["kv_lora"], qk_head_dim=spec["qk_head"],
                 qk_pos_emb_head_dim=spec["qk_rope"], v_head_dim=spec["v_head"], rope_type="yarn",
                 rotary_scaling_factor=y["factor"], original_max_position_embeddings=y["original"],
                 beta_fast=y["beta_fast"], beta_slow=y["beta_slow"], mscale=y["mscale"],
                 mscale_all_dim=y["mscale_all_dim"])
    return argparse.Namespace(**a)


def _step(model) -> None:
    """One Adam step on random gradients, and a random expert bias (a buffer no step moves)."""
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(777 + dist.get_rank())
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=0.05)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        b = torch.Generator().manual_seed(99)  # the same on every rank: the bias is replicated
        for m in model.modules():
            if getattr(m, "expert_bias", None) is not None:
                m.expert_bias.copy_(torch.randn(m.expert_bias.shape, generator=b) * 0.3)


def _save(name: str, spec: dict, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    tp, ep = spec["tp"], spec["ep"]
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=1)
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
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()
    ps.destroy_model_parallel()


def _oracle(name: str, spec: dict, out: Path) -> None:
    model = degree1(name, out, lambda: _model(spec, 1, 1))
    if spec["mtp"]:  # 0.16.1's MTP forward needs labels; the main logits do not depend on it
        model.config.mtp_num_layers = None
        model.mtp_process = False
    write_oracle(out / name, *causal_logits(model))


def main() -> None:
    run(FIXTURES, _save, _oracle, _shims, _attention_shim)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
