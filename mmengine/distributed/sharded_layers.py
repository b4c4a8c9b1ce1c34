"""How a decoder layer's attention and MLP (or MoE block) are split over tensor-parallel ranks: the splits the
decoders (sharded_model.py) and the draft heads (sharded_draft_heads.py) share."""

from __future__ import annotations

from torch import nn

from mmengine.distributed.parallel_experts import ExpertParallelFusedExperts, ParallelFusedExperts
from mmengine.distributed.parallel_linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from mmengine.distributed.process_group import TensorParallelGroup
from mmengine.errors import ConfigError
from mmengine.layers.moe import FusedExperts, SparseMoeBlock
from mmengine.models.llama import DecoderAttention, DecoderMLP


def shard_layer_mlp(mlp: nn.Module, hidden: int, tp: TensorParallelGroup, prefix: str, expert_parallel: bool = False) -> None:
    """A decoder layer's MLP split, or its MoE block's experts (the router and the shared expert's gate replicated)."""
    if isinstance(mlp, SparseMoeBlock):
        if type(mlp.experts) is not FusedExperts:
            raise ConfigError(f"tensor parallelism: {prefix}'s {type(mlp.experts).__name__} is not split over ranks yet")
        experts_class = ExpertParallelFusedExperts if expert_parallel else ParallelFusedExperts
        mlp.experts = experts_class(mlp.experts, tp, f"{prefix}.experts")
        if mlp.shared_expert is not None:
            split_mlp(mlp.shared_expert, hidden, tp, f"{prefix}.shared_expert")
    elif type(mlp) is DecoderMLP:
        split_mlp(mlp, hidden, tp, prefix)
    else:
        raise ConfigError(f"tensor parallelism: {prefix}'s {type(mlp).__name__} is not split over ranks yet")


def shard_attention(attn: DecoderAttention, hidden: int, head_dim: int, tp: TensorParallelGroup, prefix: str) -> None:
    """q/k/v column-parallel in one matmul (the KV-head rule), o row-parallel."""
    qkv = QKVParallelLinear(hidden, head_dim, attn.num_heads, attn.num_kv_heads, bias=attn.qkv_proj.bias is not None, tp=tp,
                            name=f"{prefix}.qkv_proj")
    attn.o_proj = RowParallelLinear(attn.q_size, attn.o_proj.out_features, bias=attn.o_proj.bias is not None, tp=tp,
                                    name=f"{prefix}.o_proj")
    attn.qkv_proj = qkv
    attn.num_heads, attn.num_kv_heads = qkv.num_heads_per_rank, qkv.num_kv_heads_per_rank
    attn.q_size, attn.kv_size = qkv.q_size, qkv.kv_size
    attn.attn.num_heads, attn.attn.num_kv_heads = qkv.num_heads_per_rank, qkv.num_kv_heads_per_rank


def split_mlp(mlp: DecoderMLP, hidden: int, tp: TensorParallelGroup, name: str) -> None:
    """gate/up column-parallel (each split on its own), down row-parallel."""
    inter = mlp.intermediate_size
    mlp.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=mlp.gate_up_proj.bias is not None, tp=tp,
                                                  name=f"{name}.gate_up_proj")
    mlp.down_proj = RowParallelLinear(inter, hidden, bias=mlp.down_proj.bias is not None, tp=tp, name=f"{name}.down_proj")
    mlp.intermediate_size = inter // tp.size
